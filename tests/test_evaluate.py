"""pass@k against brute force, maj@k tie-breaking, avg@n, the CLI end to end, bad input."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_script
from evaluate import majority_vote, pass_at_k, summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 1), (5, 2), (6, 3), (6, 6), (7, 0), (8, 5)])
def test_pass_at_k_matches_enumeration_of_all_k_subsets(n, c):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), f"pass_at_k({n}, {c}, {k})"


def test_majority_vote_and_ties():
    # Clear majority, answers compared after normalisation ("1,000" == "1000").
    assert majority_vote(["1000", "1,000", "7"], [True, True, False]) is True
    assert majority_vote(["7", "7", "1000"], [False, False, True]) is False
    # Tie: the answer seen first wins, whatever its correctness.
    assert majority_vote(["5", "6", "6", "5"], [True, False, False, True]) is True
    assert majority_vote(["6", "5", "5", "6"], [False, True, True, False]) is False
    # Samples without an answer do not vote; nobody voting is wrong.
    assert majority_vote([None, None, "3"], [False, False, True]) is True
    assert majority_vote([None, None], [False, False]) is False


def test_summarize_avg_pass_maj():
    samples = []
    for pid, correct in (("a", [1, 0, 0, 0]), ("b", [1, 1, 1, 1]), ("c", [0, 0, 0, 0])):
        for k, ok in enumerate(correct):
            samples.append({"id": pid, "correct": bool(ok), "extracted": "1" if ok else str(k + 5),
                            "length": 10 * (k + 1), "truncated": k == 3})
    row = summarize(samples, 4)
    assert row["problems"] == 3
    assert row["avg@n"] == pytest.approx((0.25 + 1 + 0) / 3)
    assert row["pass@1"] == pytest.approx(row["avg@n"])
    assert row["pass@4"] == pytest.approx(2 / 3)
    assert row["pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + 1 + 0) / 3)
    # Problem a: four different answers, the first (correct) wins the tie.
    assert row["maj@n"] == pytest.approx(2 / 3)
    assert row["mean_len"] == pytest.approx(25.0)
    assert row["truncated"] == pytest.approx(0.25)


def _run(args, timeout=600):
    return subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_evaluate_end_to_end(tiny_model_dir, tmp_path):
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i} + 1?", "answer": str(i + 1)})
                            + "\n" for i in range(5)))
    out = tmp_path / "eval"
    result = _run(["--model", tiny_model_dir, "--data", f"{data},arith", "--limit", "5", "-n", "4",
                   "--temperature", "1.0", "--max-new-tokens", "6", "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["datasets"]) == {"five", "arith"}
    # the machine's choices recorded (the suite pins SMOLRL_DECODE=flash: fp32 grows its cache)
    assert (results["dtype"], results["decoding"]) in {("bf16", "flash"), ("fp32", "grow")}
    for row in results["datasets"].values():
        assert row["problems"] == 5
        for key in ("avg@n", "pass@1", "pass@2", "pass@4", "maj@2", "maj@n", "truncated"):
            assert 0.0 <= row[key] <= 1.0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 5 * 4
    assert set(samples[0]) >= {"dataset", "id", "sample", "completion", "extracted", "correct"}
    assert "template" in result.stdout and "avg@n" in result.stdout


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n', "row 2 has no 'answer' field"),
    ("", "no rows"),
    ('{"problem": "1+1", "answer": "2"}\nnot json\n', "line 2 is not valid JSON"),
])
def test_bad_input_is_a_one_line_error(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content)
    result = run_script("evaluate.py", ["--data", str(path), "--out", str(tmp_path / "o")])
    assert result.returncode != 0
    assert message in result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_outputs_and_names_are_checked_before_the_model_loads(tmp_path):
    """Two datasets of one name would leave one unreported; --out a file was a traceback after
    the model loaded; a --data file that is --out's samples.jsonl was moved aside as "an earlier
    evaluation". One line each, before loading, and the user's file where it was."""
    row = '{"problem": "1+1", "answer": "2"}\n'
    for folder in "ab":
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test.jsonl").write_text(row)
    (tmp_path / "afile").write_text("")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "samples.jsonl").write_text(row)
    model = ["--model", str(tmp_path / "no-model")]  # (refused before: it never loads)
    for args, said in [
            (["--data", f"{tmp_path}/a/test.jsonl,{tmp_path}/b/test.jsonl",
              "--out", str(tmp_path / "o")], "two datasets named test"),
            (["--data", f"{tmp_path}/a/test.jsonl", "--out", str(tmp_path / "afile")],
             "cannot make that folder"),
            (["--data", f"{tmp_path}/mine/samples.jsonl", "--out", str(tmp_path / "mine")],
             "is the samples.jsonl this evaluation writes")]:
        result = run_script("evaluate.py", args + model)
        assert result.returncode != 0 and said in result.stderr, result.stderr[-500:]
        assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["samples.jsonl"]


def test_majority_vote_counts_equivalent_answers_together():
    # gold 1/2: three correct answers written three ways outvote "3", which appears twice
    assert majority_vote(["3", "0.5", "1/2", "\\frac{1}{2}", "3"],
                         [False, True, True, True, False]) is True
    # three wrong answers that are all 0.5 outvote the correct "7" (twice)
    assert majority_vote(["7", "0.5", "1/2", "0.50", "7"],
                         [True, False, False, False, True]) is False
    # wrong answers that only a symbolic check equates: the grader decides
    from reward import Grader
    grader = Grader(timeout=10)
    try:
        same = lambda a, b: grader.grade([a], [b])[0]  # noqa: E731
        assert majority_vote(["4", "\\sqrt{8}", "2\\sqrt{2}", "4"], [True, False, False, True],
                             same) is True  # 2 vs 2: the class seen first wins
        assert majority_vote(["\\sqrt{8}", "4", "2\\sqrt{2}"], [False, True, False], same) is False
    finally:
        grader.close()


def test_correct_answers_vote_together_even_when_only_math_verify_equates_them():
    # gold 2*sqrt(2): three correct answers in two spellings beat "5" twice
    assert majority_vote(["5", "\\sqrt{8}", "2\\sqrt{2}", "\\sqrt{8}", "5"],
                         [False, True, True, True, False]) is True


def test_summarize_reports_exactly_these_columns():
    samples = [{"id": "a", "correct": ok, "extracted": "1", "length": 3, "truncated": False}
               for ok in (True, False, True, True)]
    assert list(summarize(samples, 4)) == ["problems", "avg@n", "pass@1", "pass@2", "pass@4",
                                           "maj@2", "maj@n", "mean_len", "truncated"]


def test_a_sample_printed_during_training_reaches_the_terminal_escaped(capsys):
    """The samples a run prints every --log-samples-every steps: a dataset's answer with an
    escape sequence in it (OSC 52, a clipboard write) shows as text, and a long one (a code
    dataset's tests) shortened, both on one line."""
    from evaluate import show_samples
    osc = "\x1b]52;c;ZWNobyBwd25lZA==\x07"
    rows = [{"answer": f"{osc}\n42"}, {"answer": "x" * 100_000}]
    show_samples(rows, [f"{osc} The answer is 42.", "The answer is 7."], [1.0, 0.0], k=2)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.isprintable() for line in lines)
    assert "answer \\x1b]52;c;ZWNobyBwd25lZA==\\x07\\n42)" in lines[0]
    assert len(lines[1]) < 1000 and "characters left out" in lines[1]


def test_a_vllm_engine_is_sized_for_the_longest_prompt_it_will_be_given(tokenizer):
    """evaluate.py has no --max-prompt-tokens: it reads its data before the model, so its vLLM
    engine is sized for the data's longest prompt, counted as generate gets it -- the chat
    template's, or an episode's first turn with the tools shown."""
    from data import encode_prompts
    from env import Agent, ToolChat, load_tools
    from evaluate import EvalConfig, longest_prompt
    rows = [{"problem": "1 + 1", "answer": "2"}, {"problem": "2 + 2 * 3 - 7 + 10", "answer": "9"}]
    datasets, cfg = {"a": rows[:1], "b": rows[1:]}, EvalConfig()
    plain = encode_prompts(tokenizer, rows, cfg.template, cfg.chat)
    assert longest_prompt(tokenizer, datasets, cfg) == max(map(len, plain)) == len(plain[1])
    agent = Agent(ToolChat(tokenizer, load_tools("calculator")), "{problem}", 2, 64)
    episodes = agent.start(rows, 1)
    assert longest_prompt(tokenizer, datasets, cfg, agent) == len(episodes[1].prompt_ids)
    assert len(episodes[1].prompt_ids) > len(plain[1])  # (the tools' description)


@pytest.mark.parametrize("name, content, said", [
    ("a.jsonl", b'{"problem": "1+1", "answer": "2"}\n{"problem": "\xff\x1b]52;c;eA==\x07"}\n',
     "line 2 is not UTF-8 (byte 0xff)"),
    ("a.csv", b"problem,answer\n1+1,2\n\xe9t\xe9,2\n", "line 3 is not UTF-8 (byte 0xe9)"),
    ("a.json", b'[{"problem": "\xff"}]', "line 1 is not UTF-8 (byte 0xff)"),
    ("a.jsonl", b'{"problem": "1+1", "answer": ' + b"9" * 5000 + b"}\n",
     "line 1 is not valid JSON (Exceeds the limit (4300 digits)"),
    ("a.json", b"[" * 100_000 + b"]" * 100_000, "not valid JSON (nested too deeply"),
    ("a.jsonl", '{"problem": "a\u2028b\x85c", "answer": "2"}\n'.encode(), None),
    ("a.csv", b"\xef\xbb\xbfproblem,answer\n1+1,2\n", None),
])
def test_a_data_file_of_any_bytes_loads_or_is_refused_in_one_line(tmp_path, name, content,
                                                                  said):
    """Bytes that are not UTF-8 (a CSV saved as Latin-1), a number json cannot read, arrays
    nested past its depth: one printable line naming the file and the line (each was a
    traceback); a line holding U+2028 or NEL inside a string is one row (the
    lines were split there: "not valid JSON"), and a CSV's byte-order mark no part of its first
    column's name."""
    from data import load_table
    path = tmp_path / name
    path.write_bytes(content)
    if said is None:
        rows = load_table(str(path))
        assert len(rows) == 1 and rows[0]["answer"] == "2" and "problem" in rows[0]
        return
    with pytest.raises(SystemExit) as stop:
        load_table(str(path))
    assert str(stop.value).startswith(f"error: {path}: {said}"), str(stop.value)
    assert str(stop.value).isprintable()


def test_an_earlier_evaluation_in_out_is_moved_aside_not_overwritten(tmp_path, capsys):
    """`python evaluate.py --model A` then `--model B`, both into the default out/eval: B's
    results.json and samples.jsonl replaced A's, an evaluation of hours gone without a word. Now
    A's are moved whole to out/eval/superseded/<time>/ first, and the line says where."""
    from evaluate import write_results
    out = tmp_path / "eval"
    out.mkdir()
    write_results(out, {"model": "A"}, [{"sample": "a"}])
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    said = write_results(out, {"model": "B"}, [{"sample": "b"}])
    [aside] = (out / "superseded").iterdir()
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == first
    assert json.loads((out / "results.json").read_text()) == {"model": "B"}
    assert said == (f"{out} held an earlier evaluation: its results.json, samples.jsonl are "
                    f"moved to {aside} (delete it when you no longer need it)")

"""Arriving from TRL: reward functions, datasets and --reward spellings work unchanged."""

import asyncio
import csv
import importlib
import json
import subprocess
import sys

import pytest

from conftest import ROOT, read_metrics, run_grpo
from reward import Grader, RewardFunctions

TRL_REWARDS = ("tests/trl_rewards.py:length_penalty,tests.trl_rewards:tagged_format,"
               "tests.trl_rewards.matches_solution,tests.trl_rewards:only_for_long_prompts,"
               "tests.trl_rewards:judged_remotely")


def _run_args(model_dir, data, out, *extra):
    return ["--model", model_dir, "--data", str(data), "--steps", "2", "--prompts-per-step", "2",
            "--num-generations", "4", "--max-new-tokens", "6", "--eval-every", "0",
            "--out", str(out), *extra]


def test_trl_style_rewards_on_a_conversational_dataset(tiny_model_dir, tmp_path):
    data = tmp_path / "conversational.jsonl"
    data.write_text("".join(json.dumps({
        "prompt": [{"role": "system", "content": "Answer briefly."},
                   {"role": "user", "content": f"What is {i} plus {i + 1} in total?"}],
        "solution": str(2 * i + 1)}) + "\n" for i in range(6)))
    run_grpo(_run_args(tiny_model_dir, data, tmp_path / "run", "--reward", TRL_REWARDS))
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward_errors"] == 0
        assert r["reward_tests.trl_rewards:only_for_long_prompts"] == 0.5  # None did not count
        assert "accuracy" not in r  # measured only where the data has reference answers


def test_a_csv_with_its_own_column_names(tiny_model_dir, tmp_path):
    data = tmp_path / "problems.csv"
    with open(data, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["question", "final"])
        writer.writerows([[f"What is {i} + 2?", i + 2] for i in range(20)])
    run_grpo(_run_args(tiny_model_dir, data, tmp_path / "run", "--prompt-field", "question",
                       "--answer-field", "final", "--eval-every", "2", "--eval-size", "4"))
    records = read_metrics(tmp_path / "run")
    assert "eval_accuracy" in records[-1]  # the tail of the CSV, graded against `final`


def test_a_mis_declared_reward_stops_at_startup_with_one_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "solution": "1"}) + "\n")
    result = subprocess.run([sys.executable, "grpo.py", "--data", str(data), "--reward",
                             "tests.trl_rewards:needs_a_label", "--out", str(tmp_path / "o")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: reward function 'tests.trl_rewards:needs_a_label' needs label, which the data "
        "does not have (columns: 'id', 'problem', 'solution'); map a column (--answer-field, "
        "--prompt-field) or give the parameter a default"]


SEEN = {}


def _keywords_only(completions, solution, prompts, **kwargs):
    SEEN.update(kwargs, solution=solution, prompts=prompts)
    return [1.0] * len(completions)


def test_rewards_are_called_by_keyword_with_every_column():
    fns = RewardFunctions("tests.test_trl_compat:_keywords_only", "boxed", Grader(),
                          columns={"solution", "difficulty"})
    total, _ = fns(["p1", "p2"], ["a", "b"], [[1], [2]],
                   [{"solution": "s1", "difficulty": 3}, {"solution": "s2", "difficulty": 5}])
    assert total == [1.0, 1.0]
    seen = importlib.import_module("tests.test_trl_compat").SEEN  # the copy --reward loaded
    assert seen["solution"] == ["s1", "s2"] and seen["prompts"] == ["p1", "p2"]
    assert seen["completion_ids"] == [[1], [2]] and seen["difficulty"] == [3, 5]


def test_none_means_does_not_apply_and_async_functions_are_awaited():
    fns = RewardFunctions("tests.trl_rewards:only_for_long_prompts,"
                          "tests.trl_rewards:judged_remotely=2", "boxed", Grader())
    prompts = ["one two three four five", "short"]
    total, per_fn = fns(prompts, ["abc", "abcd"], None, [{}, {}])
    assert per_fn["tests.trl_rewards:only_for_long_prompts"] == [0.5, None]
    assert per_fn["tests.trl_rewards:judged_remotely"] == [1.0, 0.0]
    assert total == [0.5 + 2.0, 0.0]  # the None left sample 2's total alone
    assert asyncio.iscoroutinefunction(fns.fns[1][1])


def test_async_rewards_also_run_inside_a_running_event_loop():
    """In a Jupyter notebook an event loop is already running, where asyncio.run refuses to start
    another: the async functions must still be awaited."""
    fns = RewardFunctions("tests.trl_rewards:judged_remotely", "boxed", Grader())

    async def notebook_cell():
        return fns(["q", "q"], ["abc", "abcd"], None, [{}, {}])

    total, _ = asyncio.run(notebook_cell())
    assert total == [1.0, 0.0] and fns.errors == 0


def test_a_reward_failing_every_batch_stops_the_run(capsys):
    fns = RewardFunctions("tests.test_reward:_broken_reward", "boxed", Grader())
    for _ in range(2):
        fns(["q"], ["a"], None, [{}])
    with pytest.raises(SystemExit, match="failed on 3 batches in a row"):
        fns(["q"], ["a"], None, [{}])


@pytest.mark.parametrize("spec", ["my_rewards:short", "my_rewards.short",
                                  "{dir}/my_rewards.py:short"])
def test_reward_spellings_from_the_current_directory(spec, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, **kwargs):\n    return [float(len(c) < 3) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    sys.modules.pop("my_rewards", None)
    fns = RewardFunctions(spec.format(dir=tmp_path), "boxed", Grader(), columns={"answer"})
    assert fns(["q", "q"], ["ab", "abcd"], None, [{}, {}])[0] == [1.0, 0.0]

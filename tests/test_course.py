"""The course kit: the assignment is cut from the library itself, the reference scores 100 % and the
stubs 0 %, each classic bug costs exactly its exercise's points, the student copy's own tests
run, and docs/walkthrough.md shows what the code computes."""

import ast
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "course"))
from grade import Refused, grade, gradescope, splice, take_function  # noqa: E402
from make_exercises import INSTRUCTOR_ONLY, load_exercises, make_exercises, project_files  # noqa: E402
from walkthrough import DOC, doc_blocks, walkthrough  # noqa: E402

EXERCISES = load_exercises()
POINTS = {ex["name"]: ex["points"] for ex in EXERCISES}
# The classic bugs, one line each: (exercise, file, right line, wrong line).
BUGS = {
    "KL sign flipped": ("grpo_loss", "grpo.py", "log_r = ref_logprobs - logprobs",
                        "log_r = logprobs - ref_logprobs"),
    "token-mean replaced by seq-mean": (
        "grpo_loss", "grpo.py",
        "loss = (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))",
        "loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / "
        "(num_tokens or mask.shape[0])"),
    "biased pass@k": ("pass_at_k", "evaluate.py",
                      "return 1.0 - math.comb(n - c, k) / math.comb(n, k)",
                      "return 1.0 - (1 - c / n) ** k"),
    "log-prob positions off by one": ("completion_logprobs", "logprobs.py",
                                      "hidden = hidden[rows, pos - 1]", "hidden = hidden[rows, pos]"),
    "GAE steps through a tool's result": ("gae", "ppo.py",
                                          "next_value = torch.where(step, values[:, t], next_value)",
                                          "next_value = values[:, t]"),
    "the value clip keeps the optimistic term": ("value_loss", "ppo.py",
                                                 "per_token = 0.5 * torch.max(unclipped, clipped)",
                                                 "per_token = 0.5 * torch.min(unclipped, clipped)"),
    "the reward margin's sign flipped": ("reward_loss", "rm.py",
                                         "losses = -F.logsigmoid(gap - (0.0 if margin",
                                         "losses = -F.logsigmoid(gap + (0.0 if margin"),
    "reverse KL computed as forward": ("token_divergence", "distill.py",
                                       "return (s.exp() * (s - t)).sum(-1)",
                                       "return (t.exp() * (t - s)).sum(-1)"),
}


# Ways a copy with untouched stubs could score without writing a line, if the grader ran anything
# of the student's folder but the exercise functions (issue 27): (file, code appended to it).
ATTACKS = {
    "a root conftest.py that reports every test passed": ("conftest.py", '''
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
'''),
    "an atexit hook in grpo.py that rewrites the report pytest wrote": ("grpo.py", '''

import atexit as _atexit
import sys as _sys


def _all_passed():
    import xml.etree.ElementTree as ET
    for path in [arg.split("=", 1)[1] for arg in _sys.argv if arg.startswith("--junitxml=")]:
        tree = ET.parse(path)
        for case in tree.iter("testcase"):
            for problem in list(case):
                case.remove(problem)
        tree.write(path)


_atexit.register(_all_passed)
'''),
    "a pytest.py that shadows pytest and writes an all-pass report": ("pytest.py", '''
import sys

tests = [arg for arg in sys.argv[1:] if "::" in arg]
cases = "".join(f'<testcase classname="{t.split("::")[0][:-3].replace("/", ".")}" '
                f'name="{t.split("::")[1]}"/>' for t in tests)
for path in [arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("--junitxml=")]:
    open(path, "w").write(f"<testsuites><testsuite>{cases}</testsuite></testsuites>")
print(f"{len(tests)} passed")
'''),
}


def _copy_with_bugs(dest: Path, bugs: list[tuple]) -> Path:
    for rel in project_files(ROOT):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    for _, file, right, wrong in bugs:
        source = (dest / file).read_text()
        assert source.count(right) == 1, f"{file} no longer has `{right}`: update BUGS"
        (dest / file).write_text(source.replace(right, wrong))
    return dest


def _grades(folder: Path):
    return grade(folder, EXERCISES)


def test_grades_reference_stubs_and_each_classic_bug(tmp_path):
    """Reference 100 %, stubs 0 %, and every seeded bug loses exactly its exercise's points. The
    bugs share copies, no two of one exercise in a copy (each grade is a pytest process that
    imports torch and transformers: ~8 s); a copy loses exactly its bugs' exercises."""
    stubs = tmp_path / "assignment"
    make_exercises(stubs, ROOT, EXERCISES)
    copies: list[dict] = []  # each: exercise -> the name of the bug seeded in it
    for name, (exercise, *_) in BUGS.items():  # (to the emptiest copy that can take it)
        free = min((c for c in copies if exercise not in c), key=len, default=None)
        if free is None:
            copies.append(free := {})
        free[exercise] = name
    buggy = {f"bugs{i}": _copy_with_bugs(tmp_path / f"bugs{i}", [BUGS[n] for n in c.values()])
             for i, c in enumerate(copies)}
    folders = {"reference": ROOT, "stubs": stubs, **buggy}
    with ThreadPoolExecutor(2) as pool:
        grades = dict(zip(folders, pool.map(_grades, folders.values())))
    scores = {folder: {g.name: g.score for g in gs} for folder, gs in grades.items()}
    assert scores["reference"] == POINTS
    assert scores["stubs"] == {name: 0 for name in POINTS}
    assert len(copies) < len(BUGS)
    for i, bugs in enumerate(copies):
        assert scores[f"bugs{i}"] == {**POINTS, **dict.fromkeys(bugs, 0)}, bugs
    # A failure reads as the hand-computed example's expected value against the student's.
    i = next(i for i, c in enumerate(copies) if "pass_at_k" in c)
    with_pass_at_k, lost = grades[f"bugs{i}"], copies[i]
    failed = [r for g in with_pass_at_k if g.name == "pass_at_k"
              for r in g.results if not r.passed]
    assert "[4-1]" in failed[0].test and "expected 0.5 ± 1.0e-12, got 0.4375" in failed[0].message
    assert all("not written yet" in r.message for g in grades["stubs"] for r in g.results)
    # grade.json in Gradescope's format: one entry per exercise
    results = gradescope(with_pass_at_k)
    assert results["score"] == sum(p for name, p in POINTS.items() if name not in lost)
    assert {(t["name"], t["score"], t["max_score"]) for t in results["tests"]} == \
        {(name, 0 if name in lost else p, p) for name, p in POINTS.items()}
    assert "FAIL test_pass_at_k" in next(t["output"] for t in results["tests"]
                                         if t["name"] == "pass_at_k")


def test_nothing_of_the_copy_runs_but_its_exercise_functions(tmp_path):
    """Untouched stubs score 0 whatever else the copy adds: a conftest.py that rewrites reports,
    module-level code that edits the report after pytest wrote it, a pytest.py that shadows
    pytest."""
    stubs = tmp_path / "assignment"
    make_exercises(stubs, ROOT, EXERCISES)
    attacked = []
    for i, (file, code) in enumerate(ATTACKS.values()):
        copy = shutil.copytree(stubs, tmp_path / f"attack{i}")
        with open(copy / file, "a") as f:
            f.write(code)
        attacked.append(copy)
    # Three exercises whose tests are quick, one of them in grpo.py, where the atexit attack is.
    quick = [ex for ex in EXERCISES if ex["name"] in ("extract_boxed", "pass_at_k",
                                                      "group_advantages")]
    with ThreadPoolExecutor(2) as pool:
        scores = {attack: {g.name: g.score for g in grades}
                  for attack, grades in zip(ATTACKS, pool.map(lambda f: grade(f, quick),
                                                              attacked))}
    assert scores == {attack: {ex["name"]: 0 for ex in quick} for attack in ATTACKS}


def test_the_grader_never_parses_from_two_threads_at_once(tmp_path, monkeypatch):
    """CPython 3.11's parser is not thread-safe (a new user's AMX run failed with "AST constructor
    recursion depth mismatch" under ThreadPoolExecutor(2)): every parse in grade.py is serialised.
    The stand-in parser sleeps inside, so two threads in it at once would be seen."""
    import threading
    import time
    inside, most, lock, real = [0], [0], threading.Lock(), ast.parse

    def watched(*args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    ex = next(ex for ex in EXERCISES if ex["name"] == "pass_at_k")
    (tmp_path / ex["file"]).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / ex["file"]).write_text("def pass_at_k(n, c, k):\n    return 1.0\n")
    monkeypatch.setattr(ast, "parse", watched)
    with ThreadPoolExecutor(4) as pool:
        taken = list(pool.map(lambda _: take_function(tmp_path, ex), range(8)))
    assert taken == ["def pass_at_k(n, c, k):\n    return 1.0"] * 8
    assert most[0] == 1


def test_only_a_plain_top_level_def_is_taken_from_the_students_file(tmp_path):
    """The exercise's `def` alone goes into the reference, in place of its own; what cannot be
    taken scores 0 with one line saying why, and then no test runs at all."""
    ex = next(ex for ex in EXERCISES if ex["name"] == "pass_at_k")
    student = tmp_path / ex["file"]

    def taken(source):
        student.write_text(source)
        return take_function(tmp_path, ex)

    written = "def pass_at_k(n, c, k):\n    return 1.0"
    around = "import atexit\natexit.register(print)\n\n{}\nprint('loaded')\n"
    assert taken(around.format(written)) == written
    reference = (ROOT / ex["file"]).read_text()
    ours = next(n for n in ast.parse(reference).body if getattr(n, "name", "") == "pass_at_k")
    assert splice(reference, written, "pass_at_k") == \
        reference.replace(ast.get_source_segment(reference, ours), written)
    refused = {"def pass_at_k(n, c, k:\n": "does not parse: SyntaxError",
               "class Mine:\n    def pass_at_k(n, c, k):\n        return 1.0\n":
                   "no function pass_at_k at the top level",
               "import functools\n\n\n@functools.cache\n" + written:
                   "decorators are not its stub's"}
    for source, why in refused.items():
        with pytest.raises(Refused, match=why):
            splice(reference, taken(source), "pass_at_k")
    student.unlink()
    student.symlink_to(ROOT / ex["file"])  # say, the autograder's copy of the solution
    with pytest.raises(Refused, match="link"):
        take_function(tmp_path, ex)
    student.unlink()
    student.write_text("def pass_at_k(n, c, k:\n")
    messages = {g.name: {r.message for r in g.results} for g in grade(tmp_path, EXERCISES)}
    assert messages == {e["name"]: {f"does not parse: SyntaxError: '(' was never closed "
                                    f"({ex['file']}:1)" if e is ex else
                                    f"no {e['file']} in the copy (a link to one does not count)"}
                        for e in EXERCISES}


def test_stubs_keep_signature_and_docstring_and_nothing_else_changes(tmp_path):
    make_exercises(tmp_path / "a", ROOT, EXERCISES)
    assert sorted(set(project_files(ROOT)) - INSTRUCTOR_ONLY) == sorted(project_files(tmp_path / "a"))
    for ex in EXERCISES:
        ours, theirs = (ast.parse((root / ex["file"]).read_text()) for root in (ROOT, tmp_path / "a"))
        fn = [n for n in ast.walk(ours) if getattr(n, "name", None) == ex["name"]][0]
        stub = [n for n in ast.walk(theirs) if getattr(n, "name", None) == ex["name"]][0]
        assert ast.dump(stub.args) == ast.dump(fn.args)
        assert ast.get_docstring(stub) == ast.get_docstring(fn)
        assert isinstance(stub.body[-1], ast.Raise) and len(stub.body) == 2  # docstring + raise
    # The library's own files carry no exercise markers; only the copy's stubs do.
    assert not any("NotImplementedError(\"exercise" in (ROOT / p).read_text(errors="ignore")
                   for p in project_files(ROOT) if p.suffix == ".py" and p.parts[0] != "course")


def test_an_existing_folder_is_never_overwritten(tmp_path):
    (tmp_path / "mine.py").write_text("a student's work")
    with pytest.raises(SystemExit, match="not empty"):
        make_exercises(tmp_path, ROOT, EXERCISES)
    assert (tmp_path / "mine.py").read_text() == "a student's work"


def test_the_student_copy_runs_its_own_tests(tmp_path):
    """In the copy, the exercises' tests fail, a test that needs an exercise waits for it
    (skipped, naming it), the rest pass."""
    copy = tmp_path / "assignment"
    make_exercises(copy, ROOT, EXERCISES)
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", "tests/test_grpo_loss.py",
                    "tests/test_evaluate.py::test_summarize_avg_pass_maj"],
                   cwd=copy, capture_output=True, text=True, timeout=300)
    outcome = {}
    for case in ET.parse(report).iter("testcase"):
        kind = next((k for k in ("failure", "error", "skipped") if case.find(k) is not None), "pass")
        outcome[case.get("name").split("[")[0]] = (kind, (case.find(kind).get("message")
                                                          if kind != "pass" else ""))
    exercise_tests = {t.split("::")[1] for ex in EXERCISES for t in ex["tests"]}
    for name, (kind, message) in outcome.items():
        if name in exercise_tests:
            assert kind == "failure", name
        elif name == "test_summarize_avg_pass_maj":
            assert kind == "skipped" and "waits for exercise pass_at_k" in message
        else:
            assert kind == "pass", (name, message)
    assert "test_loss_denominator_counts_only_sequences_in_the_loss" in outcome  # others ran


def test_walkthrough_doc_matches_the_code():
    sections = walkthrough()
    blocks = doc_blocks(DOC.read_text())
    assert len(blocks) == len(sections)
    for (title, text), block in zip(sections, blocks):
        assert block == text, f"docs/walkthrough.md's '{title}' block is stale: run " \
                              f"python course/walkthrough.py --update-doc"

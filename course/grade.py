"""Grade a student's copy of the smolrl assignment: the project's own tests for each exercise in
course/exercises.toml, run against the student's functions, a score per exercise.

    python course/grade.py STUDENT_DIR [--json grade.json]     # or: make grade STUDENT=...

An exercise earns its points when every one of its tests passes. The tests are the instructor's
(this checkout's tests/, copied over the student's in a scratch folder), so a student who edits a
test changes nothing. Each failure is shown as the hand-computed example's expected value against
the student's, not as a traceback. grade.json follows Gradescope's results format: one entry per
exercise with its score, maximum and output.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_exercises import ROOT, load_exercises, project_files  # noqa: E402

TIMEOUT = 600  # seconds for all the tests; a student's endless loop fails, it does not hang


@dataclass
class Result:
    """One test of one exercise: its name, whether it passed, and what went wrong."""
    test: str
    passed: bool
    message: str = ""


@dataclass
class Grade:
    name: str
    points: int
    results: list[Result] = field(default_factory=list)

    @property
    def score(self) -> int:  # all or nothing: an exercise is right when all its tests are
        return self.points if self.results and all(r.passed for r in self.results) else 0


def grade(student: Path, exercises: list[dict], tests_from: Path = ROOT) -> list[Grade]:
    """Run every exercise's tests in a scratch copy of `student` with `tests_from`'s tests/."""
    with tempfile.TemporaryDirectory(prefix="smolrl-grade-") as scratch:
        work = Path(scratch) / "copy"
        for rel in project_files(student):
            if rel.parts[0] != "tests":
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(student / rel, work / rel)
        shutil.copytree(tests_from / "tests", work / "tests",
                        ignore=shutil.ignore_patterns("__pycache__"))
        by_exercise = run_tests(work, [t for ex in exercises for t in ex["tests"]])
        if by_exercise is None:  # the run crashed or hung: one exercise at a time finds which
            by_exercise = {}
            for ex in exercises:
                by_exercise.update(run_tests(work, ex["tests"]) or
                                   {t: [Result(t, False, "the tests crashed or ran past "
                                                        f"{TIMEOUT} s")] for t in ex["tests"]})
    return [Grade(ex["name"], ex["points"],
                  [r for t in ex["tests"] for r in by_exercise.get(t, [Result(t, False, "not run")])])
            for ex in exercises]


def run_tests(work: Path, tests: list[str]) -> dict[str, list[Result]] | None:
    """pytest on `tests` in `work`; results by the test id as exercises.toml names it (a
    parametrised test has several). None when pytest crashed or timed out."""
    report = work / "report.xml"
    report.unlink(missing_ok=True)
    try:
        # -vv: pytest shows whole values, so a failure can be told as expected against got
        ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-vv", "-p", "no:cacheprovider",
                              "-o", "addopts=", f"--junitxml={report}", *tests],
                             cwd=work, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return None
    if not report.exists():  # pytest stopped before any test: say why (e.g. conftest's imports)
        why = import_error(ran.stdout + ran.stderr, work) if "rror" in ran.stdout + ran.stderr \
            else None
        return {t: [Result(t.split("::")[-1], False, why)] for t in tests} if why else None
    results: dict[str, list[Result]] = {}
    broken = {}  # test modules that could not be imported: every test in them fails with this
    for case in ET.parse(report).iter("testcase"):
        module, name = case.get("classname", ""), case.get("name", "")
        problem = next((case.find(kind) for kind in ("failure", "error", "skipped")
                        if case.find(kind) is not None), None)
        if not module:  # a collection error: name is the test module, the text its traceback
            broken[name.replace(".", "/") + ".py"] = import_error(problem.text or "", work)
            continue
        # classname "tests.test_x" + name "test_y[1-2]" -> "tests/test_x.py::test_y"
        test_id = f"{module.replace('.', '/')}.py::{name.split('[')[0]}"
        message = "" if problem is None else explain(problem)
        results.setdefault(test_id, []).append(Result(name, problem is None, message))
    for t in tests:  # in a module that does not import
        if t not in results and t.split("::")[0] in broken:
            results[t] = [Result(t.split("::")[-1], False, broken[t.split("::")[0]])]
    rest = [t for t in tests if t not in results]
    if rest and broken:  # pytest stops at a module it cannot collect: run the others again
        results.update(run_tests(work, rest) or {})
    for t in tests:
        results.setdefault(t, [Result(t.split("::")[-1], False, "not run")])
    return results


def import_error(traceback: str, work: Path) -> str:
    """A module that does not import, said in one line: the error and where it is."""
    lines = [line.removeprefix("E").strip() for line in traceback.splitlines()]
    errors = [line for line in lines if re.match(r"\w*(Error|Exception)\b", line)]
    error = errors[-1] if errors else next((line for line in reversed(lines) if line), "?")
    # Python's `File "x.py", line 3` (a SyntaxError) or pytest's `x.py:3: in <module>`
    places = re.findall(r'File "([^"]+)", line (\d+)|^(\S+\.py):(\d+): in ', traceback, re.M)
    places = [(a or c, b or d) for a, b, c, d in places]
    if places:
        file, line = places[-1]
        error += f" ({Path(file).relative_to(work) if file.startswith(str(work)) else file}:{line})"
    return f"does not import: {error}"


def explain(problem: ET.Element) -> str:
    """What a student needs from a failure: the comparison the test made, as expected against got
    (pytest writes `assert GOT == EXPECTED`, and a table for lists), or the exception; then the
    line that failed."""
    message = (problem.get("message") or "").strip()
    text = problem.text or ""
    if "NotImplementedError: exercise" in text + message:
        return "not written yet (NotImplementedError)"
    if problem.tag == "skipped":
        return f"skipped: {message}"
    lines = [line.strip() for line in message.removeprefix("AssertionError: ").splitlines()
             if line.strip()]
    first = lines[0] if lines else "failed"
    # The test's own message (say, the call that failed) comes before pytest's `assert` line.
    said = "" if first.startswith("assert ") else first + ": "
    first = next((line for line in lines if line.startswith("assert ")), first)
    table = [line.split("|") for line in lines if re.match(r"\d+\s*\|", line)]
    compared = re.match(r"assert (.+?) == (.+)$", first)
    if table:  # pytest.approx on a list: index | obtained | expected
        detail = "; ".join(f"[{i.strip()}] expected {e.strip()}, got {o.strip()}"
                           for i, o, e in table[:3]) + (" ..." if len(table) > 3 else "")
    elif compared:
        got, expected = compared.groups()
        detail = f"expected {expected}, got {got}"
        where = next((line for line in lines if line.lstrip("+ ").startswith("where ")), "")
        detail += f" ({where.lstrip('+ ')})" if where else ""
    else:
        detail = first
    failing = [line[1:].strip() for line in text.splitlines() if line.startswith(">")]
    return (said + detail)[:400] + (f"   at: {failing[-1][:160]}" if failing else "")


def show(grades: list[Grade]) -> str:
    lines = []
    for g in grades:
        failed = [r for r in g.results if not r.passed]
        status = (f"ok ({len(g.results)} tests)" if not failed
                  else f"{len(failed)} of {len(g.results)} tests fail")
        if len(failed) == len(g.results) and len({r.message for r in failed}) == 1:
            lines.append(f"  {g.name:<22} {g.score:>3}/{g.points:<3} {failed[0].message}")
            continue  # one reason for every test: said once
        lines.append(f"  {g.name:<22} {g.score:>3}/{g.points:<3} {status}")
        for r in failed[:3]:  # the first few are enough to start from
            lines.append(f"      {r.test}: {r.message}")
        if len(failed) > 3:
            lines.append(f"      ... and {len(failed) - 3} more")
    total, most = sum(g.score for g in grades), sum(g.points for g in grades)
    lines.append(f"  {'total':<22} {total:>3}/{most}")
    return "\n".join(lines)


def gradescope(grades: list[Grade]) -> dict:
    return {"score": sum(g.score for g in grades),
            "tests": [{"name": g.name, "score": g.score, "max_score": g.points,
                       "output": "\n".join(f"{'PASS' if r.passed else 'FAIL'} {r.test}"
                                           + (f": {r.message}" if r.message else "")
                                           for r in g.results)}
                      for g in grades]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("student", type=Path, help="the student's copy (from make_exercises.py)")
    parser.add_argument("--json", type=Path, default=None,
                        help="where to write the Gradescope results (default: STUDENT/grade.json)")
    args = parser.parse_args()
    exercises = load_exercises()
    missing = [ex["file"] for ex in exercises if not (args.student / ex["file"]).is_file()]
    if missing:
        raise SystemExit(f"error: {args.student} is not a copy of the assignment: no "
                         f"{', '.join(sorted(set(missing)))}")
    grades = grade(args.student, exercises)
    print(f"grading {args.student}\n{show(grades)}")
    out = args.json or args.student / "grade.json"
    out.write_text(json.dumps(gradescope(grades), indent=2) + "\n")
    print(f"wrote {out}")

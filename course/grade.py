"""Grade a student's copy of the smolrl assignment: the project's own tests for each exercise in
course/exercises.toml, run against the student's functions, a score per exercise.

    python course/grade.py STUDENT_DIR [--json grade.json]     # or: make grade STUDENT=...

Only the exercise functions are taken from the student's copy: each one's source, cut out of their
file with `ast`, replaces the reference implementation in a scratch copy of this checkout, whose
tests then grade it. Nothing else of theirs runs or is even copied (a conftest.py, a pytest.py,
module-level code, another module, a data file), so nothing else can change the grade. An exercise
earns its points when every one of its tests passes. Each failure is shown as the hand-computed
example's expected value against the student's, not as a traceback. grade.json follows
Gradescope's results format: one entry per exercise with its score, maximum and output.

Not a sandbox: a student's function runs with the grader's rights when a test calls it, and could
cheat from there (course/README.md says what is and is not protected). Grade untrusted classes in a
container.
"""

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_exercises import ROOT, load_exercises, project_files  # noqa: E402

TIMEOUT = 600  # seconds for all the tests; a student's endless loop fails, it does not hang
# All of the grader's environment the tests see: what Python and torch need, no tokens or keys for
# a student's function to read, no PYTHONPATH or PYTEST_ADDOPTS to change what runs.
KEPT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "OMP_NUM_THREADS")
FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)
# CPython 3.11's parser keeps its recursion depth per interpreter, not per thread: two threads
# parsing at once can fail with "SystemError: AST constructor recursion depth mismatch". Graders
# run in threads (one pytest subprocess each), so every parse here takes this lock.
_PARSING = threading.Lock()


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """ast.parse, one thread at a time (see _PARSING)."""
    with _PARSING:
        return ast.parse(source, filename)


class Refused(Exception):
    """An exercise's function cannot be taken from the student's copy: it scores 0, saying why."""


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


def grade(student: Path, exercises: list[dict], reference: Path = ROOT) -> list[Grade]:
    """Run every exercise's tests in a scratch copy of `reference` (this checkout: the instructor's
    code and tests) holding the student's exercise functions in place of the reference ones."""
    with tempfile.TemporaryDirectory(prefix="smolrl-grade-") as scratch:
        work = Path(scratch)
        refused = build_scratch(work, student, exercises, reference)
        graded = [ex for ex in exercises if ex["name"] not in refused]
        by_test = run_tests(work, [t for ex in graded for t in ex["tests"]]) if graded else {}
        if by_test is None:  # the run crashed or hung: one exercise at a time finds which
            by_test = {}
            for ex in graded:
                by_test.update(run_tests(work, ex["tests"]) or
                               {t: [Result(t, False, "the tests crashed or ran past "
                                                     f"{TIMEOUT} s")] for t in ex["tests"]})
    by_test |= {t: [Result(t.split("::")[-1], False, refused[ex["name"]])]
                for ex in exercises if ex["name"] in refused for t in ex["tests"]}
    return [Grade(ex["name"], ex["points"],
                  [r for t in ex["tests"] for r in by_test.get(t, [Result(t, False, "not run")])])
            for ex in exercises]


def build_scratch(work: Path, student: Path, exercises: list[dict], reference: Path) -> dict:
    """Copy `reference` to `work` and splice in the student's exercise functions; returns, by
    exercise, why a function could not be taken (that exercise keeps the reference's, ungraded)."""
    theirs = student.resolve()
    for rel in project_files(reference):
        if theirs != reference.resolve() and theirs in (reference / rel).resolve().parents:
            continue  # a student's copy kept inside this checkout: none of it goes in
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(reference / rel, work / rel)
    refused = {}
    for ex in exercises:
        module = work / ex["file"]
        try:
            module.write_text(splice(module.read_text(), take_function(student, ex), ex["name"]))
        except Refused as why:
            refused[ex["name"]] = str(why)
    return refused


def take_function(student: Path, ex: dict) -> str:
    """The source of exercise `ex`'s function in the student's copy, decorators included: the
    top-level `def` of that name (the last, as Python binds it) and not a character around it."""
    file = ex["file"]
    path = student / file
    if path.is_symlink() or not path.is_file():  # a link could point at the instructor's solution
        raise Refused(f"no {file} in the copy (a link to one does not count)")
    try:
        source = path.read_text(encoding="utf-8")  # text mode: line ends are "\n", as ast counts
        tree = parse(source, file)
    except SyntaxError as e:
        raise Refused(f"does not parse: SyntaxError: {e.msg} ({file}:{e.lineno})")
    except ValueError as e:  # not UTF-8, a null byte
        raise Refused(f"does not parse: {type(e).__name__}: {e} ({file})")
    defs = [node for node in tree.body if isinstance(node, FUNCTION) and node.name == ex["name"]]
    if not defs:
        raise Refused(f"no function {ex['name']} at the top level of {file}")
    fn = defs[-1]
    first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    function = "\n".join(source.split("\n")[first - 1:fn.end_lineno])
    # What goes into the scratch copy is one `def` and nothing else: nothing around it can run.
    try:
        alone = parse(function).body
    except SyntaxError:
        alone = []
    if not (len(alone) == 1 and isinstance(alone[0], FUNCTION) and alone[0].name == ex["name"]):
        raise Refused(f"{ex['name']} in {file} cannot be cut out as one function: write it as a "
                      f"plain top-level def")
    return function


def splice(source: str, function: str, name: str) -> str:
    """`source` (a reference module) with its top-level function `name` replaced by `function`.
    The student's decorators must be the reference's: a decorator of theirs would run at import,
    outside the function. (Default values and annotations run at import too: part of the def.)"""
    ours = [node for node in parse(source).body if isinstance(node, FUNCTION)
            and node.name == name]
    if not ours:
        raise SystemExit(f"error: the reference has no top-level function {name} to grade")
    ours, theirs = ours[-1], parse(function).body[0]
    if [ast.dump(d) for d in theirs.decorator_list] != [ast.dump(d) for d in ours.decorator_list]:
        raise Refused(f"{name}'s decorators are not its stub's: only the function is graded, and "
                      f"a decorator would run outside it")
    lines = source.split("\n")
    first = min([ours.lineno] + [d.lineno for d in ours.decorator_list])
    return "\n".join(lines[:first - 1] + [function] + lines[ours.end_lineno:])


def run_tests(work: Path, tests: list[str]) -> dict[str, list[Result]] | None:
    """pytest on `tests` in `work`; results by the test id as exercises.toml names it (a
    parametrised test has several). None when pytest crashed or timed out. The report is written
    to a folder of the grader's outside `work`: code that writes into the project it runs in (a
    report.xml beside the tests, say) cannot touch it."""
    with tempfile.TemporaryDirectory(prefix="smolrl-results-") as private:
        report = Path(private) / "report.xml"
        try:
            # -vv: pytest shows whole values, so a failure can be told as expected against got
            ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-vv", "-p",
                                  "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}",
                                  *tests], cwd=work, env=tests_environment(), capture_output=True,
                                 text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return None
        if not report.exists():  # pytest stopped before any test: say why (e.g. conftest's imports)
            why = import_error(ran.stdout + ran.stderr, work) if "rror" in ran.stdout + ran.stderr \
                else None
            return {t: [Result(t.split("::")[-1], False, why)] for t in tests} if why else None
        cases = list(ET.parse(report).iter("testcase"))
    results: dict[str, list[Result]] = {}
    broken = {}  # test modules that could not be imported: every test in them fails with this
    for case in cases:
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


def tests_environment() -> dict[str, str]:
    return {name: os.environ[name] for name in KEPT_ENV if name in os.environ} | {
        "PYTHONDONTWRITEBYTECODE": "1"}  # nothing written into the scratch copy but by the tests


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
    asserted = next((line for line in lines if line.startswith("assert ")), first)
    # The test's own message (say, the call that failed) comes before pytest's `assert` line.
    said = "" if asserted == first else first + ": "
    first = asserted
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
    if first.startswith("NameError"):  # most likely a helper or an import outside the function
        detail += " (only the exercise's function is graded: define what it uses inside it)"
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

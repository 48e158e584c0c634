"""Write the smolrl assignment: a complete copy of the project in which the functions listed in
course/exercises.toml keep their signature and docstring but lose their body.

    python course/make_exercises.py OUT_DIR      # or: make exercises OUT=OUT_DIR

The stubs are cut from the real source with `ast`, so the assignment can never drift from the
library: the same tests grade the student's functions (course/grade.py), and with them in place the
copy's `python grpo.py` trains a real model with the real loop.
"""

import argparse
import ast
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = Path(__file__).with_name("exercises.toml")
# Never copied: environments, outputs, caches, a student's own grading results.
SKIP = {".git", ".venv", "out", "__pycache__", ".pytest_cache", "smolrl.egg-info", "grade.json"}
# Not in the assignment: the course kit's own tests grade the instructor's tree, not a student's.
INSTRUCTOR_ONLY = {Path("tests/test_course.py")}


def load_exercises(path: Path = EXERCISES) -> list[dict]:
    exercises = tomllib.loads(path.read_text())["exercise"]
    for ex in exercises:
        missing = {"name", "file", "points", "hint", "tests"} - set(ex)
        if missing:
            raise SystemExit(f"error: {path}: exercise {ex.get('name', '?')} lacks "
                             f"{', '.join(sorted(missing))}")
    return exercises


def stub_source(source: str, name: str, hint: str, filename: str) -> str:
    """`source` with function `name`'s body (everything after its docstring) replaced by a hint
    and a NotImplementedError."""
    tree = ast.parse(source)
    found = [node for node in ast.walk(tree)
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name]
    if len(found) != 1:
        raise SystemExit(f"error: {filename}: expected one function {name}, found {len(found)}")
    fn = found[0]
    docstring = fn.body[0]
    if not (isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
            and isinstance(docstring.value.value, str)):
        raise SystemExit(f"error: {filename}: {name} has no docstring to keep for the student")
    lines = source.splitlines(keepends=True)
    indent = " " * fn.body[-1].col_offset
    hint_lines = textwrap.wrap(hint, 96 - len(indent), break_on_hyphens=False)
    body = (f"{indent}# Exercise {name} (course/exercises.toml). Hint:\n"
            + "".join(f"{indent}#   {line}\n" for line in hint_lines)
            + f'{indent}raise NotImplementedError("exercise {name}: not written yet")\n')
    # Lines are 1-based: keep up to the docstring's last line, replace through the body's last.
    stubbed = "".join(lines[:docstring.end_lineno]) + body + "".join(lines[fn.end_lineno:])
    ast.parse(stubbed)  # still valid Python
    return stubbed


def project_files(root: Path) -> list[Path]:
    """The project's files, relative to root: what git tracks (plus new files it does not ignore)
    when root is a checkout, else everything outside SKIP."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                                cwd=root, capture_output=True, text=True, check=True).stdout
        files = [Path(p) for p in listed.splitlines()]
    else:
        files = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [s for s in subfolders if s not in SKIP]
            files += [Path(folder, n).relative_to(root) for n in names]
    return [p for p in files if not SKIP & set(p.parts) and (root / p).is_file()]


def make_exercises(out: Path, root: Path = ROOT, exercises: list[dict] | None = None) -> list[str]:
    """Copy the project at `root` to `out` and stub the exercises; returns their names."""
    exercises = exercises or load_exercises()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} exists and is not empty: choose a new folder (nothing "
                         f"there is overwritten)")
    for rel in project_files(root):
        if rel in INSTRUCTOR_ONLY or out.resolve() in (root / rel).resolve().parents:
            continue  # (an assignment written inside the project is not part of the next one)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, out / rel)
    for ex in exercises:
        path = out / ex["file"]
        path.write_text(stub_source(path.read_text(), ex["name"], ex["hint"], ex["file"]))
    add_waiting_hook(out / "tests" / "conftest.py", exercises)
    return [ex["name"] for ex in exercises]


# Appended to the copy's tests/conftest.py: a test that is not an exercise's own but reaches an
# unwritten exercise (a training run, an engine test) is reported as skipped, naming what it waits
# for, so `make test` in the copy shows exactly the exercises failing and everything else passing.
WAITING_HOOK = '''

# ---------------------------------------------------------------------------------------------
# Added by course/make_exercises.py (the assignment only).
EXERCISE_TESTS = {exercise_tests!r}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or item.nodeid.split("[")[0] in EXERCISE_TESTS:
        return
    text = str(report.longrepr) + "".join(content for _, content in report.sections)
    marker = "NotImplementedError: exercise "
    if marker in text:
        waits_for = text.split(marker, 1)[1].split(":", 1)[0]
        report.outcome, report.longrepr = "skipped", (str(item.path), item.location[1] or 0,
                                                      f"waits for exercise {{waits_for}}")
'''


def add_waiting_hook(conftest: Path, exercises: list[dict]):
    tests = sorted({t for ex in exercises for t in ex["tests"]})
    conftest.write_text(conftest.read_text() + WAITING_HOOK.format(exercise_tests=tests))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="a new folder for the student's copy")
    args = parser.parse_args()
    names = make_exercises(args.out)
    print(f"wrote the assignment to {args.out}/ with {len(names)} exercises to write: "
          f"{', '.join(names)}", file=sys.stdout)
    print(f"students: cd {args.out} && make test    instructors: make grade STUDENT={args.out}")

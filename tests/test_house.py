"""The shape of the house (issue 42), checked from the code itself: who imports whom -- an
algorithm file imports only modules below it, a pure loss may cross between algorithm files, a
loop never, and no cycle anywhere -- and the sizes that keep each algorithm file a story: its own
Config, the story beside it, its main."""

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("grpo", "sft", "dpo", "distill", "rm", "ppo")
MODULES = sorted(p.stem for p in ROOT.glob("*.py"))


def imports(module: str) -> dict[str, set[str]]:
    """{imported product module: the names taken from it ("*": the module itself)}, anywhere in
    the file (imports inside functions included); the module's import of itself (grpo.py's
    __main__ block) left out."""
    found = {}
    for node in ast.walk(ast.parse((ROOT / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, set()).add("*")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.setdefault(node.module, set()).update(a.name for a in node.names)
    return {m: names for m, names in found.items() if m in MODULES and m != module}


def test_an_algorithm_file_takes_only_pure_losses_from_another_and_nothing_below_takes_it():
    for module in MODULES:
        for other, names in imports(module).items():
            if other not in ALGORITHMS:
                continue
            assert module in ALGORITHMS, f"{module}.py imports {other}.py, an algorithm above it"
            assert all(name.endswith("_loss") for name in names), \
                f"{module}.py takes {sorted(names)} from {other}.py: only pure losses may cross"


def test_no_module_imports_itself_back_through_others():
    graph = {module: set(imports(module)) for module in MODULES}
    state = {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(path + [module])
        state[module] = "open"
        for other in sorted(graph[module]):
            visit(other, path + [module])
        state[module] = "done"

    for module in MODULES:
        visit(module, [])


@pytest.mark.parametrize("module", ALGORITHMS)
def test_each_algorithm_file_reads_as_a_story(module):
    """Its own Config at most 100 lines, the story beside it at most 450, main at most 60."""
    source = (ROOT / f"{module}.py").read_text()
    tree = ast.parse(source)
    spans = {node.name: node.end_lineno - node.lineno + 1 for node in tree.body
             if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    lines = len(source.splitlines())
    assert spans["Config"] <= 100, spans["Config"]
    assert lines - spans["Config"] <= 450, lines - spans["Config"]
    assert spans["main"] <= 60, spans["main"]


def test_the_grpo_loss_is_within_grpo_pys_first_200_lines():
    import grpo
    assert inspect.getsourcelines(grpo.grpo_loss)[1] <= 200


def test_every_mutant_still_finds_the_line_it_changes():
    """benchmarks/mutants.py names each mutant's file and line; when code moves between files
    (as it did for this house) a mutant whose line is gone would silently test nothing."""
    import sys
    sys.path.append(str(ROOT / "benchmarks"))  # (after the repository, as test_gpu_check.py)
    import mutants
    lost = [f"{m.name}: {m.file}" for m in mutants.MUTANTS
            if (ROOT / m.file).read_text().count(m.old) != 1]
    assert not lost, lost


SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("docs/*.py"),
                  *ROOT.glob("course/*.py"), *ROOT.glob("recipes/**/*.py"),
                  *ROOT.glob("experiments/*.py")])


def test_every_name_a_script_takes_from_the_product_is_still_there():
    """The benchmarks and other scripts run outside the suite: a name one imports that a change
    renamed fails only when someone runs it (benchmarks/vs_trl.py took data.row_stream for a day
    after it became data.RowStream)."""
    import importlib
    missing = []
    for path in SCRIPTS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
                module = importlib.import_module(node.module)
                missing += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}"
                            for a in node.names if not hasattr(module, a.name)]
    assert not missing, missing


def module_names(tree) -> set[str]:
    """Every name a module binds anywhere at its top level or by import (in a function too: a
    lazy import binds a local, which symtable sees as local, not global)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Global):
            names |= set(node.names)
    for statement in tree.body:
        for node in ast.walk(statement):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                names.add(node.name)
    return names


def test_no_function_reads_a_global_its_module_never_binds():
    """A function moved to another module (issue 70 split four) can leave a name behind: a
    NameError only when that line runs -- in a GPU-only or Ray-only branch, never in CI. Each
    product module, test and script: every global a function reads is bound in its module."""
    import builtins
    import symtable
    known = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__builtins__",
                                  "__loader__", "__path__", "__annotations__"}
    unbound = []
    for path in [*(ROOT / f"{m}.py" for m in MODULES), *ROOT.glob("tests/*.py"), *SCRIPTS]:
        source = path.read_text()
        bound = module_names(ast.parse(source)) | known

        def walk(table):
            for name in table.get_identifiers():
                symbol = table.lookup(name)
                if symbol.is_referenced() and name not in bound and (
                        symbol.is_global() or table.get_type() == "module"):
                    unbound.append(f"{path.relative_to(ROOT)}: {table.get_name()} reads {name}")
            for child in table.get_children():
                walk(child)
        walk(symtable.symtable(source, str(path), "exec"))
    assert not unbound, unbound


def test_the_suite_deletes_each_passing_tests_folder(pytestconfig):
    # The suite's checkpoints come to about 10 GB a run; kept, they filled CI's disk (stop 75).
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
    assert int(pytestconfig.getini("tmp_path_retention_count")) <= 1


def test_no_script_in_a_folder_shares_a_name_with_a_module():
    """Tests put benchmarks/, experiments/, course/ and docs/ on sys.path to import their
    scripts. When benchmarks/weight_sync.py, rollout_log.py and reward_models.py shared a name with
    the module each measured, a test that put benchmarks/ first made every file collected after it
    in the same worker import the benchmark instead (`pytest tests/test_gpu_check.py
    tests/test_distributed.py`: "cannot import name 'WeightGroup'"); whatever the order of the path,
    a name used once imports one file."""
    modules = {p.name for p in ROOT.glob("*.py")}
    shared = sorted(f"{folder}/{p.name}" for folder in ("benchmarks", "experiments", "course",
                                                         "docs", "recipes", "tests")
                    for p in (ROOT / folder).glob("*.py") if p.name in modules)
    assert not shared, f"named as a module at the repository's root: {shared}"

"""The documentation as a new user meets it: the README's commands run, its links lead somewhere,
docs/options.md says what --help says, and no page dates itself ("this morning").

Fast: no model loads. The commands are parsed in-process with --dry-run, which resolves a config
(task defaults, the dtype check) and exits before anything is loaded or downloaded.
"""

import contextlib
import functools
import importlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs"))

import make_options  # noqa: E402  (docs/make_options.py)
from cli import parse_config  # noqa: E402

PAGES = sorted([ROOT / "README.md", ROOT / "course" / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "course" / "labs").glob("*.md")])
CONFIGS = {"grpo.py": ("grpo", "Config"), "sft.py": ("sft", "Config"),
           "dpo.py": ("dpo", "Config"), "rm.py": ("rm", "Config"), "ppo.py": ("ppo", "Config"),
           "evaluate.py": ("evaluate", "EvalConfig"), "distill.py": ("distill", "Config")}
# Words that date a page to the hour it was written: a reader next month cannot place them.
DATE_RELATIVE = ["yesterday", "today", "tonight", "this morning", "this afternoon",
                 "this evening", "last night", "earlier today", "the day before", "the day after",
                 "the evening before", "the morning before", "the night before", "a slow hour",
                 "a slower hour", "a faster hour", "last week", "this week", "an earlier session",
                 "this session", "the code of the day before", "back then"]


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def config(script: str):
    module, cls = CONFIGS[script]
    return getattr(importlib.import_module(module), cls)


# ---------------------------------------------------------------------------------------------
# docs/options.md is generated from the configs and agrees with --help


def test_options_page_is_what_the_generator_writes():
    assert (ROOT / "docs" / "options.md").read_text() == make_options.render(), \
        "docs/options.md is out of date: run python docs/make_options.py"


def help_flags(script: str) -> set[str]:
    """Every option string in `python SCRIPT --help`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        parse_config(config(script), ["--help"])
    assert exit_.value.code == 0
    flags = set()
    for line in out.getvalue().split("options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags |= {part.split()[0] for part in invocation.split(", ")}
    return flags


def page_flags(section: str) -> set[str]:
    """The flags in the first column of the tables under `## SECTION` in docs/options.md."""
    text = (ROOT / "docs" / "options.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return {flag for line in body.splitlines() if line.startswith("| `")
            for flag in re.findall(r"`(-{1,2}[a-z][a-z0-9-]*)`", line.split(" | ")[0])}


@pytest.mark.parametrize("script", sorted(CONFIGS))
def test_options_page_lists_exactly_the_flags_of_help(script):
    documented = page_flags(script) | page_flags("Every script")
    shown = help_flags(script)
    assert shown - documented == set(), f"in {script} --help, not in docs/options.md"
    assert documented - shown == set(), f"in docs/options.md, not in {script} --help"


# ---------------------------------------------------------------------------------------------
# Links


def links(path: Path) -> list[str]:
    """Targets of [text](target) and ![alt](target), outside code blocks and code spans."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown page."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(resolved):
            broken.append(target)
    assert broken == [], f"{name(page)}: links to nothing"


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in links(ROOT / "README.md")}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()


# ---------------------------------------------------------------------------------------------
# Commands


def commands(path: Path) -> list[list[str]]:
    """Every `python ...` command line in the code blocks of a page (continuation lines joined,
    a `$ ` prompt, `time`, and VAR=value prefixes dropped), as argv lists."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|;", line.strip().removeprefix("$ ")):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                while words and (words[0] == "time" or re.match(r"^[A-Z_]+=", words[0])):
                    words = words[1:]
                if len(words) > 1 and words[0] in ("python", "python3", ".venv/bin/python") \
                        and words[1] not in ("-m", "-c"):  # (python -m pytest: not ours)
                    found.append(words[1:])
    return found


def command_id(argv) -> str:
    return " ".join(argv)[:60]


README_COMMANDS = commands(ROOT / "README.md")
DOCS_COMMANDS = [c for p in PAGES if p != ROOT / "README.md" for c in commands(p)]


# --gpu-gb plans from the model's config.json, which a page's hub id would fetch: the same shape
# written here stands in for it (no hub in the tests).
HUB_SHAPES = {"Qwen/Qwen2.5-Math-1.5B": dict(  # its config.json's sizes
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
    max_position_embeddings=4096)}


@functools.cache
def hub_config(name: str) -> str:
    import tempfile
    from transformers import Qwen2Config
    folder = tempfile.mkdtemp(prefix="hub-config-")
    Qwen2Config(**HUB_SHAPES[name]).save_pretrained(folder)
    return folder


def check_command(argv: list[str], capsys):
    script, args = argv[0], argv[1:]
    if "--gpu-gb" in args:
        args = [hub_config(a) if a in HUB_SHAPES else a for a in args]
    if script in CONFIGS:  # parsed as the script parses it, then --dry-run stops it
        with pytest.raises(SystemExit) as exit_:
            parse_config(config(script), args + ["--dry-run"])
        assert exit_.value.code == 0, f"python {' '.join(argv)}: {exit_.value.code}"
        assert "# resolved config" in capsys.readouterr().out
        return
    path = ROOT / script
    assert path.is_file(), f"python {script}: no such file"
    source = path.read_text()
    known = source
    if "from common import" in source:  # an experiment takes experiments/common.py's flags
        known += (path.parent / "common.py").read_text()
    if "parse_config(Config" in source:  # e.g. benchmarks/grpo_step.py takes grpo.py's flags too
        known += " ".join(help_flags("grpo.py"))
    for word in args:
        flag = word.split("=")[0]
        if flag.startswith("-"):
            assert re.search(re.escape(flag) + r"\b", known), f"{script} has no {flag}"


def test_the_readme_shows_commands():
    scripts = {c[0] for c in README_COMMANDS}
    assert {"grpo.py", "dpo.py", "evaluate.py"} <= scripts


@pytest.mark.parametrize("argv", README_COMMANDS, ids=command_id)
def test_every_command_in_the_readme_parses(argv, capsys):
    check_command(argv, capsys)


@pytest.mark.parametrize("argv", DOCS_COMMANDS, ids=command_id)
def test_every_command_in_the_docs_parses(argv, capsys):
    check_command(argv, capsys)


def test_make_targets_in_the_readme_exist():
    makefile = (ROOT / "Makefile").read_text()
    text = (ROOT / "README.md").read_text()
    for target in set(re.findall(r"\bmake ([a-z]+)\b", text)):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"make {target}: no such target"


# ---------------------------------------------------------------------------------------------
# The front door, and no diary


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_no_date_relative_wording(page):
    text = page.read_text().lower()
    found = [w for w in DATE_RELATIVE if re.search(rf"\b{re.escape(w)}\b", text)]
    assert found == [], f"{name(page)} says {found}: give the date (and commit) instead"


def test_the_memory_table_measures_commands_the_readme_prints(capsys):
    """benchmarks/peak_memory.py's commands are the README's, as printed, and each of its argument
    lists is one its script takes (the memory table must measure what users run)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("peak_memory",
                                                  ROOT / "benchmarks" / "peak_memory.py")
    peak_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peak_memory)
    readme = (ROOT / "README.md").read_text()
    for name, printed in peak_memory.COMMANDS:
        assert printed in readme, f"{name}: the README does not print {printed!r}"
        check_command(peak_memory.arguments(name, printed, "out"), capsys)

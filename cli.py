"""A Config as a command line: each algorithm's Config is a dataclass with a docstring under
every field, and parse_config turns it into the script's flags (--max-new-tokens for
max_new_tokens, --help from the docstrings), a TOML file that sets any of them (--config) and
--dry-run, which prints the resolved config and exits before anything loads.

A field typed Literal["a", "b"] accepts only those values (listed in --help); range checks live in
each config's __post_init__ and use `check`, so a bad value stops with one line that names the
flag before anything loads. docs/make_options.py writes docs/options.md from the same fields.
"""

import argparse
import ast
import dataclasses
import inspect
import json
import math
import os
import sys
import types
import typing
from contextlib import contextmanager
from dataclasses import asdict

from data import InputError, escaped, task_summary


def flag(name: str) -> str:
    """The command-line spelling of a config field: --max-new-tokens, or -n for a one-letter one."""
    return "-" + name if len(name) == 1 else "--" + name.replace("_", "-")


def check(ok: bool, message: str) -> None:
    """Refuse an impossible option value with one line that names the flag."""
    if not ok:
        raise InputError(message)


SEEDS = 2 ** 32  # numpy's range (the engines' seeds are derived from the run's by multiplying)


def check_numbers(cfg, may_be_infinite=()) -> None:
    """Every float option a number -- NaN never, infinity only where it says "no limit" -- and
    the seed in SEEDS."""
    if hasattr(cfg, "seed"):
        check(0 <= cfg.seed < SEEDS, f"--seed {cfg.seed}: must be from 0 to {SEEDS - 1}")
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if isinstance(value, float):
            check(not math.isnan(value) and (math.isfinite(value) or (
                field.name in may_be_infinite and value > 0)),
                f"{flag(field.name)} {value}: not a finite number")


class _Parser(argparse.ArgumentParser):
    """Flags spelled whole: argparse's default takes any unique prefix, so evaluate.py's `--n 16`
    (its sample count is -n) was read as --no-chat and "unrecognized arguments: 16"."""
    def __init__(self, **kw):
        super().__init__(allow_abbrev=False, **kw)

    def error(self, message):  # one line, not a usage block of fifty options
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _base(kind):
    """X for a field typed `X | None` (None: "from the task", see grpo.Config), else the type."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) else kind


def _choices(kind):
    kind = _base(kind)
    return typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None


# Options that were replaced: the old spelling stops with one line that names the new one.
REPLACED = {"--bf16": "bf16", "--no-bf16": "fp32"}  # -> --dtype ...


def _refuse_replaced(old: str, new: str) -> None:
    raise InputError(f"{old} was replaced by --dtype auto|bf16|fp32 (auto: bf16 where the "
                     f"hardware computes it natively, else fp32): use {new}")


def parse_config(cls, argv=None, description=None):
    """A CLI flag per dataclass field (--max-new-tokens for max_new_tokens), help from docstrings.

    `--config FILE.toml` sets any field (keys spelled like the fields, - or _); flags given on the
    command line override it. `--dry-run` prints the resolved config and exits, loading nothing
    (with --gpu-gb, on any machine, the memory plan of a GPU that size).
    """
    docs = {}
    for klass in reversed(cls.__mro__):  # a subclass's Config (distill.py's) inherits docstrings
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr):
                docs[a.target.id] = b.value.value.replace("%", "%%")  # argparse formats with %
    parser = _Parser(description=description)
    parser.add_argument("--config", help="TOML file setting any of the options below")
    parser.add_argument("--dry-run", action="store_true", help="print the config and exit")
    fields = {f.name: f for f in dataclasses.fields(cls)  # (not ClassVars: no flags)
              if f.name not in getattr(cls, "NOT_OPTIONS", ())}  # (inherited, not taken)
    for arg in sys.argv[1:] if argv is None else argv:
        if arg in REPLACED and "dtype" in fields:
            _refuse_replaced(arg, f"--dtype {REPLACED[arg]}")
    for name, field in fields.items():
        if _base(field.type) is bool:
            parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=field.default,
                                help=docs.get(name))
        else:
            choices = _choices(field.type)
            parser.add_argument(flag(name), type=type(choices[0]) if choices else _base(field.type),
                                choices=choices, default=field.default, help=docs.get(name))
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**read_toml_config(os.path.expanduser(first.config), fields))
    args = vars(parser.parse_args(argv))
    config_file, dry_run = args.pop("config"), args.pop("dry_run")
    for name in PATH_OPTIONS.intersection(args):
        args[name] = home(args[name])
    if args.get("gpu_gb") and not dry_run:
        import torch
        check(torch.cuda.is_available(), f"--gpu-gb {args['gpu_gb']:g}: this machine has no GPU, "
              f"so the plan is all it can give: add --dry-run")
    with readable_paths(args):
        cfg = cls(**args)  # __post_init__ checks the values
    if dry_run:
        if hasattr(cfg, "task"):
            print(f"# {task_summary(cfg)}")
        if getattr(cfg, "memory_plan", None):
            print("\n".join(f"# {line}" for line in str(cfg.memory_plan).splitlines()))
        print(f"# resolved config{' (from ' + config_file + ' and the command line)' if config_file else ''}")
        for name, value in asdict(cfg).items():
            print(f"{name} = {json.dumps(value)}")
        raise SystemExit(0)
    return cfg


@contextmanager
def readable_paths(values: dict):
    """A path a flag names (or one inside it) that this user may not reach -- a folder of another
    user's on its way -- as one line naming it, not os.stat's traceback from wherever the run
    first looked at it. `values`: the options, by field name. A PermissionError on any other path
    (a user's environment or tool reading its own files) keeps its traceback."""
    try:
        yield
    except PermissionError as e:
        if not isinstance(e.filename, str) or not named_by_flag(e.filename, values):
            raise
        raise SystemExit(denied(e.filename)) from None


def denied(path: str) -> str:
    """The line for a path this user may not reach."""
    return escaped(f"error: {path}: permission denied: this user (uid {os.geteuid()}) may not "
                   f"reach it, or a folder on its way")


def named_by_flag(path: str, values: dict) -> bool:
    """Whether `path` is a path an option names (each item of a list, with and without a
    `=weight` or a `:function`), a folder on its way, or a path at most two levels into it (a
    model's config.json, a run folder's model/config.json) -- three into --out (its
    checkpoints/step_N/driver_state.pt), unless the run works inside --out (`--out .`): then a
    file there may as well be a user's tool's own, whose traceback stays."""
    path = os.path.abspath(path)
    for name in PATH_OPTIONS.intersection(values):
        for item in (i.strip() for i in str(values[name] or "").split(",") if i.strip()):
            for named in {os.path.abspath(part) for part in
                          (item, item.rsplit("=", 1)[0], item.split(":")[0]) if part}:
                depth = 2 if name != "out" else 0 if _within(os.getcwd(), named) else 3
                if _within(named, path) or depth and _within(path, named, depth):
                    return True
    return False


def _within(path: str, folder: str, depth: int = 1 << 30) -> bool:
    """`path` is `folder`, or lies in it at most `depth` levels down."""
    down = os.path.relpath(path, folder)
    outside = down == ".." or down.startswith("../")
    return down == "." or not outside and down.count("/") < depth


# The options that name files or folders, some as lists (`--reward-model a=0.5,b`, `--tools
# calc,t.py:f`, evaluate.py's `--data a.jsonl,b.jsonl`): where `~` is the home folder.
PATH_OPTIONS = {"model", "init_from", "teacher", "critic_from", "reward_model", "judge",
                "judge_prompt", "data", "eval_data", "replay", "resume", "out", "reward", "tools",
                "env"}


def home(value):
    """`~` (or `~user`) at the start of each comma-separated item expanded: the shell does it for
    `--out ~/x` alone, not for `--out=~/x`, a TOML value or a list's later items."""
    if not isinstance(value, str):
        return value
    return ",".join(os.path.expanduser(item.strip()) if item.strip().startswith("~") else item
                    for item in value.split(","))


def read_toml_config(path: str, fields: dict) -> dict:
    import tomllib
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise SystemExit(f"error: --config {path}: no such file") from None
    except IsADirectoryError:
        raise SystemExit(f"error: --config {path}: a folder, not a TOML file") from None
    except PermissionError:
        raise SystemExit(denied(f"--config {path}")) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: --config {path}: not valid TOML ({e})") from None
    values, spelled = {}, {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in spelled:  # (eval_size and eval-size: which would win is no user's guess)
            raise SystemExit(f"error: {path}: '{spelled[name]}' and '{key}' set one option")
        spelled[name] = key
        if name == "bf16" and "dtype" in fields:
            _refuse_replaced(f"{path}: '{key}'", f'dtype = "{"bf16" if value else "fp32"}"')
        if name not in fields:
            raise SystemExit(f"error: {path}: unknown option '{key}'")
        kind, choices = _base(fields[name].type), _choices(fields[name].type)
        if choices:
            if value not in choices:
                raise SystemExit(f"error: {path}: '{key}' must be one of {list(choices)}, "
                                 f"got {value!r}")
        else:
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                raise SystemExit(f"error: {path}: '{key}' must be {kind.__name__}, got {value!r}")
        values[name] = value
    return values

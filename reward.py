"""Verifiable rewards: pull the answer out of a completion and decide whether it is right.

Imports nothing from smolrl, so a student can test it alone.

    extract_boxed(text)          last \\boxed{...} (brace counting, nested braces, `\\boxed 5`)
    extract_answer(text, fmt)    the answer in a declared format ("boxed" or "answer-is")
    normalize(answer)            cheap canonical form: no $, \\text{}, units, commas, leading zeros
    Grader.grade(preds, golds)   normalised/numeric fast path, then math-verify in worker
                                 processes with a hard timeout: a hostile answer scores 0 and
                                 never stalls the run
    RewardFunctions              reward functions called as TRL calls them (`prompts=`,
                                 `completions=`, `completion_ids=`, every column by name; None
                                 = "does not apply"), weighted and summed; signatures checked
                                 at startup; a crashing function is reported once, scores 0
                                 for that batch and is counted
"""

import asyncio
import concurrent.futures
import functools
import importlib
import importlib.util
import inspect
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import sys
import time
import traceback
from fractions import Fraction
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Extraction


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}); handles nested braces and `\\boxed 5`."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text)]
    for m in reversed(starts):
        if m.group(1) is None:  # `\boxed 5`: the argument runs to the next space or `$`
            arg = re.match(r"[^\s$]+", text[m.end():])
            if arg:
                return arg.group(0).rstrip(".")
            continue
        depth, i = 1, m.end()
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[m.end():i].strip()
            i += 1
    return None


# A number as people write it: thousands separators only in groups of three ("1,000" but not the
# "85," of "85, since"), an optional decimal part or a /denominator.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?"


def extract_answer(text: str, fmt: str = "boxed") -> str | None:
    """The answer in format `fmt`; None when the completion does not give one.

    "boxed": the last \\boxed{}. "answer-is": the number after the last "answer is", else the last
    number in the text (small models often write "47 + 38 = 85").
    """
    if fmt == "boxed":
        return extract_boxed(text)
    if fmt == "answer-is":
        tail = re.split(r"answer is", text, flags=re.IGNORECASE)
        if len(tail) > 1:
            m = re.search(_NUMBER, tail[-1])
            if m:
                return m.group(0)
        numbers = re.findall(_NUMBER, text)
        return numbers[-1] if numbers else None
    raise ValueError(f"unknown answer format {fmt!r}; expected 'boxed' or 'answer-is'")


# ---------------------------------------------------------------------------------------------
# Normalisation: the fast path that settles most answers without a symbolic engine.

_UNITS = (r"degrees?|cm|m|km|kg|g|mg|inches|inch|feet|foot|ft|units?|dollars?|cents?|hours?|"
          r"minutes?|seconds?|days?|miles?|meters?|mph|sq|square")


def normalize(answer: str) -> str:
    s = answer.strip()
    # A unit is stripped only where it is clearly a unit: inside \text{} (or \mbox, \mathrm), or a
    # word after a space. "2m" stays "2m": it may be 2 times a variable m, and must not equal 2.
    units = rf"(?:{_UNITS})(?:\s+(?:{_UNITS}))*"  # "cm", "square units"
    s = re.sub(rf"\\(?:text|mbox|mathrm)\{{\s*{units}\s*\}}\s*$", "", s)
    s = re.sub(rf"(?:\s|\\\s)+{units}\s*$", "", s)
    s = re.sub(r"\\text\{\s*(.*?)\s*\}", r"\1", s)  # \text{5} -> 5
    s = re.sub(r"\\(?:mathrm|textbf|mathbf)\{(.*?)\}", r"\1", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\;", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.rstrip(".").strip()
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # x = 5 -> 5
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # 1,000,000 -> 1000000
        s = s.replace(",", "")
    s = re.sub(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", r"\1/\2", s)  # \frac{1}{2} -> 1/2
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)  # \frac12 -> 1/2
    s = s.replace(" ", "")
    return s


def _as_number(s: str) -> Fraction | None:
    try:
        if re.fullmatch(r"-?\d+(\.\d+)?", s):
            return Fraction(s)
        if re.fullmatch(r"-?\d+/-?\d+", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def fast_match(pred: str, gold: str) -> bool | None:
    """True/False when the cheap rules can decide, None when a symbolic check is needed."""
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return True
    pn, gn = _as_number(p), _as_number(g)
    if pn is not None and gn is not None:
        return pn == gn  # 085 == 85, 2.0 == 2, 0.5 == 1/2
    if pn is not None or gn is not None:
        # A plain number against LaTeX (\sqrt2, \pi, ...) still needs math-verify.
        return None if re.search(r"[\\^{]", p + g) else False
    return None


# ---------------------------------------------------------------------------------------------
# math-verify in worker processes. Its own timeouts use signal.alarm, which only works in a main
# thread, and a hostile expression (a tower of exponents) can run for seconds: each worker is a
# process we can kill. Two rules keep a correct answer from being graded 0 by the clock:
# - a worker's start (spawn, imports, math-verify's first parse) happens before it is given a job,
#   so only the grading itself is timed;
# - a job that overruns kills its own worker only; a replacement starts in the background and the
#   other workers' jobs go on.


def _verify(pred: str, gold: str) -> bool:
    from math_verify import parse, verify
    gold_parsed = parse(f"${gold}$")
    pred_parsed = parse(f"${pred}$")
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed))


def _verify_loop(conn):
    """Body of a worker process: warm up, say "ready", then grade pairs until the pipe closes."""
    _verify("\\frac{1}{2}", "0.5")  # lazy imports (sympy, the LaTeX grammar) happen here, untimed
    conn.send("ready")
    while True:
        try:
            pred, gold = conn.recv()
        except EOFError:
            return
        try:
            ok = _verify(pred, gold)
        except Exception:
            ok = False  # math-verify could not parse it: not a match
        conn.send(ok)


class _Worker:
    def __init__(self):
        # spawn: a forked child of a process that runs torch threads can deadlock.
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_verify_loop, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.job = None  # (index, deadline) while grading

    def kill(self):
        self.process.kill()
        self.process.join()
        self.conn.close()


class Grader:
    """Grades (prediction, gold) pairs; math-verify runs in `workers` processes, `timeout` s per item
    (counted from when a warm worker receives it)."""

    def __init__(self, workers: int = 2, timeout: float = 5.0, start_timeout: float = 300.0):
        self.num_workers, self.timeout, self.start_timeout = workers, timeout, start_timeout
        self.workers: list[_Worker] = []
        self.timeouts = 0  # items killed for running past the timeout, since start

    def start(self):
        """Start the workers now (they warm up in the background); grade() does it when needed."""
        self.workers += [_Worker() for _ in range(self.num_workers - len(self.workers))]

    def close(self):
        for w in self.workers:
            w.kill()
        self.workers = []

    def grade(self, preds: list[str | None], golds: list[str]) -> list[bool]:
        results = [False] * len(preds)
        slow = []
        for i, (p, g) in enumerate(zip(preds, golds)):
            if p is None or g is None:
                continue
            quick = fast_match(p, g)
            if quick is None:
                slow.append(i)
            else:
                results[i] = quick
        if slow:
            self._grade_slow(slow, preds, golds, results)
        return results

    def _grade_slow(self, queue, preds, golds, results):
        self.start()
        queue = list(queue)
        started = time.monotonic()
        while queue or any(w.job for w in self.workers):
            for w in self.workers:  # hand out work to warm, idle workers; the clock starts now
                if w.ready and w.job is None and queue:
                    i = queue.pop(0)
                    w.conn.send((preds[i], golds[i]))
                    w.job = (i, time.monotonic() + self.timeout)
            deadlines = [w.job[1] for w in self.workers if w.job]
            wait = min(deadlines) - time.monotonic() if deadlines else 1.0
            for conn in mp.connection.wait([w.conn for w in self.workers], max(wait, 0.0)):
                w = next(w for w in self.workers if w.conn is conn)
                try:
                    message = conn.recv()
                except EOFError:  # the worker died (out of memory?): its item is not a match
                    self._replace(w)
                    continue
                if message == "ready":
                    w.ready = True
                else:
                    results[w.job[0]] = bool(message)
                    w.job = None
            now = time.monotonic()
            for w in list(self.workers):
                if w.job and now > w.job[1]:  # overran: kill this worker only
                    self.timeouts += 1
                    self._replace(w)
            if not any(w.ready for w in self.workers) and now - started > self.start_timeout:
                raise RuntimeError(f"math-verify workers did not start within "
                                   f"{self.start_timeout:.0f} s")

    def _replace(self, worker):
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker()


# ---------------------------------------------------------------------------------------------
# Reward functions, called the way TRL calls them:
#
#     fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]
#
# Every dataset column arrives by name, as a list aligned with the completions. For conversational
# prompts (lists of messages) prompts and completions are message lists, as TRL passes them. None
# for a sample means "this function does not apply here": the sample's total leaves it out.

MAX_FAILED_BATCHES = 3  # a function failing on this many batches in a row stops the run
# Data columns a function never gets under their own names, as in TRL: the prompt column arrives
# as `prompts`; these names are the call's own arguments.
NOT_COLUMNS = ("prompt", "prompts", "completions", "completion_ids")


def completion_text(completion) -> str:
    """The text of a completion, given as a string or as TRL's messages: [{"role": "assistant",
    ...}], or an episode's assistant and tool turns (env.py), whose last assistant turn counts."""
    if isinstance(completion, list):
        said = [m for m in completion if m.get("role") == "assistant"]
        return (said[-1].get("content") or "") if said else ""
    return completion


def correctness_reward(prompts, completions, answer, *, answer_format="boxed", grader=None,
                       **_):
    """1.0 when the answer in `answer_format` matches the reference answer, else 0.0."""
    grader = grader or Grader()
    preds = [extract_answer(completion_text(c), answer_format) for c in completions]
    return [float(ok) for ok in grader.grade(preds, answer)]


def format_reward(prompts, completions, *, answer_format="boxed", **_):
    """1.0 when the completion states an answer in the declared format at all."""
    texts = [completion_text(c) for c in completions]
    if answer_format == "boxed":
        return [float(extract_boxed(t) is not None) for t in texts]
    return [float(bool(re.search(r"answer is\s*:?\s*\$?" + _NUMBER, t, re.IGNORECASE)))
            for t in texts]


BUILTIN = {"correctness": correctness_reward, "format": format_reward}


def overlong_penalty(lengths: list[int], max_new_tokens: int, buffer: int) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer, then falling linearly to
    -1 at max_new_tokens."""
    start = max_new_tokens - buffer
    return [0.0 if n <= start else -min(1.0, (n - start) / buffer) for n in lengths]


def weighted(spec: str, paths: bool = False) -> list[tuple[str, float]]:
    """`name=weight,...` as (name, weight) pairs, weight 1 where none is given (NaN where it is no
    number: options.RLOptions names it before anything loads). A `=` followed by a `/` is a
    path's (a sweep's folder: runs/lr=1e-5/rm); with `paths` (--reward-model, --judge), so is
    one in an item that is, as written, a path that exists (runs/rm_lr=1e-5). Reward functions'
    names are never looked up on disk: a folder --out made could not turn format=0.5 into one."""
    out = []
    for part in (p.strip() for p in (spec or "").split(",") if p.strip()):
        name, _, weight = part.rpartition("=")
        if paths and name and "/" not in weight and os.path.exists(part) and \
                os.path.exists(name):  # (a run's --out named like the item, say)
            line = f"error: {part}: both the folder {part} and {name} at weight {weight} " \
                   f"exist: write {part}=1 for the one, {name}/={weight} for the other"
            raise SystemExit("".join(c if c.isprintable() else repr(c)[1:-1] for c in line))
        if not name or "/" in weight or paths and os.path.exists(part):
            name, weight = part, "1"  # (no weight given; or a path that holds `=`)
        try:
            out.append((name.strip(), float(weight)))
        except ValueError:
            out.append((name.strip(), math.nan))
    return out


class RewardFunctions:
    """Weighted sum of reward functions given as "name[=weight],...": built-ins, or your own as
    `module:fn` (importable from the current directory), `path/to/file.py:fn` or `module.fn`.

    `columns` (the dataset's column names) are checked against every function's signature at
    startup: a parameter no column can fill is an error that names it, not a silent 0 later. A
    function that raises or returns a non-finite score is reported once with its traceback,
    scores 0 for that batch and is counted in `errors`; failing on MAX_FAILED_BATCHES batches in
    a row stops the run. `async def` functions are awaited, concurrently.
    """

    def __init__(self, spec: str, answer_format: str, grader: Grader,
                 require_think_close: bool = False, columns=None, env_class=None, extra=()):
        self.require_think_close = require_think_close
        self.fns = []  # (name, fn, weight)
        passed = {"prompts", "completions", "completion_ids",  # what __call__ passes, exactly
                  *(set(columns or ()) - set(NOT_COLUMNS)), *(["environments"] if env_class else [])}
        for name, weight in weighted(spec):
            fn = self._resolve(name, answer_format, grader)
            if columns is not None:
                _check_signature(name, fn, passed)
            self.fns.append((name, fn, weight))
        if callable(getattr(env_class, "get_reward", None)):  # as TRL adds it: weight 1
            self.fns.append((env_class.__name__, _environment_rewards, 1.0))
        self.fns += list(extra)  # (name, fn, weight): learned rewards (reward_models.py)
        if not self.fns:
            raise SystemExit("error: no reward: give --reward, or an --env with get_reward()")
        self.errors = 0
        self._reported, self._failing = set(), {}

    @staticmethod
    def _resolve(name, answer_format, grader):
        if name == "correctness":
            return functools.partial(correctness_reward, answer_format=answer_format, grader=grader)
        if name == "format":
            return functools.partial(format_reward, answer_format=answer_format)
        return load_function(name, what="reward function")

    def __call__(self, prompts, completions: list, completion_ids, rows, **extra):
        """(total reward per completion, {function name: its scores, None where it abstained}).
        completions: texts, or (episodes, env.py) message lists; extra: e.g. `environments`."""
        columns = {k: [r.get(k) for r in rows] for k in rows[0]} if rows else {}
        for taken in NOT_COLUMNS:
            columns.pop(taken, None)
        thought = [True] * len(completions)
        if self.require_think_close and completions and isinstance(completions[0], str):
            # reasoning models: only the text after </think> is graded
            thought = ["</think>" in c for c in completions]
            completions = [c.rsplit("</think>", 1)[-1] if ok else "" for c, ok in
                           zip(completions, thought)]
        if prompts and isinstance(prompts[0], list) and completions and \
                isinstance(completions[0], str):  # conversational, as TRL passes them
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                      **columns, **extra)
        total, per_fn = [0.0] * len(completions), {}
        for (name, _, weight), result in zip(self.fns, self._call_all(kwargs)):
            scores = self._checked(name, result, len(completions))
            scores = [s if ok or s is None else 0.0 for s, ok in zip(scores, thought)]
            per_fn[name] = scores
            total = [t if s is None else t + weight * s for t, s in zip(total, scores)]
        return total, per_fn

    def _call_all(self, kwargs) -> list:
        """Each function's result (or the exception it raised); async ones run concurrently."""
        results, pending = [], {}
        for i, (_, fn, _) in enumerate(self.fns):
            try:
                result = fn(**_accepted(fn, kwargs))
            except Exception as e:
                result = e
            if inspect.isawaitable(result):
                pending[i] = result
            results.append(result)
        if pending:
            async def gather():
                return await asyncio.gather(*pending.values(), return_exceptions=True)
            for i, result in zip(pending, run_coroutine(gather())):
                results[i] = result
        return results

    def _checked(self, name, result, n) -> list[float | None]:
        try:
            if isinstance(result, BaseException):
                raise result
            scores = [None if s is None else float(s) for s in result]
            if len(scores) != n:
                raise ValueError(f"returned {len(scores)} scores for {n} completions")
            # One inf or NaN would turn every advantage of the batch into NaN, and the weights
            # with them: treat it like a crash.
            if not all(s is None or math.isfinite(s) for s in scores):
                raise ValueError(f"returned a non-finite score: {scores}")
        except Exception as e:
            self.errors += 1
            self._failing[name] = self._failing.get(name, 0) + 1
            # (each character not printable but a newline escaped, as data.escaped does: the
            # message may quote a completion, and a model can write a terminal's escape sequence)
            trace = "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1]
                            for c in "".join(traceback.format_exception(e)))
            if self._failing[name] >= MAX_FAILED_BATCHES:
                raise SystemExit(f"error: reward function {name!r} failed on {MAX_FAILED_BATCHES} "
                                 f"batches in a row; the last time:\n{trace}") from None
            if name not in self._reported:
                self._reported.add(name)
                print(f"reward function {name!r} failed; scoring 0 for this batch (reported "
                      f"once, counted in reward_errors):\n{trace}")
            return [0.0] * n
        self._failing[name] = 0
        return scores


def _environment_rewards(environments, **_):
    """An environment's own score of each episode, its get_reward() (async allowed)."""
    scores = [env.get_reward() for env in environments]
    return [run_coroutine(s) if inspect.isawaitable(s) else s for s in scores]


def run_coroutine(coroutine):
    """asyncio.run(coroutine), also where an event loop is already running in this thread (a
    Jupyter notebook), which asyncio.run refuses: there it runs in a thread with a loop of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def load_function(spec: str, what: str = "function", builtins=BUILTIN):
    """`module:fn` (importable from the current directory), `path/to/file.py:fn` or `module.fn`;
    `builtins`: the names the flag also takes (listed when `spec` is none of these forms)."""
    where, sep, attr = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not where or not attr:
        names = f"one of {sorted(builtins)}, " if builtins else ""
        raise SystemExit(f"error: unknown {what} {spec!r}: use {names}module:function, "
                         f"path/to/file.py:function or module.function")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where)
            if not path.is_file():
                raise ImportError(f"no such file: {where}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # what `python -c "import my_rewards"` would find
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise SystemExit(f"error: cannot load {what} {spec!r}: {e}") from None
    if not callable(fn):
        raise SystemExit(f"error: {what} {spec!r} is not callable")
    return fn


def _accepted(fn, kwargs: dict) -> dict:
    """The keyword arguments fn takes: all of them with **kwargs (as TRL's functions have)."""
    params = _parameters(fn)
    if params is None or any(p.kind == p.VAR_KEYWORD for p in params):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in {p.name for p in params}}


def _parameters(fn):
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: call it with everything
        return None


def _check_signature(name: str, fn, available: set[str]):
    """Every parameter without a default must be something we pass: stop now if not."""
    params = _parameters(fn) or []
    needed = [p.name for p in params if p.default is p.empty and
              p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in available]
    positional = [p.name for p in params if p.kind == p.POSITIONAL_ONLY]
    if positional:
        raise SystemExit(f"error: reward function {name!r}: positional-only parameters "
                         f"{positional} cannot be filled; rewards are passed by keyword")
    if "prompt" in needed:  # the data has it, but it is passed as `prompts`
        raise SystemExit(f"error: reward function {name!r} takes `prompt`: the prompts are passed "
                         f"as `prompts` (a list, one per completion, as TRL passes them); rename "
                         f"the parameter")
    if needed:
        columns = sorted(available - {"prompts", "completions", "completion_ids"})
        raise SystemExit(f"error: reward function {name!r} needs {', '.join(needed)}, which the "
                         f"data does not have (columns: {', '.join(map(repr, columns))}); map a "
                         f"column (--answer-field, --prompt-field) or give the parameter a default")

"""Verifiable rewards: pull the answer out of a completion and decide whether it is right.

Imports nothing from smolrl, so a student can test it alone.

    extract_boxed(text)          last \\boxed{...} (brace counting, nested braces, `\\boxed 5`)
    extract_answer(text, fmt)    the answer in a declared format ("boxed" or "answer-is")
    normalize(answer)            cheap canonical form: no $, \\text{}, units, commas, leading zeros
    Grader.grade(preds, golds)   normalised/numeric fast path, then math-verify in worker
                                 processes with a hard timeout: a hostile answer scores 0 and
                                 never stalls the run
    RewardFunctions              TRL-style reward functions `fn(prompts, completions, **row_fields)
                                 -> list[float]`, weighted and summed; a crashing function is
                                 reported once, scores 0 for that batch and is counted
"""

import importlib
import math
import multiprocessing as mp
import re
import traceback
from fractions import Fraction

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


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"


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
    s = re.sub(r"\\text\{\s*(.*?)\s*\}", r"\1", s)  # \text{cm} -> cm
    s = re.sub(r"\\(?:mathrm|textbf|mathbf)\{(.*?)\}", r"\1", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\;", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(rf"\s*(?:{_UNITS})\s*$", "", s).strip()
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
# thread, and a hostile expression (a tower of exponents) can run for seconds: we run it in a
# process pool and kill the pool when an item overruns.


def _verify_worker(pred: str, gold: str) -> bool:
    from math_verify import parse, verify
    gold_parsed = parse(f"${gold}$")
    pred_parsed = parse(f"${pred}$")
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed))


class Grader:
    """Grades (prediction, gold) pairs; math-verify runs in `workers` processes, `timeout` s each."""

    def __init__(self, workers: int = 2, timeout: float = 5.0):
        self.workers, self.timeout = workers, timeout
        self.pool = None
        self.timeouts = 0  # items killed for running past the timeout, since start

    def _get_pool(self):
        if self.pool is None:
            # spawn: a forked child of a process that runs torch threads can deadlock.
            self.pool = mp.get_context("spawn").Pool(self.workers)
        return self.pool

    def close(self):
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None

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
        while slow:
            pool = self._get_pool()
            pending = [(i, pool.apply_async(_verify_worker, (preds[i], golds[i]))) for i in slow]
            slow = []
            for k, (i, job) in enumerate(pending):
                try:
                    results[i] = job.get(timeout=self.timeout)
                except mp.TimeoutError:
                    # Kill the stuck worker with its pool; re-queue what had not finished yet.
                    self.timeouts += 1
                    self.close()
                    slow = [j for j, later in pending[k + 1:] if not later.ready()]
                    for j, later in pending[k + 1:]:
                        if later.ready():
                            results[j] = _safe_result(later)
                    break
                except Exception:
                    results[i] = False  # math-verify could not parse it: not a match
        return results


def _safe_result(job) -> bool:
    try:
        return bool(job.get(timeout=0))
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# Reward functions. Same convention as TRL: `fn(prompts, completions, **row_fields)` where each
# row field (answer, id, ...) is a list aligned with completions; returns one float per completion.


def correctness_reward(prompts, completions, answer, *, answer_format="boxed", grader=None,
                       **_):
    """1.0 when the answer in `answer_format` matches the reference answer, else 0.0."""
    grader = grader or Grader()
    preds = [extract_answer(c, answer_format) for c in completions]
    return [float(ok) for ok in grader.grade(preds, answer)]


def format_reward(prompts, completions, *, answer_format="boxed", **_):
    """1.0 when the completion states an answer in the declared format at all."""
    if answer_format == "boxed":
        return [float(extract_boxed(c) is not None) for c in completions]
    return [float(bool(re.search(r"answer is\s*:?\s*\$?" + _NUMBER, c, re.IGNORECASE)))
            for c in completions]


BUILTIN = {"correctness": correctness_reward, "format": format_reward}


class RewardFunctions:
    """Weighted sum of reward functions given as "name[:weight],..." (built-in or module:function).

    A user function that raises is reported once with its traceback, scores 0 for that batch, and
    is counted in `errors`; the run goes on.
    """

    def __init__(self, spec: str, answer_format: str, grader: Grader,
                 require_think_close: bool = False):
        self.require_think_close = require_think_close
        self.fns = []  # (name, fn, weight)
        for part in spec.split(","):
            name, _, weight = part.strip().rpartition("=") if "=" in part else (part.strip(), "", "1")
            self.fns.append((name, self._resolve(name, answer_format, grader), float(weight)))
        self.errors = 0
        self._reported = set()

    @staticmethod
    def _resolve(name, answer_format, grader):
        if name == "correctness":
            return lambda *a, **k: correctness_reward(*a, answer_format=answer_format,
                                                      grader=grader, **k)
        if name == "format":
            return lambda *a, **k: format_reward(*a, answer_format=answer_format, **k)
        module, _, attr = name.partition(":")
        if not attr:
            raise SystemExit(f"error: unknown reward {name!r}: use one of {sorted(BUILTIN)} or "
                             f"'module:function'")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"error: cannot load reward function {name!r}: {e}") from None

    def __call__(self, prompts, completions, rows) -> tuple[list[float], dict[str, list[float]]]:
        """(total reward per completion, {function name: its scores})."""
        fields = {k: [r.get(k) for r in rows] for k in rows[0]} if rows else {}
        fields.pop("prompts", None)
        fields.pop("completions", None)
        thought = [True] * len(completions)
        if self.require_think_close:  # reasoning models: only the text after </think> is graded
            thought = ["</think>" in c for c in completions]
            completions = [c.rsplit("</think>", 1)[-1] if ok else "" for c, ok in
                           zip(completions, thought)]
        total = [0.0] * len(completions)
        per_fn = {}
        for name, fn, weight in self.fns:
            try:
                scores = [float(s) for s in fn(prompts, completions, **fields)]
                if len(scores) != len(completions) or any(math.isnan(s) for s in scores):
                    raise ValueError(f"returned {len(scores)} scores (NaN allowed: no) for "
                                     f"{len(completions)} completions")
            except Exception:
                self.errors += 1
                if name not in self._reported:
                    self._reported.add(name)
                    print(f"reward function {name!r} raised; scoring 0 for this batch "
                          f"(reported once, counted in reward_errors):\n{traceback.format_exc()}")
                scores = [0.0] * len(completions)
            scores = [s if ok else 0.0 for s, ok in zip(scores, thought)]  # no </think>: 0
            per_fn[name] = scores
            total = [t + weight * s for t, s in zip(total, scores)]
        return total, per_fn

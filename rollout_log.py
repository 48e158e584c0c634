"""Rollouts on disk: what every RL step sampled, how it was scored and weighted, token by token.

Every run of the RL loop (grpo.py, ppo.py, distill.py) appends to <out>/rollouts.jsonl, one JSON
object per sample, as each step ends; held-out evaluations add their samples to the same file.
One file of JSON lines because a killed run keeps every step it finished, a resumed run cuts it
back to its checkpoint's step (in a new file renamed over it: a full disk loses nothing), it needs
no library to write, and it opens in one line:

    pandas.read_json("out/rollouts.jsonl", lines=True)
    datasets.load_dataset("json", data_files="out/rollouts.jsonl")

Format version 1 (the field `v`). Every record has `v`, `kind` ("train" or "eval") and `step`.
Whoever reads a log back (a resume, --replay, report.py) checks every record (`records`): damage
stops it in one line naming the file, the line and the field, before any model loads; a last line
cut short by a killed write is left out, and said.

kind "train" -- one per sample a step drew, in the order the step drew them:
    index, group, sample    its place: sample `sample` of group `group` (index = group * G + sample)
    kept                    trained on (False: DAPO's dynamic sampling dropped its group)
    row                     the problem's data row (prompt, answer, ...), as the dataset gave it
    prompt_ids, completion_ids   the tokens (a completion: the stop token included; an episode:
                            every token after the prompt, tool results included)
    completion              the decoded completion
    truncated, policy_version    hit the length limit; the trainer step whose weights sampled it
    reward, rewards, correct     the summed reward, each source's score, answer correctness
    advantage               the sample's advantage (GRPO; null where the algorithm makes them per
                            token -- ppo.py -- or has none -- distill.py, a dropped group)
    mask                    episodes: 1 per token the model sampled, 0 per tool-result token
    engine_logprobs         with a vLLM engine or --async-steps: the engine's log-prob per token
    episode                 episodes: messages, turns, tool_calls, tool_errors, tool_seconds
    tokens                  per-token detail, for --rollout-tokens groups a step (below)

`tokens`, lists as long as completion_ids (rounded to 4 decimals): `pieces` (each token's text),
`prompt` (the prompt as the model read it, chat template included), and what the update used:
`logprob` (pi_theta as the update began), `old_logprob` (pi_old of the ratio), `ref_logprob`
(the KL reference's, where there is one), `entropy`, `new_logprob` (after the step's last
update: where the policy moved), and ppo.py's per-token `advantage`, `value` and `return`. A
sample the update skipped (advantage 0 and no KL term: it adds nothing to the loss) has the pieces
only. Which samples: the first --rollout-tokens groups with a reward spread (the ones that train),
then the others; -1 keeps them for every sample. The rest is kept for every sample: replay needs
the ids, the rewards and (for importance weights) the engine's log-probs.

kind "eval" -- one per held-out sample (evaluate.evaluate_rows' record, and the problem):
    id, problem, answer, completion, extracted, correct, length, truncated (turns, tool_calls,
    tool_errors for episodes)

Size: ids cost ~6 bytes a token, a detailed token ~60. The default run's file is ~1 MB; a GPU run
of 300 steps x 512 samples x ~1,200 tokens is ~1.1 GB (about a third of one 1.5B checkpoint), and
one detailed group a step adds ~10 / N of that (N prompts a step).
"""

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from data import escaped

FORMAT = 1
FILE = "rollouts.jsonl"


def detail_samples(rewards: torch.Tensor, advantages: torch.Tensor, group_size: int,
                   groups: int) -> list[int]:
    """The samples whose per-token numbers are kept: all of the first `groups` groups that
    trained (an advantage not 0 -- --adv-scale unit's all-wrong group too -- or, where advantages
    are per token and these are 0 (ppo.py), a reward spread: the update computes their
    log-probs), then the others; groups < 0: every sample."""
    n_groups = len(rewards) // group_size
    if groups < 0:
        return list(range(len(rewards)))
    trained = (rewards.view(n_groups, group_size).std(1) > 1e-6) | \
        (advantages.view(n_groups, group_size) != 0).any(1) if n_groups else torch.zeros(0)
    order = [g for g in range(n_groups) if trained[g]] + [g for g in range(n_groups)
                                                          if not trained[g]]
    return [g * group_size + k for g in sorted(order[:groups]) for k in range(group_size)]


def detail_index(n: int, samples: list[int]) -> torch.Tensor:
    """(n,) the sample's own index where the trainer reports per-token numbers, -1 elsewhere
    (TrainBatch.detail: it survives the shards a batch is cut into)."""
    index = torch.full((n,), -1, dtype=torch.long)
    index[samples] = torch.tensor(samples, dtype=torch.long)
    return index


def _floats(xs) -> list[float]:
    return [round(float(x), 4) for x in xs]


class RolloutLog:
    """<out>/rollouts.jsonl: a fresh run starts it empty; a run resumed at step s keeps the
    records of steps up to s (the steps after them are sampled again) from `source`, the log
    of the run its checkpoint belongs to (default: this one's; session.RunFolder.samples)."""

    def __init__(self, out: Path, resumed_at: int, source: Path | None = None):
        self.path, self.seconds = Path(out) / FILE, 0.0  # (seconds: writing, since last asked)
        source = source or self.path
        if resumed_at and source.exists():
            self._keep(resumed_at, source)
        else:
            self._write([], "w")

    def _keep(self, step: int, source: Path):
        """The records of steps up to `step` in `source`, byte for byte, in a new file renamed
        over the log: a write that fails half way (a full disk) leaves the old log whole."""
        tmp = self.path.with_name(f".{FILE}.resume")
        try:
            tmp.unlink(missing_ok=True)
            with open(tmp, "x") as f:  # ("x": a new file; a link planted there is not followed)
                f.writelines(line for _, line, r in records(source) if r["step"] <= step)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise SystemExit(f"error: cannot write {tmp} ({e.strerror}): {self.path} is as it "
                             f"was; make room and resume again") from None

    def _write(self, records: list[dict], mode: str = "a"):
        with open(self.path, mode) as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in records)

    def train(self, step: int, sampled, group_size: int, tokenizer, kept: list[bool] | None = None,
              advantages=None, detail: list[int] = (), tokens: dict | None = None):
        """One step's samples (an rl.Scored, every round drawn). kept: which of them the update
        took (None: all), in the order of its batch, whose index the advantages (per sample),
        `detail` (the samples chosen for per-token detail: detail_samples) and `tokens` (the
        trainer's per-token numbers, by sample: TrainBatch.detail) go by."""
        t0 = time.perf_counter()
        comps, tokens, detail = sampled.completions, tokens or {}, set(detail)
        kept = kept if kept is not None else [True] * len(comps)
        records, trained = [], -1
        for i in range(len(comps)):
            trained += kept[i]  # (a kept sample's index in the update's batch)
            r = {"v": FORMAT, "kind": "train", "step": step, "index": i, "group": i // group_size,
                 "sample": i % group_size, "kept": kept[i], "row": sampled.rows[i],
                 "prompt_ids": comps.prompt_ids[i], "completion_ids": comps.completion_ids[i],
                 "completion": comps.text[i], "truncated": comps.truncated[i],
                 "policy_version": comps.policy_version, "reward": float(sampled.rewards[i]),
                 "rewards": {name: s[i] for name, s in sampled.per_fn.items()},
                 "correct": sampled.correct[i] if sampled.correct else None,
                 "advantage": (float(advantages[trained]) if kept[i] and advantages is not None
                               else None)}
            if comps.mask is not None:
                r["mask"] = [int(m) for m in comps.mask[i]]
            if comps.engine_logprobs is not None:
                r["engine_logprobs"] = [float(x) for x in comps.engine_logprobs[i]]  # (exact)
            if sampled.episodes:
                e = sampled.episodes[i]
                r["episode"] = {"prompt": e.prompt, "messages": e.messages, "turns": e.turns,
                                "tool_calls": e.tool_calls, "tool_errors": e.tool_errors,
                                "tool_seconds": e.tool_seconds, "done": e.done}
            if kept[i] and trained in detail:
                r["tokens"] = self._tokens(tokenizer, comps, i, tokens.get(trained, {}))
            records.append(r)
        self._write(records)
        self.seconds += time.perf_counter() - t0

    @staticmethod
    def _tokens(tokenizer, comps, i: int, numbers: dict) -> dict:
        return {"prompt": tokenizer.decode(comps.prompt_ids[i]),
                "pieces": [tokenizer.decode([t]) for t in comps.completion_ids[i]],
                **{name: _floats(xs) for name, xs in numbers.items()}}

    def eval(self, step: int, samples: list[dict], rows: list[dict]):
        """A held-out evaluation's samples (evaluate.evaluate_rows' records, rows: its problems)."""
        t0 = time.perf_counter()
        by_id = {r["id"]: r for r in rows}
        self._write([{"v": FORMAT, "kind": "eval", "step": step,
                      "problem": by_id.get(s["id"], {}).get("problem"),
                      "answer": by_id.get(s["id"], {}).get("answer"), **s} for s in samples])
        self.seconds += time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Reading a log: each record checked once, its damage named in one line.


class DamagedLog(Exception):
    """A line of a JSON-lines file that cannot be read as what it should hold: "PATH, line N[,
    field F]: what is wrong", whatever it quotes of the file escaped (data.escaped)."""

    def __init__(self, message: str):
        super().__init__(escaped(message))


def json_lines(path, said=print) -> Iterator[tuple[int, str, dict]]:
    """(line number, line, object) of each line of a JSON-lines file. A last line cut short (no
    newline, not JSON: a killed write, a full disk) is a crash remnant, no damage: left out, and
    said(that); any other line that is not a JSON object (nor UTF-8) stops here (DamagedLog)."""
    with open(path, "rb") as f:  # (bytes: a line that is not UTF-8 is damage, named as any)
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                r = json.loads(line)
            except (ValueError, RecursionError) as e:  # (UnicodeDecodeError: a ValueError)
                if not raw.endswith(b"\n"):
                    said(escaped(f"{path}, line {n}: cut short (a killed write): left out"))
                    return
                what = "UTF-8" if isinstance(e, UnicodeDecodeError) else "JSON"
                raise DamagedLog(f"{path}, line {n}: not {what} ({_why(e)})") from None
            if not isinstance(r, dict):
                raise DamagedLog(f"{path}, line {n}: not a JSON object")
            yield n, line if line.endswith("\n") else line + "\n", r


def _why(e: Exception) -> str:
    """What json.loads found wrong with a line: a syntax error and where, or a number past
    Python's 4,300 digits, or arrays or objects nested deeper than its recursion allows; or the
    first byte that is not UTF-8, and where."""
    if isinstance(e, UnicodeDecodeError):
        return f"byte 0x{e.object[e.start]:02x} at offset {e.start}"
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg}, column {e.colno}"
    return "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0]


def records(path, vocab: int | None = None, said=print) -> Iterator[tuple[int, str, dict]]:
    """(line number, line, record) of each record of a rollouts.jsonl, checked (_problem; token
    ids against a vocabulary of `vocab` ids, where given)."""
    for n, line, r in json_lines(path, said):
        if r.get("v") != FORMAT:
            raise DamagedLog(f"{path}, line {n}: rollouts of format {r.get('v')}, this smolrl "
                             f"reads format {FORMAT}")
        problem = _problem(r, vocab)
        if problem:
            raise DamagedLog(f"{path}, line {n}, field {problem}")
        yield n, line, r


def check_log(path, hint: str = ""):
    """A whole rollouts.jsonl checked before a run takes it up, its damage in one line (and
    `hint`: what to do); a cut last line is said where it is left out."""
    try:
        for _ in records(path, said=lambda _: None):
            pass
    except DamagedLog as e:
        raise SystemExit(f"error: {e}{hint}") from None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _numbers(xs, n: int, nulls: bool = True) -> str:
    """What is wrong with a per-token list (of numbers, or nulls where `nulls`, one per completion
    token)."""
    allowed = {int, float, type(None)} if nulls else {int, float}
    if not isinstance(xs, list) or not set(map(type, xs)) <= allowed:
        return "not a list of numbers"
    return f"{len(xs)} values for {n} completion tokens" if len(xs) != n else ""


# What each field of a record must hold: a check, and what it says when the value fails it.
TRAIN = {"index": (_whole, "not a whole number"), "group": (_whole, "not a whole number"),
         "sample": (_whole, "not a whole number"), "policy_version": (_whole, "not a whole number"),
         "kept": (lambda x: isinstance(x, bool), "not true or false"),
         "truncated": (lambda x: isinstance(x, bool), "not true or false"),
         "row": (lambda x: isinstance(x, dict), "not an object"),
         "completion": (lambda x: isinstance(x, str), "not a string"),
         "reward": (_number, "not a number"),
         "rewards": (lambda x: isinstance(x, dict) and all(v is None or _number(v)
                                                           for v in x.values()),
                     "not an object of numbers"),
         "correct": (lambda x: x is None or isinstance(x, (int, float)), "not a number or null"),
         "advantage": (lambda x: x is None or _number(x), "not a number or null")}
EVAL = {"id": (lambda x: isinstance(x, (str, int)) and not isinstance(x, bool),
               "not a string or a whole number"),
        "sample": (_whole, "not a whole number"),
        "completion": (lambda x: isinstance(x, str), "not a string"),
        "correct": (lambda x: isinstance(x, (int, float)), "not a number")}
EPISODE = ("prompt", "messages", "turns", "tool_calls", "tool_errors", "tool_seconds", "done")


def _problem(r: dict, vocab: int | None) -> str:
    """What is wrong with a record, as "F: what" (F its field); "" where nothing is: what the
    report, a resume and --replay read from it is there, of its type, token ids in the
    vocabulary, per-token lists as long as the completion."""
    if r.get("kind") not in ("train", "eval"):
        return f"kind: {r.get('kind')!r} is neither \"train\" nor \"eval\""
    if not _whole(r.get("step")):
        return "step: not a whole number"
    for name, (ok, what) in (TRAIN if r["kind"] == "train" else EVAL).items():
        if name not in r:
            if r["kind"] == "train" or name != "sample":  # (an eval's sample: from 0, optional)
                return f"{name}: missing"
        elif not ok(r[name]):
            return f"{name}: {what}"
    if r["kind"] == "eval":
        return ""
    for name in ("prompt_ids", "completion_ids"):
        ids = r.get(name)
        if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
            return f"{name}: missing" if ids is None else f"{name}: not a list of token ids"
        if name == "prompt_ids" and not ids:
            return f"{name}: empty (a completion follows a prompt of one token at least)"
        if ids and min(ids) < 0:
            return f"{name}: token id {min(ids)} is below 0"
        if ids and vocab and max(ids) >= vocab:
            return (f"{name}: token id {max(ids)} is past the vocabulary of the model that reads "
                    f"it ({vocab} ids)")
    n = len(r["completion_ids"])
    if "mask" in r and (_numbers(r["mask"], n) or not set(r["mask"]) <= {0, 1}):
        return f"mask: {_numbers(r['mask'], n) or 'not 0s and 1s'}"
    if "engine_logprobs" in r and _numbers(r["engine_logprobs"], n, nulls=False):
        return f"engine_logprobs: {_numbers(r['engine_logprobs'], n, nulls=False)}"
    if "episode" in r:
        if not isinstance(r["episode"], dict):
            return "episode: not an object"
        missing = [k for k in EPISODE if k not in r["episode"]]
        if missing:
            return f"episode: no {missing[0]!r}"
    if "tokens" in r:
        t = r["tokens"]
        if not isinstance(t, dict) or not isinstance(t.get("pieces", []), list) \
                or not all(isinstance(p, str) for p in t.get("pieces", [])):
            return "tokens: not an object with a list of pieces"
        if "pieces" in t and len(t["pieces"]) != n:
            return f"tokens: {len(t['pieces'])} pieces for {n} completion tokens"
        for name, xs in t.items():
            if name not in ("pieces", "prompt") and _numbers(xs, n):
                return f"tokens.{name}: {_numbers(xs, n)}"
    return ""


def saved_steps(folder: str, group_size: int, steps: int,
                vocab: int | None = None) -> dict[int, list[dict]]:
    """--replay's rollouts: every training step's samples from a run folder, every record
    checked (token ids against a vocabulary of `vocab` ids) and the steps against the run that
    replays them (its steps, its group size) before any model loads."""
    path = Path(folder) / FILE
    if not path.is_file():
        raise SystemExit(f"error: --replay {folder}: no {FILE} there (a run folder of grpo.py, "
                         f"ppo.py or distill.py)")
    by_step: dict[int, list[dict]] = {}
    lines: dict[int, list[int]] = {}
    try:
        for n, _, r in records(path, vocab):
            if r["kind"] == "train":
                by_step.setdefault(r["step"], []).append(r)
                lines.setdefault(r["step"], []).append(n)
    except DamagedLog as e:
        raise SystemExit(f"error: --replay {folder}: {e}") from None
    missing = [s for s in range(1, steps + 1) if s not in by_step]
    if missing:
        raise SystemExit(f"error: --replay {folder}: {FILE} has no samples of step {missing[0]} "
                         f"(it holds steps {min(by_step, default=0)}-{max(by_step, default=0)}); "
                         f"pass --steps {max(by_step, default=0)} or fewer")
    for s, saved in by_step.items():
        if any(r["sample"] >= group_size for r in saved) or len(saved) % group_size or \
                sum(r["kept"] for r in saved) % group_size:
            raise SystemExit(f"error: --replay {folder}: step {s}'s groups are not of "
                             f"--num-generations {group_size}; replay with the run's own")
        unlike = _unlike(saved)
        if unlike is not None:
            i, name = unlike
            raise SystemExit(f"error: --replay {folder}: {path}, line {lines[s][i]}, field "
                             f"{name}: unlike the first sample of step {s} (line {lines[s][0]})")
    return by_step


def _unlike(saved: list[dict]) -> tuple[int, str] | None:
    """(index, field) of the first sample of a step that a replay cannot take with the step's
    first: the optional fields there or not, a correctness or not, other reward sources."""
    first = saved[0]
    for i, r in enumerate(saved):
        for name in ("mask", "engine_logprobs", "episode"):
            if (name in r) != (name in first):
                return i, name
        if (r["correct"] is None) != (first["correct"] is None):
            return i, "correct"
        if r["rewards"].keys() != first["rewards"].keys():
            return i, "rewards"
    return None

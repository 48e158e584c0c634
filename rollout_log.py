"""Rollouts on disk: what every RL step sampled, how it was scored and weighted, token by token.

Every run of the RL loop (grpo.py, ppo.py, distill.py) appends to <out>/rollouts.jsonl, one JSON
object per sample, as each step ends; held-out evaluations add their samples to the same file.
One file of JSON lines because a killed run keeps every step it finished, a resumed run cuts it
back to its checkpoint's step, it needs no library to write, and it opens in one line:

    pandas.read_json("out/rollouts.jsonl", lines=True)
    datasets.load_dataset("json", data_files="out/rollouts.jsonl")

Format version 1 (the field `v`). Every record has `v`, `kind` ("train" or "eval") and `step`.

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
import time
from pathlib import Path

import torch

FORMAT = 1
FILE = "rollouts.jsonl"


def detail_samples(rewards: torch.Tensor, group_size: int, groups: int) -> list[int]:
    """The samples whose per-token numbers are kept: all of the first `groups` groups with a
    reward spread (those have advantages, so the update computes their log-probs), then groups
    without one; groups < 0: every sample."""
    n_groups = len(rewards) // group_size
    if groups < 0:
        return list(range(len(rewards)))
    spread = rewards.view(n_groups, group_size).std(1) > 1e-6 if n_groups else torch.zeros(0)
    order = [g for g in range(n_groups) if spread[g]] + [g for g in range(n_groups)
                                                         if not spread[g]]
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
    records of steps up to s (the steps after them are sampled again)."""

    def __init__(self, out: Path, resumed_at: int):
        self.path, self.seconds = Path(out) / FILE, 0.0  # (seconds: writing, since last asked)
        kept = [r for r in read_rollouts(self.path) if r["step"] <= resumed_at] \
            if resumed_at and self.path.exists() else []
        self._write(kept, "w")

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


def read_rollouts(path, kind: str | None = None) -> list[dict]:
    """The records of a rollouts.jsonl (a run folder or the file), of one kind or all; a record
    of another format version stops here, in one line."""
    path = Path(path)
    path = path / FILE if path.is_dir() else path
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("v") != FORMAT:
                raise SystemExit(f"error: {path}, line {n}: rollouts of format {r.get('v')}, "
                                 f"this smolrl reads format {FORMAT}")
            if kind is None or r["kind"] == kind:
                records.append(r)
    return records


def saved_steps(folder: str, group_size: int, steps: int) -> dict[int, list[dict]]:
    """--replay's rollouts: every training step's samples from a run folder, checked against the
    run that replays them (its steps, its group size) before any model loads."""
    path = Path(folder) / FILE
    if not path.is_file():
        raise SystemExit(f"error: --replay {folder}: no {FILE} there (a run folder of grpo.py, "
                         f"ppo.py or distill.py)")
    by_step: dict[int, list[dict]] = {}
    for r in read_rollouts(path, "train"):
        by_step.setdefault(r["step"], []).append(r)
    missing = [s for s in range(1, steps + 1) if s not in by_step]
    if missing:
        raise SystemExit(f"error: --replay {folder}: {FILE} has no samples of step {missing[0]} "
                         f"(it holds steps {min(by_step, default=0)}-{max(by_step, default=0)}); "
                         f"pass --steps {max(by_step, default=0)} or fewer")
    for s, records in by_step.items():
        if any(r["sample"] >= group_size for r in records) or \
                sum(r["kept"] for r in records) % group_size:
            raise SystemExit(f"error: --replay {folder}: step {s}'s groups are not of "
                             f"--num-generations {group_size}; replay with the run's own")
    return by_step

"""Evaluate a model on math problems: avg@n, unbiased pass@k, maj@k.

    python evaluate.py                                    # offline default model, arith held-out
    python evaluate.py --model out/grpo --data aime24.jsonl -n 16 --temperature 0.6 --top-p 0.95 \\
        --max-new-tokens 32768 --template boxed
    python evaluate.py --data a.jsonl,b.parquet,HuggingFaceH4/MATH-500   # one table row each

For every problem we draw n samples, extract an answer from each (reward.extract_answer) and grade
it against the reference (reward.Grader). With c correct samples out of n:

    avg@n  = mean over problems of c / n          (what DeepScaleR and NeMo-RL call pass@1)
    pass@k = mean over problems of 1 - C(n-c, k) / C(n, k)     (unbiased; Chen et al. 2021)
    maj@k  = mean over problems of [the most common answer among the first k samples is correct]

grpo.py calls `evaluate_rows` for its periodic held-out evaluation: one implementation, not two.
"""

import importlib.util
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from cli import check, check_numbers, flag, parse_config, readable_paths
from data import TEMPLATES, Template, escaped, dataset_name, encode_prompts, load_rows
from reward import Grader, extract_answer, fast_match
from env import Agent, episode_metrics, load_environment, load_tools
from rollout import tokens_after_prompt
from sampling import Sampling

# ---------------------------------------------------------------------------------------------
# Metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k samples (drawn without replacement from n
    samples of which c are correct) is correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers: list[str | None], correct: list[bool], equivalent=None) -> bool:
    """Is the most common answer correct? Answers vote as classes of equivalent answers, so "0.5"
    and "1/2" add up. Every correct answer is equivalent to the reference, hence one class; the
    others are grouped by equivalent(a, b) (default: reward.fast_match, i.e. equal after normalize()
    or as exact numbers; evaluate passes the grader, which adds math-verify). Samples without an
    answer do not vote. Ties go to the class seen first: deterministic, independent of ordering."""
    equivalent = equivalent or (lambda a, b: bool(fast_match(a, b)))
    classes: list[list[int]] = []  # indices of the samples in each class, in order of appearance
    for i, (a, ok) in enumerate(zip(answers, correct)):
        if a is None:
            continue
        for members in classes:
            first = members[0]
            if ok == correct[first] and (ok or equivalent(a, answers[first])):
                members.append(i)
                break
        else:
            classes.append([i])
    if not classes:
        return False
    winner = max(classes, key=lambda members: (len(members), -members[0]))
    return correct[winner[0]]


def powers_of_two(n: int) -> list[int]:
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def summarize(samples: list[dict], n: int, grader: Grader | None = None) -> dict:
    """Table row for one dataset from its per-sample records (see evaluate_rows); the grader, if
    given, decides which wrong answers vote together in maj@k."""
    equivalent = (lambda a, b: grader.grade([a], [b])[0]) if grader else None
    by_problem = {}
    for s in samples:
        by_problem.setdefault(s["id"], []).append(s)
    groups = list(by_problem.values())
    ks = sorted(set(powers_of_two(n)) | {n})
    row = {"problems": len(groups),
           "avg@n": sum(sum(s["correct"] for s in g) / len(g) for g in groups) / len(groups)}
    for k in ks:
        row[f"pass@{k}"] = sum(pass_at_k(len(g), sum(s["correct"] for s in g), k)
                               for g in groups) / len(groups)
    for k in ks[1:]:  # maj@1 would equal pass@1; maj@n is the vote over all n samples
        name = "maj@n" if k == n else f"maj@{k}"
        row[name] = sum(majority_vote([s["extracted"] for s in g[:k]],
                                      [s["correct"] for s in g[:k]], equivalent)
                        for g in groups) / len(groups)
    row["mean_len"] = sum(s["length"] for s in samples) / len(samples)
    row["truncated"] = sum(s["truncated"] for s in samples) / len(samples)
    for key in ("turns", "tool_calls", "reward"):  # episodes: per sample
        if key in samples[0]:
            row[key] = sum(s[key] for s in samples) / len(samples)
    if "tool_calls" in samples[0]:  # how often the model acts at all, and how often it errs
        calls = sum(s["tool_calls"] for s in samples)
        row["tool_call_rate"] = sum(s["tool_calls"] > 0 for s in samples) / len(samples)
        row["tool_error_rate"] = sum(s["tool_errors"] for s in samples) / max(calls, 1)
    return row


# ---------------------------------------------------------------------------------------------
# Running the model


def evaluate_rows(rollout, tokenizer, rows, *, template: str, chat: bool, sampling: Sampling,
                  n: int, grader: Grader, dataset: str = "", batch_prompts: int = 256,
                  progress: bool = True, agent=None):
    """Generate n samples per row -- or with an agent (env.Agent, --tools / --env) play n
    episodes of each -- and grade them. Returns (summary row, per-sample records)."""
    fmt = TEMPLATES[template][1]
    samples, floor = [], [0.0, 0.0]  # the calls' compute and memory floors (hardware.py)
    bar = tqdm(total=len(rows) * n, desc=f"eval {dataset}", unit="sample", disable=not progress,
               leave=False)
    for s in range(0, len(rows), batch_prompts):
        chunk = rows[s:s + batch_prompts]
        episodes = []
        if agent:
            out, episodes = agent.run(rollout, chunk, n, sampling)
        else:
            out = rollout.generate(encode_prompts(tokenizer, chunk, template, chat), n, sampling)
        floor = [floor[0] + out.compute_floor, floor[1] + out.memory_floor]
        extracted = [extract_answer(t, fmt) for t in out.text]
        if "answer" in chunk[0]:
            correct = grader.grade(extracted, [r["answer"] for r in chunk for _ in range(n)])
        else:  # an environment without reference answers: solved is what it scores above 0
            correct = [e.env.get_reward() > 0 for e in episodes]
        for i in range(len(out)):
            row = chunk[i // n]
            samples.append({"dataset": dataset, "id": row["id"], "sample": i % n,
                            "completion": out.text[i], "extracted": extracted[i],
                            "correct": bool(correct[i]), "length": len(out.completion_ids[i]),
                            "truncated": out.truncated[i],
                            **({"turns": episodes[i].turns, "tool_calls": episodes[i].tool_calls,
                                "tool_errors": episodes[i].tool_errors} if episodes else {}),
                            **({"reward": float(episodes[i].env.get_reward())} if episodes and
                               hasattr(episodes[i].env, "get_reward") else {})})
        bar.update(len(out))
    bar.close()
    return {**summarize(samples, n, grader), "floors": floor}, samples


def evaluate_held_out(run, rows: list[dict], cfg, grader: Grader,
                      batch_prompts: int = 256) -> tuple[dict, list[dict]]:
    """grpo.py's held-out metrics -- greedy accuracy with the same engine and grader as training
    (run: a trainer.Run, cfg: a grpo.Config) --, and the samples they come from. batch_prompts:
    the problems generated (or played, with an agent) at a time."""
    t0 = time.time()
    summary, samples = evaluate_rows(run.rollout, run.tokenizer, rows, template=cfg.template,
                               chat=cfg.chat, sampling=Sampling(cfg.max_new_tokens, 0.0), n=1,
                               grader=grader, dataset="held-out", agent=run.agent,
                               batch_prompts=batch_prompts)
    seconds = time.time() - t0
    return {"eval_accuracy": summary["avg@n"], "eval_completion_len": summary["mean_len"],
            **{f"eval_{key}": summary[key] for key in ("turns", "tool_calls", "tool_call_rate",
                                                        "tool_error_rate", "reward")
               if key in summary},
            "eval_seconds": seconds, **roofline("eval", *summary["floors"], seconds)}, samples


def roofline(phase: str, compute_floor: float, memory_floor: float, seconds: float) -> dict:
    """A phase's seconds against its roofline (hardware.py): <phase>_compute_frac and
    <phase>_memory_frac, each floor over the seconds taken, and <phase>_roofline_frac, the larger:
    the bound that binds, and how close the phase came to it."""
    if seconds <= 0:
        return {}
    compute, memory = compute_floor / seconds, memory_floor / seconds
    return {f"{phase}_roofline_frac": max(compute, memory), f"{phase}_compute_frac": compute,
            f"{phase}_memory_frac": memory}


TRACKERS = ("tensorboard", "wandb")  # (the package each needs: its name)


def check_trackers(report_to: str):
    """--report-to names known trackers whose packages are installed: said before anything loads,
    not at the first write, after the models have loaded."""
    names = [n for n in report_to.split(",") if n]
    check(all(n in TRACKERS for n in names), f"--report-to {report_to}: choose from "
          f"{', '.join(TRACKERS)} (comma-separated)")
    for name in names:
        check(importlib.util.find_spec(name) is not None, f"--report-to {report_to}: {name} is "
              f"not installed; pip install {name}")


OFFLINE = ("offline", "disabled", "dryrun")  # (WANDB_MODE's values that need no API key)


def log_in_trackers(report_to: str):
    """wandb's API key found before the models load, where wandb.init would look for it after
    them (and, on a terminal, wait for it to be typed): without one the run stops in one line.
    With WANDB_MODE=offline none is needed. A key found is not verified (verify=False): one
    revoked fails at wandb.init, after the models load."""
    if "wandb" not in report_to.split(","):
        return
    try:
        import wandb
        if wandb.setup().settings.mode in OFFLINE:  # (WANDB_MODE, or `wandb offline`'s file)
            return
        if wandb.run is not None:  # (a notebook's own run: login() says False then, key or
            return  # not; unchecked here -- with an offline one and no key, wandb.init fails)
        found = wandb.login(verify=False, prompt=False)
    except ImportError as e:
        raise SystemExit(f"error: --report-to {report_to}: {e.name} is not installed; pip "
                         f"install {e.name}") from None
    except Exception as e:  # (a key of the wrong form, a package that fails to import)
        raise SystemExit(tracker_failed(report_to, e)) from None
    if not found:
        raise SystemExit(f"error: --report-to {report_to}: no wandb API key here (`wandb "
                         f"login`, or WANDB_API_KEY; WANDB_MODE=offline logs without one)")


def tracker_failed(report_to: str, e: Exception) -> str:
    """A tracker's own error (wandb not logged in, no network) as one line."""
    why = escaped(" / ".join(line.strip() for line in str(e).splitlines() if line.strip())[:400])
    return f"error: --report-to {report_to}: {type(e).__name__}: {why} (`wandb login`, or " \
           f"WANDB_MODE=offline)"


class RunLog:
    """Where a run's metrics go: the history, <out>/metrics.jsonl (rewritten from `history` on
    resume), the printed step line, and the trackers asked for with --report-to -- TensorBoard
    (<out>/tensorboard) and Weights & Biases -- imported only then."""

    def __init__(self, out: Path, history: list[dict], report_to: str = "", config=None,
                 line=None):
        self.out, self.history, self.line = out, history, line or format_step
        # Beside it, then renamed over it: a write that fails half way (a full disk) leaves the
        # old file whole, and a link there is replaced, never written through.
        tmp = out / ".metrics.jsonl.tmp"
        tmp.unlink(missing_ok=True)
        try:
            with open(tmp, "x") as f:
                f.write("".join(json.dumps(r) + "\n" for r in history))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, out / "metrics.jsonl")
        self.tensorboard = self.wandb = None
        names = [n for n in report_to.split(",") if n]
        try:
            if "tensorboard" in names:
                from torch.utils.tensorboard import SummaryWriter
                self.tensorboard = SummaryWriter(log_dir=str(out / "tensorboard"))
            if "wandb" in names:
                import wandb
                self.wandb = wandb.init(project="smolrl", name=out.name, dir=str(out),
                                        config=config or {})
        except ImportError as e:
            raise SystemExit(f"error: --report-to {report_to}: {e.name} is not installed; "
                             f"pip install {e.name}") from None
        except Exception as e:  # (its project unreachable, say: log_in_trackers ran before)
            raise SystemExit(tracker_failed(report_to, e)) from None

    def __call__(self, record: dict):
        self.history.append(record)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        tqdm.write(self.line(record))
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tensorboard:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, record["step"])
            self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(scalars, step=record["step"])

    def close(self):
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def show_samples(rows: list[dict], texts: list[str], rewards, k: int = 2):
    """Print k sampled completions spread over the batch, with their reward and the answer (its
    first 200 characters: a code dataset's holds its tests), each on one line, escaped: a
    dataset's or a model's text never reaches the terminal as its commands."""
    for i in range(0, len(texts), max(1, len(texts) // k))[:k]:
        answer = str(rows[i].get("answer"))
        if len(answer) > 200:
            answer = f"{answer[:200]} [... {len(answer) - 200:,} characters left out]"
        tqdm.write(f"  sample (reward {float(rewards[i]):.2f}, answer {escaped(answer)}): "
                   f"{texts[i]!r}")  # (repr: the same escapes, in quotes)


def step_record(step: int, sampled, update: dict, train_seconds: float, sync_seconds: float,
                group_size: int) -> dict:
    """A GRPO step's metrics from what it sampled (a grpo.Scored, every round) and its update.
    These, not the loss (~0 by construction on-policy), say whether RL is working."""
    comps, rewards = sampled.completions, sampled.rewards
    update_seconds = train_seconds - update.get("detail_seconds", 0.0)
    lens = torch.tensor([len(c) for c in comps.completion_ids], dtype=torch.float)
    record = {
        "step": step,
        "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
        "zero_std_frac": float((rewards.view(-1, group_size).std(1) <= 1e-6).float().mean()),
        "completion_len": float(lens.mean()), "completion_len_max": int(lens.max()),
        "truncated_frac": sum(comps.truncated) / len(comps),
        **update,
        "gen_seconds": sampled.gen_seconds, "reward_seconds": sampled.reward_seconds,
        "train_seconds": train_seconds, "sync_seconds": sync_seconds,
        # (episodes: the model's own tokens; tool results are appended, not generated)
        "gen_tokens_per_s": (sum(map(sum, comps.mask)) if comps.mask is not None else
                             float(lens.sum())) / sampled.gen_seconds if sampled.gen_seconds
        else 0.0,  # (--replay: nothing was generated)
        "train_tokens_per_s": update["trained_tokens"] / max(train_seconds, 1e-9),
        # the update's model FLOPs over its seconds, against the trainers' peak (hardware.py);
        # not the rollout log's extra pass, which is no part of the update (detail_seconds)
        "mfu": (update.get("model_flops", 0.0) / update_seconds / update["peak_flops"]
                if update_seconds > 0 and update.get("peak_flops") else 0.0),
        # the engine's seconds against its roofline: compute (model FLOPs over the peak) and
        # memory (weights and keys and values read over the bandwidth), hardware.py
        **roofline("gen", comps.compute_floor, comps.memory_floor, sampled.gen_seconds),
        # prompt tokens whose keys and values came from a cache: a group's shared prompt, an
        # episode's earlier turns
        "prompt_cache_hit": comps.cached_tokens / comps.prompt_tokens if comps.prompt_tokens
        else 0.0,
    }
    if sampled.correct:  # data with reference answers
        record["accuracy"] = sum(sampled.correct) / len(sampled.correct)
    if sampled.episodes:  # --tools / --env
        record.update(episode_metrics(sampled.episodes))
    # Each source's mean over the samples it applied to: a reward model's (reward_rm:<name>) is
    # the proxy the policy climbs, beside the truth (accuracy, eval_accuracy).
    for name, scores in sampled.per_fn.items():
        scores = [x for x in scores if x is not None]
        record[f"reward_{name}"] = sum(scores) / max(len(scores), 1)
    return record


def format_step(r: dict) -> str:
    """The line grpo.py and ppo.py print for each step (and for the step-0 evaluation)."""
    if r["step"] == 0:
        return f"step    0 | held-out accuracy {r['eval_accuracy']:.3f} (greedy)"
    accuracy = f"acc {r['accuracy']:.3f} " if "accuracy" in r else ""
    line = (f"step {r['step']:4d} | reward {r['reward']:.3f} {accuracy}"
            f"zero-std {r['zero_std_frac']:.2f} | len {r['completion_len']:.1f} "
            f"trunc {r['truncated_frac']:.2f} | gnorm {r['grad_norm']:.3f}")
    if "entropy_trained" in r:
        line += f" ent {r['entropy_trained']:.3f}"
    if "clip_low" in r:  # (no policy loss: ppo.py's critic warm-up)
        line += f" clip {r['clip_low'] + r['clip_high']:.3f}"
    if "kl" in r:
        line += f" kl {r['kl']:.4f}"
    if "turns" in r:
        line += (f" | turns {r['turns']:.1f} tools {r['tool_calls']:.2f} "
                 f"(errors {r['tool_errors']})")
    if "value_loss" in r:  # ppo.py's critic: its loss, explained variance, values and returns
        line += (f" | value loss {r['value_loss']:.4f} ev {r['explained_variance']:.3f} "
                 f"V {r['value_mean']:.3f} G {r['return_mean']:.3f}")
    line += (f" | gen {r['gen_seconds']:.1f}s train {r['train_seconds']:.1f}s "
             f"({r['gen_tokens_per_s']:.0f} tok/s gen"
             + (f" at {r['gen_roofline_frac']:.0%} of its roofline, "
                f"{'compute' if r['gen_compute_frac'] >= r['gen_memory_frac'] else 'memory'}-bound"
                if r.get("gen_roofline_frac") else "")
             + (f", mfu {r['mfu']:.1%})" if r.get("mfu") else ")"))
    if "eval_accuracy" in r:
        line += f" | held-out {r['eval_accuracy']:.3f}"
    if r.get("reward_errors"):
        line += f" | reward errors {r['reward_errors']}"
    return line


# ---------------------------------------------------------------------------------------------
# Command line


@dataclass
class EvalConfig:
    # What is evaluated: the model, and the problems it solves
    model: str = "SmolLM2-135M-Instruct-GGUF"
    """model: the offline default, a hub id, or a local HF folder (e.g. a grpo.py run's --out)"""
    data: str = "arith"
    """comma-separated datasets: `arith` (built-in held-out set), .jsonl/.parquet files, hub ids"""
    limit: int = 0
    """evaluate only the first N problems of each dataset (0 = all)"""
    prompt_field: str = ""
    """the prompt column (default: `problem`, else `prompt`; chat messages are fine)"""
    answer_field: str = "answer"
    """the reference-answer column"""
    split: str = ""
    """hub datasets: the split (default: the one data.HUB_DATASETS names, else train)"""
    template: Template = "answer-is"
    """prompt template: one of data.TEMPLATES (answer-is, boxed, raw)"""
    chat: bool = True
    """wrap the prompt in the model's chat template (turn off for base models)"""

    # The engine
    backend: Literal["hf", "vllm"] = "hf"
    """rollout engine: hf (transformers) or vllm"""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """the engine's compute dtype; auto: bf16 where the hardware has it natively, else fp32"""
    gpu_memory_utilization: float = 0.2
    """vllm: fraction of GPU memory (host memory on CPU) for the engine"""
    batch_prompts: int = 256
    """prompts generated together"""

    # How it answers: samples a problem, and their decoding
    n: int = 1
    """samples per problem"""
    temperature: float = 0.0
    """sampling temperature (0 = greedy)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    max_new_tokens: int = 32
    """response length limit; longer responses count as truncated"""
    seed: int = 0
    """sampling seed"""

    # Episodes with tools or an environment (env.py)
    tools: str = ""
    """episodes with tools, as grpo.py's --tools (calculator, python, module:function)"""
    env: str = ""
    """episodes in an environment, as grpo.py's --env (module:Class); solved = get_reward() > 0
    where the data has no answers"""
    max_turns: int = 4
    """episodes: assistant turns at most"""
    max_episode_tokens: int = 512
    """episodes: tokens after the prompt at most, tool results included"""

    # Where the results go
    out: str = "out/eval"
    """folder for results.json and samples.jsonl"""

    def __post_init__(self):  # impossible values stop here, before anything loads
        for name in ("n", "max_new_tokens", "batch_prompts", "max_turns", "max_episode_tokens"):
            check(getattr(self, name) >= 1, f"{flag(name)} must be at least 1")
        check_numbers(self)
        check(self.limit >= 0, "--limit must not be negative (0 = all)")
        check(self.temperature >= 0, "--temperature must not be negative (0 = greedy)")
        check(0 < self.top_p <= 1, "--top-p must be in (0, 1]")
        check(0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]")


def main(argv=None):
    cfg = parse_config(EvalConfig, argv, description=__doc__.split("\n")[0])
    with readable_paths(vars(cfg)):  # (a flag's path this user may not reach: one line)
        evaluate_data(cfg)


def evaluate_data(cfg):
    """Every --data source sampled and graded, the table printed, results.json and samples.jsonl
    written to --out."""
    # Load every dataset before the model, so a bad file fails in a second, not after a minute.
    sources, out = cfg.data.split(","), Path(cfg.out)
    check_sources(sources, out)
    datasets = {dataset_name(src): load_rows(src, limit=cfg.limit or None,
                                             prompt_field=cfg.prompt_field,
                                             answer_field=cfg.answer_field, split=cfg.split,
                                             need_answers=not cfg.env)
                for src in sources}
    try:  # (a file on its path, a read-only disk: said now, not after the model loaded)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(escaped(f"error: --out {out}: cannot make that folder ({e.strerror}); "
                                 f"choose another --out")) from None
    try:  # (a folder there already that this user may not write in: likewise)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise SystemExit(escaped(f"error: --out {out}: cannot write there ({e.strerror}); "
                                 f"choose another --out")) from None
    from run_folder import check_movable
    check_movable(out, earlier_results(out))  # (write_results moves them aside first)
    tools, env_class = load_tools(cfg.tools), load_environment(cfg.env)  # before the model, too
    agent = Agent.for_run(cfg, TEMPLATES[cfg.template][0], tools, env_class)
    from hardware import choose_dtype, pick_device
    from model import load_model
    from rollout import decoding_mode, make_rollout
    device = pick_device()
    dtype = choose_dtype(cfg.dtype, device)
    print(f"dtype {dtype.name} ({dtype.reason})")
    model, tokenizer = load_model(cfg.model, device)
    rollout = make_rollout(cfg.backend, model, tokenizer, device=device, seed=cfg.seed,
                           dtype=dtype.torch,
                           max_new_tokens=tokens_after_prompt(cfg),
                           max_prompt_tokens=longest_prompt(tokenizer, datasets, cfg, agent)
                           if cfg.backend == "vllm" else 0,
                           gpu_memory_utilization=cfg.gpu_memory_utilization)
    del model
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed)
    grader = Grader()
    prompt = TEMPLATES[cfg.template][0].format(problem="{problem}")
    # What the machine chose for these numbers (--dtype auto's dtype, the HF engine's decoding:
    # both change bf16 samples), for another evaluation to compare like with like.
    results = {"config": {**asdict(cfg), "prompt": prompt}, "dtype": dtype.name,
               "decoding": decoding_mode(rollout), "datasets": {}}
    all_samples = []
    t0 = time.time()
    for name, rows in datasets.items():
        summary, samples = evaluate_rows(rollout, tokenizer, rows, template=cfg.template,
                                         chat=cfg.chat, sampling=sampling, n=cfg.n, grader=grader,
                                         dataset=name, batch_prompts=cfg.batch_prompts,
                                         agent=agent)
        summary.pop("floors")  # (the table holds what was measured about the model)
        results["datasets"][name] = summary
        all_samples += samples
    grader.close()
    moved = write_results(out, results, all_samples)
    if moved:
        print(moved)
    print(f"template {cfg.template!r} (chat={cfg.chat}): {prompt!r}")
    print(f"n={cfg.n} temperature={cfg.temperature} top_p={cfg.top_p} "
          f"max_new_tokens={cfg.max_new_tokens}  ({time.time() - t0:.0f} s)")
    print(format_table(results["datasets"]))
    print(f"wrote {out / 'results.json'} and {out / 'samples.jsonl'}")


def check_sources(sources: list[str], out: Path):
    """Before anything loads: results are keyed by a dataset's name, so two of one name (a/test.jsonl
    and b/test.jsonl) would leave one unreported; and a data file that is one of the files the
    evaluation writes in --out would be moved aside as "an earlier evaluation"."""
    names = [dataset_name(src) for src in sources]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SystemExit(escaped(f"error: --data {','.join(sources)}: two datasets named "
                                 f"{twice[0]} (results are kept by name): give them files of "
                                 f"other names"))
    for src in sources:
        for name in ("results.json", "samples.jsonl"):
            written = out / name
            if Path(src).is_file() and written.is_file() and os.path.samefile(src, written):
                raise SystemExit(escaped(f"error: --data {src} is the {name} this evaluation "
                                         f"writes in --out {out}: choose another --out"))


def write_results(out: Path, results: dict, samples: list[dict]) -> str:
    """results.json and samples.jsonl in --out, an earlier evaluation's there first moved whole
    to <out>/superseded/<time>/ (run_folder.set_aside): nothing is overwritten. The line that
    says where it went ("" when there was none)."""
    from run_folder import set_aside
    earlier = earlier_results(out)
    _, aside, _ = set_aside(out, earlier, "", None)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    with open(out / "samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    if aside is None:
        return ""
    return escaped(f"{out} held an earlier evaluation: its {', '.join(p.name for p in earlier)} "
                   f"are moved to {aside} (delete it when you no longer need it)")


def earlier_results(out: Path) -> list[Path]:
    """An earlier evaluation's files in --out, which write_results moves aside."""
    return [out / name for name in ("results.json", "samples.jsonl")
            if os.path.lexists(out / name)]


def longest_prompt(tokenizer, datasets: dict, cfg, agent=None) -> int:
    """The longest prompt of the data, in tokens as the engine gets it (an episode's first turn
    before an environment's reset text): a vLLM engine is sized to hold it and the tokens after
    it (rollout.engine_length)."""
    if agent:
        return max((len(agent.chat.prompt_ids(agent.messages(row)))
                    for rows in datasets.values() for row in rows), default=1)
    return max((len(ids) for rows in datasets.values()
                for ids in encode_prompts(tokenizer, rows, cfg.template, cfg.chat)), default=1)


def format_table(rows: dict) -> str:
    cols = list(next(iter(rows.values())).keys())
    widths = [max(10, len(c) + 1) for c in cols]
    lines = ["dataset".ljust(16) + "".join(c.rjust(w) for c, w in zip(cols, widths))]
    for name, row in rows.items():
        cells = [f"{row[c]:{w}d}" if isinstance(row[c], int) else f"{row[c]:{w}.3f}"
                 for c, w in zip(cols, widths)]
        lines.append(name[:16].ljust(16) + "".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    main()

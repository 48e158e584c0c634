"""GRPO: Group Relative Policy Optimization, in one file you can read top to bottom.

For each prompt we sample a *group* of G completions, score each with a verifiable reward, and use
the group itself as the baseline -- no value network:

    A_i = (r_i - mean(r_group)) / std(r_group)                     group-relative advantage
    r_t = pi_theta(o_t | q, o_<t) / pi_old(o_t | q, o_<t)          per-token probability ratio
    L   = -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i)  clipped surrogate (PPO)
          + beta * KL_k3(pi_theta || pi_ref)                       optional, k3 estimator

averaged over the valid tokens of the whole batch (DAPO's token-mean; see `loss_agg`).

What this file leaves out on purpose: a value model (that is PPO), reward models (rewards here are
verifiable: answer checking), multi-turn / tool use, and sequence packing. Generation engines live
in rollout.py, rewards in reward.py, evaluation in evaluate.py.

    python grpo.py                                   # CPU, offline: SmolLM2-135M learns arithmetic
    python grpo.py --model Qwen/Qwen2.5-Math-1.5B --data HuggingFaceH4/MATH-500 --template boxed \\
        --max-new-tokens 1024 --eval-data HuggingFaceH4/aime_2024     # one GPU (vLLM: see #5)
    many GPUs / nodes: distributed.py with Ray (see #6)
"""

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from data import TEMPLATES, arith_heldout, arith_stream, encode_prompts, load_rows, parse_config
from data import row_stream
from evaluate import evaluate_rows, plot_curves
from model import DEFAULT_MODEL, autocast, completion_logprobs, length_mask, load_model, pack
from model import pick_device, save_model
from reward import Grader, RewardFunctions, correctness_reward
from rollout import Sampling, make_rollout


@dataclass
class Config:
    model: str = DEFAULT_MODEL
    """policy to train: the offline default, a hub id, or a local HF folder"""
    data: str = "arith"
    """training problems: `arith` (built-in, offline), a .jsonl/.parquet file, or a hub dataset id"""
    eval_data: str = ""
    """held-out problems (default: arith's held-out set, or the last eval_size rows of --data)"""
    eval_size: int = 256
    """number of held-out problems evaluated greedily"""
    template: str = "answer-is"
    """prompt template from data.TEMPLATES: answer-is, boxed, raw"""
    chat: bool = True
    """wrap prompts in the model's chat template (turn off for base models)"""
    reward: str = "correctness"
    """reward functions, comma-separated `name=weight`: correctness, format, or module:function"""
    rollout: str = "hf"
    """generation engine: hf (transformers generate) or vllm (in-process vLLM, weights synced)"""
    gpu_memory_utilization: float = 0.2
    """vLLM: fraction of GPU memory (of host memory on CPU) for weights and KV cache"""
    is_cap: float = 0.0
    """vLLM: truncated importance-sampling correction, weight min(pi_trainer/pi_engine, cap); 0=off"""
    steps: int = 30
    """optimizer steps (one rollout batch each when updates_per_rollout is 1)"""
    prompts_per_step: int = 8
    """prompts sampled per step (N)"""
    num_generations: int = 8
    """completions per prompt: the group size G"""
    max_new_tokens: int = 24
    """response length limit; responses that hit it are truncated"""
    temperature: float = 0.7
    """sampling temperature for training rollouts (log-probs use the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold for training rollouts"""
    lr: float = 1e-5
    """AdamW learning rate (constant after warmup)"""
    warmup_steps: int = 0
    """linear learning-rate warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    beta: float = 0.0
    """KL penalty weight against the initial policy (k3 estimator); 0 skips the reference model"""
    eps_low: float = 0.2
    """lower clip range: ratio floored at 1 - eps_low"""
    eps_high: float = 0.2
    """upper clip range: ratio capped at 1 + eps_high (DAPO's clip-higher uses 0.28)"""
    loss_agg: str = "token-mean"
    """token-mean (DAPO), seq-mean (original GRPO), seq-sum-norm (Dr. GRPO)"""
    adv_scale: str = "group"
    """advantage scaling: group (GRPO), batch, none (Dr. GRPO)"""
    leave_one_out: bool = False
    """baseline = mean of the *other* samples of the group (RLOO)"""
    updates_per_rollout: int = 1
    """optimizer steps per rollout batch; >1 makes the ratio and the clipping matter"""
    micro_batch_size: int = 16
    """sequences per forward/backward; gradients accumulate over the batch"""
    eval_every: int = 10
    """held-out greedy evaluation every N steps, at step 0 and at the end (0 = never)"""
    log_samples_every: int = 10
    """print a few sampled completions every N steps (0 = never)"""
    bf16: bool = True
    """bf16 autocast around fp32 master weights"""
    seed: int = 0
    """seed for data order, sampling and initialisation"""
    out: str = "out/grpo"
    """output folder: metrics.jsonl, curves.png, the final model in HF format"""


# ---------------------------------------------------------------------------------------------
# Advantages and loss: pure functions of tensors.


def group_advantages(rewards, group_size, *, scale="group", leave_one_out=False, eps=1e-6):
    """Group-relative advantages A_i = (r_i - baseline_group) / scale.

    rewards (N*G,) prompt-major. baseline: the group mean, or with leave_one_out the mean of the
    other G-1 rewards (RLOO). scale: "group" divides by the group's std (GRPO), "batch" by the std
    of the whole batch, "none" not at all (Dr. GRPO). A group whose rewards are all equal carries no
    signal: its advantages are exactly 0, never 0/0.
    """
    r = rewards.view(-1, group_size).float()  # (N, G)
    if leave_one_out:
        baseline = (r.sum(1, keepdim=True) - r) / (group_size - 1)  # (N, G)
    else:
        baseline = r.mean(1, keepdim=True)  # (N, 1)
    adv = r - baseline  # (N, G)
    group_std = r.std(1, keepdim=True)  # (N, 1), unbiased as in GRPO
    if scale == "group":
        adv = adv / (group_std + eps)
    elif scale == "batch":
        adv = adv / (r.std() + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, not {scale!r}")
    adv = torch.where(group_std < eps, torch.zeros_like(adv), adv)  # zero-std groups -> 0
    return adv.reshape(-1)  # (N*G,)


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, eps_low=0.2,
              eps_high=0.2, beta=0.0, loss_agg="token-mean", num_tokens=None, token_weights=None):
    """Clipped-surrogate GRPO loss with an optional k3 KL penalty.

    logprobs, old_logprobs, ref_logprobs, mask: (B, T); advantages: (B,).
        r_t      = exp(logprobs - old_logprobs)
        L_t      = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * k3_t
        k3_t     = exp(ref - lp) - (ref - lp) - 1     (>= 0, unbiased for KL(pi || ref))
    loss_agg and num_tokens (the denominator for the *global* batch, so that micro-batches sum to
    the full-batch loss; None = this batch's own):
        "token-mean"   sum of L_t over valid tokens / number of valid tokens      (DAPO, NeMo-RL)
        "seq-mean"     sum over sequences of (mean of L_t over the sequence) / number of sequences
                                                                                   (original GRPO)
        "seq-sum-norm" sum of L_t / (number of sequences * max_new_tokens)        (Dr. GRPO)
    token_weights (B, T), optional, multiply the surrogate term per token (e.g. the truncated
    importance weight that corrects for the rollout engine sampling from slightly different
    probabilities than the trainer computes).
    Returns (loss, metrics) with metrics averaged over this batch's valid tokens.
    """
    mask = mask.float()  # (B, T)
    A = advantages[:, None]  # (B, 1)
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    surrogate = torch.min(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)  # (B, T)
    per_token = -surrogate  # (B, T)
    if token_weights is not None:
        per_token = per_token * token_weights  # (B, T)
    kl = None
    if beta != 0.0:
        log_r = ref_logprobs - logprobs  # (B, T)
        kl = torch.exp(log_r) - log_r - 1  # (B, T)
        per_token = per_token + beta * kl

    if loss_agg == "token-mean":
        loss = (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
    elif loss_agg == "seq-mean":
        seq_mean = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B,)
        loss = seq_mean.sum() / (num_tokens or mask.shape[0])
    elif loss_agg == "seq-sum-norm":
        loss = (per_token * mask).sum() / (num_tokens or mask.numel())
    else:
        raise ValueError(f"loss_agg must be token-mean, seq-mean or seq-sum-norm, not {loss_agg!r}")

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped_low = (ratio < 1 - eps_low) & (A < 0)  # gradient cut: ratio already pushed down
        clipped_high = (ratio > 1 + eps_high) & (A > 0)  # gradient cut: ratio already pushed up
        metrics = {"clip_low": float((clipped_low * mask).sum() / n),
                   "clip_high": float((clipped_high * mask).sum() / n),
                   "ratio": float((ratio * mask).sum() / n)}
        if kl is not None:
            metrics["kl"] = float((kl * mask).sum() / n)
    return loss, metrics


def loss_denominator(loss_agg: str, completion_lens: torch.Tensor, max_new_tokens: int) -> float:
    """The global-batch denominator grpo_loss needs for micro-batching to leave the loss unchanged."""
    return {"token-mean": float(completion_lens.sum()),
            "seq-mean": float(len(completion_lens)),
            "seq-sum-norm": float(len(completion_lens) * max_new_tokens)}[loss_agg]


# ---------------------------------------------------------------------------------------------
# The training step: log-probs of a rollout batch under the current policy, loss, backward.


def policy_logprobs(model, batch, idx, cfg, device):
    """Log-probs (and entropy) of micro-batch `idx` of the rollout batch under `model`."""
    input_ids, prompt_lens, completion_lens = (t[idx] for t in batch)
    L = int((prompt_lens + completion_lens).max())  # drop padding columns this micro-batch lacks
    with autocast(device, cfg.bf16):
        return completion_logprobs(model, input_ids[:, :L], prompt_lens, completion_lens,
                                   temperature=cfg.temperature)


def micro_batches(B: int, size: int):
    return [torch.arange(s, min(s + size, B)) for s in range(0, B, size)]


@torch.no_grad()
def frozen_logprobs(model, batch, mbs, cfg, device):
    """Per-micro-batch log-probs under a model we do not train (reference, or the old policy)."""
    return [policy_logprobs(model, batch, idx, cfg, device)[0] for idx in mbs]


def engine_mismatch(trainer_lp, engine_lp, mask) -> dict:
    """How far the rollout engine's log-probs are from the trainer's on the same tokens (sums over
    valid tokens; the caller divides). Large values mean the engine samples from a different policy
    than the one being optimized (bf16 kernels, stale weights, a broken sync)."""
    diff = (trainer_lp - engine_lp) * mask  # (b, T)
    return {"token_mult_prob_error": float((torch.exp(diff.abs()) * mask).sum()),
            "gen_kl_error": float(((torch.exp(diff) - diff - 1) * mask).sum()),  # k3
            "logprob_max_abs_diff": float(diff.abs().max())}


def train_on_rollout(model, ref_model, optimizer, scheduler, batch, advantages, engine_lps, cfg,
                     device):
    """`updates_per_rollout` optimizer steps on one rollout batch. Returns averaged metrics.
    engine_lps (B, T) are the rollout engine's log-probs of the sampled tokens, or None."""
    completion_lens = batch[2]
    denom = loss_denominator(cfg.loss_agg, completion_lens, cfg.max_new_tokens)
    # Without a KL term, a sequence with advantage 0 (e.g. from a zero-std group) adds exactly 0 to
    # the loss and its gradient, so we skip its forward/backward; it still counts in `denom`, which
    # keeps the loss identical. Early in training most groups are all-wrong: this halves step time.
    keep = torch.arange(len(completion_lens), device=advantages.device)
    if cfg.beta == 0.0:
        keep = keep[advantages != 0]
    mbs = [keep[idx] for idx in micro_batches(len(keep), cfg.micro_batch_size)]
    if not mbs:  # nothing to learn from this batch: no optimizer step, say so in the metrics
        return {"loss": 0.0, "grad_norm": 0.0, "trained_frac": 0.0, "trained_tokens": 0}
    # With several updates per rollout the policy drifts from the one that sampled, so pi_old must
    # be frozen before the first update. With one update pi_old == pi_theta: we reuse the current
    # log-probs, detached. The ratio is then exactly 1 but its gradient is not zero --
    # d/dtheta exp(lp - sg(lp)) = grad lp -- so the loss still trains (and its value is ~0).
    old_lps = frozen_logprobs(model, batch, mbs, cfg, device) if cfg.updates_per_rollout > 1 \
        else None
    ref_lps = frozen_logprobs(ref_model, batch, mbs, cfg, device) if ref_model else None
    sums, total_tokens, losses, grad_norms, mismatch = {}, 0, [], [], {}
    for update in range(cfg.updates_per_rollout):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss_value = 0.0
        for k, idx in enumerate(mbs):
            logprobs, entropy = policy_logprobs(model, batch, idx, cfg, device)
            mask = length_mask(completion_lens[idx], logprobs.shape[1])  # (b, T)
            old = old_lps[k] if old_lps else logprobs.detach()
            weights = None
            if engine_lps is not None:
                engine = engine_lps[idx][:, :logprobs.shape[1]]  # (b, T)
                if update == 0:
                    for key, v in engine_mismatch(old, engine, mask).items():
                        agg = max if key.endswith("max_abs_diff") else (lambda a, b: a + b)
                        mismatch[key] = agg(mismatch.get(key, 0.0), v)
                if cfg.is_cap:  # truncated importance sampling: pi_old(trainer) / pi_engine
                    weights = torch.exp(old - engine).clamp(max=cfg.is_cap)
            loss, metrics = grpo_loss(logprobs, old, ref_lps[k] if ref_lps else None,
                                      advantages[idx], mask, eps_low=cfg.eps_low,
                                      eps_high=cfg.eps_high, beta=cfg.beta, loss_agg=cfg.loss_agg,
                                      num_tokens=denom, token_weights=weights)
            loss.backward()  # micro-batch losses add up to the full-batch loss
            loss_value += float(loss)
            tokens = int(mask.sum())
            metrics["entropy"] = float((entropy * mask).sum()) / max(tokens, 1)
            for key, v in metrics.items():  # token-weighted, so they are full-batch means
                sums[key] = sums.get(key, 0.0) + v * tokens
            total_tokens += tokens
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                               cfg.max_grad_norm)))
        optimizer.step()
        scheduler.step()
        losses.append(loss_value)
    out = {k: v / max(total_tokens, 1) for k, v in sums.items()}
    out["loss"] = sum(losses) / len(losses)  # ~0 for on-policy GRPO by construction: not a signal
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["trained_frac"] = len(keep) / len(completion_lens)  # entropy/clip cover these sequences
    out["trained_tokens"] = int((batch[1] + completion_lens)[keep].sum())
    tokens_once = total_tokens / cfg.updates_per_rollout
    for key, v in mismatch.items():
        out[key] = v if key.endswith("max_abs_diff") else v / max(tokens_once, 1)
    return out


# ---------------------------------------------------------------------------------------------
# The loop.


def main(cfg: Config):
    if cfg.template not in TEMPLATES:
        raise SystemExit(f"error: --template {cfg.template!r}; choose from {sorted(TEMPLATES)}")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")  # a new run starts a new log
    (out / "grpo_config.json").write_text(json.dumps(asdict(cfg), indent=2))

    # Data first, so a bad file fails before a minute of model loading.
    eval_rows = []
    if cfg.data == "arith":
        train_rows = arith_stream(cfg.seed)
        eval_rows = arith_heldout(cfg.eval_size)
    else:
        rows = load_rows(cfg.data)
        if not cfg.eval_data and cfg.eval_every:  # hold out the tail of the training file
            n_eval = min(cfg.eval_size, len(rows) // 10)
            rows, eval_rows = rows[:len(rows) - n_eval], rows[len(rows) - n_eval:]
        train_rows = row_stream(rows, cfg.seed)
    if cfg.eval_data:
        eval_rows = load_rows(cfg.eval_data, limit=cfg.eval_size)
    evaluating = bool(cfg.eval_every and eval_rows)
    answer_format = TEMPLATES[cfg.template][1]
    grader = Grader()
    reward_fns = RewardFunctions(cfg.reward, answer_format, grader)

    device = pick_device()
    model, tokenizer = load_model(cfg.model, device)
    rollout = make_rollout(cfg.rollout, model, tokenizer, device=device, seed=cfg.seed,
                           max_new_tokens=cfg.max_new_tokens,
                           gpu_memory_utilization=cfg.gpu_memory_utilization)
    ref_model = None
    if cfg.beta != 0.0:  # a frozen copy of the initial policy, bf16 to halve its memory
        ref_model = make_rollout("hf", model, tokenizer, device=device).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0)
    train_sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p)
    eval_sampling = Sampling(cfg.max_new_tokens, temperature=0.0)
    history = []

    def evaluate_now(step):
        t0 = time.time()
        summary, _ = evaluate_rows(rollout, tokenizer, eval_rows, template=cfg.template,
                                   chat=cfg.chat, sampling=eval_sampling, n=1, grader=grader,
                                   dataset="held-out")
        return {"eval_accuracy": summary["avg@n"], "eval_completion_len": summary["mean_len"],
                "eval_seconds": time.time() - t0}

    def log(record):
        history.append(record)
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    if evaluating:
        record = {"step": 0, **evaluate_now(0)}
        log(record)
        tqdm.write(f"step 0 | held-out accuracy {record['eval_accuracy']:.3f} "
                   f"({len(eval_rows)} problems, greedy)")

    for step in tqdm(range(1, cfg.steps + 1), desc="grpo", unit="step"):
        t_step = time.time()
        # 1. Rollout: G completions for each of N prompts.
        rows = list(islice(train_rows, cfg.prompts_per_step))
        prompt_ids = encode_prompts(tokenizer, rows, cfg.template, cfg.chat)
        train_sampling.seed = cfg.seed * 1_000_003 + step
        t0 = time.time()
        comps = rollout.generate(prompt_ids, cfg.num_generations, train_sampling)
        gen_seconds = time.time() - t0

        # 2. Rewards, and accuracy (correctness) even when it is not part of the reward.
        t0 = time.time()
        group_rows = [r for r in rows for _ in range(cfg.num_generations)]
        problems = [r["problem"] for r in group_rows]
        rewards, per_fn = reward_fns(problems, comps.text, group_rows)
        correct = per_fn.get("correctness") or correctness_reward(
            problems, comps.text, [r["answer"] for r in group_rows],
            answer_format=answer_format, grader=grader)
        reward_seconds = time.time() - t0

        # 3. Advantages: each completion against the rest of its group.
        rewards_t = torch.tensor(rewards)
        advantages = group_advantages(rewards_t, cfg.num_generations, scale=cfg.adv_scale,
                                      leave_one_out=cfg.leave_one_out).to(device)

        # 4. Policy update (reference log-probs first when there is a KL term).
        t0 = time.time()
        batch = pack(comps.prompt_ids, comps.completion_ids, tokenizer.pad_token_id, device)
        engine_lps = None
        if comps.engine_logprobs is not None:
            engine_lps = torch.zeros(len(comps), int(batch[2].max()), device=device)
            for i, row in enumerate(comps.engine_logprobs):
                engine_lps[i, :len(row)] = torch.tensor(row)
        train_metrics = train_on_rollout(model, ref_model, optimizer, scheduler, batch, advantages,
                                         engine_lps, cfg, device)
        train_seconds = time.time() - t0
        sync_seconds = rollout.update_weights(model)

        # 5. Metrics that tell the truth about RL: reward, spread, lengths, clipping, timing.
        lens = batch[2].float()
        gen_tokens = int(lens.sum())
        groups = rewards_t.view(-1, cfg.num_generations)
        record = {
            "step": step,
            "reward": float(rewards_t.mean()), "reward_std": float(rewards_t.std()),
            "accuracy": sum(correct) / len(correct),
            "zero_std_frac": float((groups.std(1) < 1e-6).float().mean()),
            "completion_len": float(lens.mean()), "completion_len_max": int(lens.max()),
            "truncated_frac": sum(comps.truncated) / len(comps),
            **train_metrics,
            "lr": scheduler.get_last_lr()[0],
            "gen_seconds": gen_seconds, "reward_seconds": reward_seconds,
            "train_seconds": train_seconds, "sync_seconds": sync_seconds,
            "gen_tokens_per_s": gen_tokens / gen_seconds,
            "train_tokens_per_s": train_metrics["trained_tokens"] / max(train_seconds, 1e-9),
            "reward_errors": reward_fns.errors, "grader_timeouts": grader.timeouts,
        }
        for name, scores in per_fn.items():
            if len(per_fn) > 1:
                record[f"reward_{name}"] = sum(scores) / len(scores)
        record["step_seconds"] = time.time() - t_step
        if evaluating and (step % cfg.eval_every == 0 or step == cfg.steps):
            record.update(evaluate_now(step))
        log(record)
        tqdm.write(format_line(record))
        if cfg.log_samples_every and step % cfg.log_samples_every == 0:
            for i in range(0, len(comps), max(1, len(comps) // 2))[:2]:
                tqdm.write(f"  sample (reward {rewards[i]:.2f}, answer {group_rows[i]['answer']}): "
                           f"{comps.text[i]!r}")

    grader.close()
    save_model(model, tokenizer, out)
    plot_curves(history, out / "curves.png", title=f"GRPO on {cfg.data} ({cfg.model})")
    print(f"saved the model, metrics.jsonl and curves.png in {out}/")
    return history


def format_line(r: dict) -> str:
    line = (f"step {r['step']:4d} | reward {r['reward']:.3f} acc {r['accuracy']:.3f} "
            f"zero-std {r['zero_std_frac']:.2f} | len {r['completion_len']:.1f} "
            f"trunc {r['truncated_frac']:.2f} | gnorm {r['grad_norm']:.3f}")
    if "entropy" in r:
        line += f" ent {r['entropy']:.3f} clip {r['clip_low'] + r['clip_high']:.3f}"
    if "kl" in r:
        line += f" kl {r['kl']:.4f}"
    line += (f" | gen {r['gen_seconds']:.1f}s train {r['train_seconds']:.1f}s "
             f"({r['gen_tokens_per_s']:.0f} tok/s gen)")
    if "eval_accuracy" in r:
        line += f" | held-out {r['eval_accuracy']:.3f}"
    return line


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__.split("\n")[0]))

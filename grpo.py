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
    python grpo.py --model Qwen/Qwen2.5-Math-1.5B --rollout vllm --template boxed \\
        --data agentica-org/DeepScaleR-Preview-Dataset --eval-data HuggingFaceH4/MATH-500 \\
        --max-new-tokens 1024                  # one GPU: train on a training set, test on MATH-500
    python grpo.py --num-trainers 2 --num-engines 1 --colocate    # Ray processes: distributed.py
"""

import copy
import functools
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from data import TEMPLATES, Template, arith_heldout, arith_stream, check, encode_prompts, flag
from data import load_rows, parse_config, row_stream
from evaluate import evaluate_rows, plot_curves
from model import DEFAULT_MODEL, autocast, completion_logprobs, length_mask, load_model, pack
from model import adamw_with_warmup, check_head_logits, full_optimizer_state, full_state_dict
from model import load_optimizer_state, load_state, pick_device, right_pad, save_model, shard_model
from reward import Grader, RewardFunctions, correctness_reward
from rollout import Completions, Sampling, make_rollout


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
    template: Template = "answer-is"
    """prompt template from data.TEMPLATES: answer-is, boxed, raw"""
    chat: bool = True
    """wrap prompts in the model's chat template (turn off for base models)"""
    reward: str = "correctness"
    """reward functions, comma-separated `name=weight`: correctness, format, or module:function"""
    rollout: Literal["hf", "vllm"] = "hf"
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
    """must stay 1: the trainer's log-probs describe the full distribution (see __post_init__)"""
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
    loss_agg: Literal["auto", "token-mean", "seq-mean", "seq-sum-norm"] = "auto"
    """token-mean (DAPO), seq-mean (original GRPO), seq-sum-norm (Dr. GRPO); auto: token-mean, or
    seq-mean with --ratio-level sequence (GSPO's objective is a mean over sequences)"""
    adv_scale: Literal["group", "batch", "none"] = "group"
    """advantage scaling: group (GRPO), batch, none (Dr. GRPO)"""
    leave_one_out: bool = False
    """baseline = mean of the *other* samples of the group (RLOO)"""
    updates_per_rollout: int = 1
    """optimizer steps per rollout batch; >1 makes the ratio and the clipping matter"""
    micro_batch_size: int = 16
    """sequences per forward/backward; gradients accumulate over the batch"""
    num_trainers: int = 1
    """data-parallel trainer processes (>1, or --num-engines >1, runs on Ray: distributed.py)"""
    num_engines: int = 1
    """rollout engines; prompts are sharded across them"""
    colocate: bool = False
    """Ray: engines share the trainers' GPUs/CPUs instead of getting their own"""
    ray_address: str = ""
    """Ray: an existing cluster's address ("auto" on one of its nodes), or "local" to start one"""
    fsdp: bool = False
    """Ray, GPU: shard the model over the trainers with FSDP2 (for models that don't fit one GPU)"""
    ratio_level: Literal["token", "sequence"] = "token"
    """token (GRPO/PPO) or sequence (GSPO: length-normalised sequence ratio, seq_eps clip range)"""
    seq_eps_low: float = 3e-4
    """GSPO lower clip range of the sequence ratio"""
    seq_eps_high: float = 4e-4
    """GSPO upper clip range of the sequence ratio"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, sample more prompts to refill the batch"""
    max_fill_rounds: int = 3
    """dynamic sampling: extra rollout rounds per step at most (then train on what there is)"""
    overlong_filter: bool = False
    """DAPO: truncated samples get zero loss weight (they still count in their group's baseline)"""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty: reward falls linearly to -1 over the last N tokens (0 = off)"""
    require_think_close: bool = False
    """reasoning models: grade only the text after </think>; no </think> means reward 0"""
    max_tokens_per_microbatch: int = 0
    """micro-batches by token budget (padded tokens), sequences sorted by length (0 = by count)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward: less memory for long responses, ~30 % more compute"""
    save_every: int = 0
    """write <out>/checkpoints/step_N every N steps (0 = never)"""
    keep_last: int = 2
    """checkpoints kept (the oldest are deleted); 0 keeps all"""
    resume: str = ""
    """continue a run exactly: `auto` (latest checkpoint in --out) or a checkpoint folder"""
    init_from: str = ""
    """start a new run (fresh optimizer, step 0) from a checkpoint's or HF folder's weights"""
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

    def __post_init__(self):  # impossible values stop here, before anything loads
        check(self.num_generations >= 2, f"--num-generations {self.num_generations}: a group needs "
              f"at least 2 samples, or it has no baseline to be better than")
        for name in ("prompts_per_step", "max_new_tokens", "updates_per_rollout",
                     "micro_batch_size", "num_trainers", "num_engines"):
            check(getattr(self, name) >= 1, f"{flag(name)} must be at least 1")
        for name in ("steps", "warmup_steps", "max_fill_rounds", "overlong_buffer",
                     "max_tokens_per_microbatch", "save_every", "keep_last", "eval_every",
                     "log_samples_every", "lr", "weight_decay", "beta", "is_cap"):
            check(getattr(self, name) >= 0, f"{flag(name)} must not be negative")
        check(self.temperature > 0, f"--temperature {self.temperature}: training rollouts must "
              f"sample (the log-probs are divided by the temperature); greedy is for evaluation")
        # With top-p the engine samples from the nucleus, renormalised; the trainer's log-probs
        # describe the whole distribution, so every importance weight would sit below 1.
        check(self.top_p == 1.0, f"--top-p {self.top_p}: training rollouts sample from the full "
              f"distribution that the trainer's log-probs describe (top-p would renormalise over "
              f"the nucleus, which the trainer does not see); use top-p in evaluate.py")
        check(0 <= self.eps_low < 1 and self.eps_high >= 0, f"--eps-low {self.eps_low} "
              f"--eps-high {self.eps_high}: need 0 <= eps-low < 1 and eps-high >= 0")
        check(0 <= self.seq_eps_low < 1 and self.seq_eps_high >= 0, "--seq-eps-low must be in "
              "[0, 1) and --seq-eps-high at least 0")
        check(self.max_grad_norm > 0, "--max-grad-norm must be positive")
        check(0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]")
        check(self.overlong_buffer <= self.max_new_tokens, f"--overlong-buffer "
              f"{self.overlong_buffer} is longer than --max-new-tokens {self.max_new_tokens}")
        check(not (self.resume and self.init_from), "--resume continues a run, --init-from starts "
              "a new one from other weights: give one of them")
        check(not self.fsdp or self.num_trainers > 1, "--fsdp shards the model over several "
              "trainers: use it with --num-trainers N, N > 1")
        # GSPO's objective is (1/G) sum_i min(s_i A_i, clip(s_i) A_i): a mean over sequences. Any
        # other aggregation sums a sequence's |y_i| identical terms and weighs long answers more.
        if self.loss_agg == "auto":
            self.loss_agg = "seq-mean" if self.ratio_level == "sequence" else "token-mean"
        check(self.ratio_level == "token" or self.loss_agg == "seq-mean", f"--ratio-level sequence "
              f"(GSPO) averages over sequences: --loss-agg {self.loss_agg} contradicts it; "
              f"leave --loss-agg out or pass seq-mean")


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
              eps_high=0.2, beta=0.0, loss_agg="token-mean", num_tokens=None, token_weights=None,
              ratio_level="token"):
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
    ratio_level="sequence" is GSPO: every token of sequence i uses the length-normalised sequence
    ratio s_i = exp(mean_t(logprobs - old_logprobs)) (pass GSPO's much smaller eps values), and the
    objective (1/G) sum_i min(s_i A_i, clip(s_i) A_i) is a mean over sequences: only "seq-mean"
    aggregates it so (summing a sequence's |y_i| equal terms would cancel s_i's 1/|y_i|).
    token_weights (B, T), optional, multiply the surrogate term per token (e.g. the truncated
    importance weight that corrects for the rollout engine sampling from slightly different
    probabilities than the trainer computes).
    Returns (loss, metrics) with metrics averaged over this batch's valid tokens.
    """
    mask = mask.float()  # (B, T)
    A = advantages[:, None]  # (B, 1)
    log_ratio = logprobs - old_logprobs  # (B, T)
    if ratio_level == "sequence":  # GSPO: one ratio per sequence, broadcast to its tokens
        seq = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        log_ratio = seq.expand_as(log_ratio)  # (B, T); gradient flows to every token of i
        if loss_agg != "seq-mean":
            raise ValueError(f"ratio_level='sequence' (GSPO) needs loss_agg='seq-mean', not "
                             f"{loss_agg!r}")
    elif ratio_level != "token":
        raise ValueError(f"ratio_level must be token or sequence, not {ratio_level!r}")
    ratio = torch.exp(log_ratio)  # (B, T)
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
    sequences = float((completion_lens > 0).sum())  # overlong-filtered samples have length 0
    return {"token-mean": float(completion_lens.sum()),
            "seq-mean": sequences,
            "seq-sum-norm": sequences * max_new_tokens}[loss_agg]


# ---------------------------------------------------------------------------------------------
# The training step: log-probs of a rollout batch under the current policy, loss, backward.


@dataclass
class TrainBatch:
    """One step's rollout as the trainers see it (under Ray, each gets a contiguous shard)."""
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    prompt_lens: torch.Tensor  # (B,)
    completion_lens: torch.Tensor  # (B,) sampled tokens, the stop token included
    advantages: torch.Tensor  # (B,)
    in_loss: torch.Tensor  # (B,) bool; False: no loss weight (overlong filtering), still sampled
    engine_logprobs: torch.Tensor | None  # (B, T) the engine's log-prob of each sampled token
    denom: float  # grpo_loss's denominator for the *global* batch (see loss_denominator)

    def select(self, idx) -> "TrainBatch":
        """Rows `idx` (a slice, or an index tensor), on their current device."""
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return TrainBatch(pick(self.input_ids), pick(self.prompt_lens),
                          pick(self.completion_lens), pick(self.advantages), pick(self.in_loss),
                          pick(self.engine_logprobs), self.denom)

    def to(self, device) -> "TrainBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(move(self.input_ids), move(self.prompt_lens),
                          move(self.completion_lens), move(self.advantages), move(self.in_loss),
                          move(self.engine_logprobs), self.denom)


def train_batch(comps: Completions, advantages, cfg: Config, pad_id: int) -> TrainBatch:
    """Pack scored completions for the trainers. Masks come from lengths; with overlong filtering
    a truncated sample is out of the loss (it still counted in its group's baseline)."""
    input_ids, prompt_lens, completion_lens = pack(comps.prompt_ids, comps.completion_ids, pad_id)
    in_loss = torch.ones(len(comps), dtype=torch.bool)
    if cfg.overlong_filter:
        in_loss = ~torch.tensor(comps.truncated)
    engine_lps = None
    if comps.engine_logprobs is not None:
        engine_lps = right_pad(comps.engine_logprobs, 0.0, torch.float32)  # (B, T)
    denom = loss_denominator(cfg.loss_agg, completion_lens * in_loss, cfg.max_new_tokens)
    return TrainBatch(input_ids, prompt_lens, completion_lens, advantages, in_loss, engine_lps,
                      denom)


def policy_logprobs(model, batch: TrainBatch, idx, cfg, device):
    """Log-probs (and entropy) of micro-batch `idx` of the rollout batch under `model`."""
    mb = batch.select(idx)
    L = int((mb.prompt_lens + mb.completion_lens).max())  # drop padding columns it does not need
    # An FSDP-sharded model carries completion_logprobs as a registered forward (shard_model).
    logprobs_of = getattr(model, "completion_logprobs", functools.partial(completion_logprobs, model))
    with autocast(device, cfg.bf16):
        return logprobs_of(mb.input_ids[:, :L], mb.prompt_lens, mb.completion_lens,
                           temperature=cfg.temperature)


def micro_batches(keep, seq_lens, cfg):
    """Index tensors of the micro-batches over sequences `keep`. By count (micro_batch_size), or
    with max_tokens_per_microbatch by padded tokens: sorted by length, so little is padding."""
    if not cfg.max_tokens_per_microbatch:
        return [keep[s:s + cfg.micro_batch_size] for s in range(0, len(keep), cfg.micro_batch_size)]
    order = keep[torch.argsort(seq_lens[keep], descending=True)]
    out, current = [], []
    for i in order.tolist():  # longest first: a micro-batch is padded to its first sequence
        if current and (len(current) + 1) * int(seq_lens[current[0]]) > cfg.max_tokens_per_microbatch:
            out.append(torch.tensor(current, device=keep.device))
            current = []
        current.append(i)
    return out + ([torch.tensor(current, device=keep.device)] if current else [])


def same_pass_count(mbs: list, trainer: "Trainer") -> tuple[list, int]:
    """FSDP2 gathers each layer's parameters from every rank in every forward and backward, so all
    ranks must run the same number of passes: pad the shorter lists with passes over sequence 0
    whose loss is multiplied by 0. Returns (micro-batches, how many of them are real)."""
    real = len(mbs)
    if not trainer.sharded:
        return mbs, real
    most = int(_all_reduce(torch.tensor(real, device=trainer.device), trainer.group,
                           dist.ReduceOp.MAX))
    return mbs + [torch.zeros(1, dtype=torch.long, device=trainer.device)] * (most - real), real


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
            "logprob_max_abs_diff": float(diff.abs().max()),
            "mismatch_tokens": int(mask.sum())}


def _add_mismatch(total: dict, part: dict):
    for key, v in part.items():
        total[key] = max(total.get(key, 0.0), v) if key.endswith("max_abs_diff") \
            else total.get(key, 0) + v


@dataclass
class Trainer:
    """What one training process holds. One of them in a plain run; one per rank under Ray."""
    model: torch.nn.Module
    tokenizer: object
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: object
    cfg: Config
    device: str
    group: object = None  # the trainers' data-parallel process group; None for one trainer

    @property
    def sharded(self) -> bool:  # FSDP2 over the trainers
        return self.cfg.fsdp and self.group is not None


def setup_trainer(cfg: Config, resume_dir: str = "", group=None) -> Trainer:
    """Model, optimizer and schedule of one training process: from --model, from --init-from's
    weights, or (resume_dir) from a checkpoint with its optimizer and schedule state. group: the
    trainers' data-parallel process group (distributed.py passes it), None for one trainer -- never
    whatever torch.distributed happens to hold (vLLM's in-process engine sets up a group of its
    own, one rank, in this very process)."""
    torch.manual_seed(cfg.seed)
    device = pick_device()
    start = cfg.init_from or cfg.model
    model, tokenizer = load_model(resume_dir or start, device)
    check_head_logits(model)
    ref_model = None
    if cfg.beta != 0.0:  # a frozen copy of the *initial* policy
        # In the policy's precision scheme (fp32 weights, bf16 autocast), not pure bf16: then
        # KL(pi || ref) is exactly 0 before the first update instead of bf16 noise with a gradient.
        ref_model = load_model(start, device)[0] if resume_dir else copy.deepcopy(model)
        ref_model = ref_model.eval()  # not in the optimizer; run under no_grad
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.fsdp and group is not None:
        # Models too large for one GPU: shard parameters, gradients and optimizer state over the
        # ranks (FSDP2). Its gradient reduction *averages* over ranks, so train_on_rollout scales
        # the loss by the world size to keep the sum-over-global-batch convention.
        shard_model(model)
        if ref_model is not None:
            shard_model(ref_model)
    optimizer, scheduler = adamw_with_warmup(model, cfg.lr, cfg.warmup_steps, cfg.weight_decay,
                                             betas=(0.9, 0.99))
    trainer = Trainer(model, tokenizer, ref_model, optimizer, scheduler, cfg, device, group)
    if resume_dir:
        state = load_state(Path(resume_dir) / "trainer_state.pt")
        load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
    return trainer


def save_trainer_state(trainer: Trainer, folder: str):
    """The trainer's half of a checkpoint: HF-format model, optimizer, schedule, RNG. Run on every
    rank (under FSDP the full tensors are gathered from all of them); rank 0 writes."""
    weights = full_state_dict(trainer.model)
    optimizer = full_optimizer_state(trainer.model, trainer.optimizer)
    if trainer.group is None or dist.get_rank() == 0:
        save_model(trainer.model, trainer.tokenizer, folder, weights)
        torch.save({"optimizer": optimizer, "scheduler": trainer.scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state()}, Path(folder) / "trainer_state.pt")


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def train_on_rollout(trainer: Trainer, batch: TrainBatch) -> dict:
    """`updates_per_rollout` optimizer steps on (this rank's shard of) one rollout batch.

    Returns raw sums, combined over ranks by finish_metrics: every rank's loss is its share of one
    global loss (batch.denom counts the global batch).
    """
    cfg, model, device, group = trainer.cfg, trainer.model, trainer.device, trainer.group
    batch = batch.to(device)
    lens = batch.completion_lens
    world = dist.get_world_size(group) if group is not None else 1
    # Without a KL term, a sequence with advantage 0 (e.g. from a zero-std group) adds exactly 0 to
    # the loss and its gradient, so we skip its forward/backward; it still counts in `denom`, which
    # keeps the loss identical. Early in training most groups are all-wrong: this halves step time.
    # (Under FSDP every rank trains all its sequences, so the ranks' passes line up.)
    trained = batch.in_loss & (lens > 0)
    if cfg.beta == 0.0 and not trainer.sharded:
        trained &= batch.advantages != 0
    keep = trained.nonzero().flatten()
    mbs, real = same_pass_count(micro_batches(keep, batch.prompt_lens + lens, cfg), trainer)
    raw = {"sums": {}, "tokens": 0, "mismatch": {}, "loss": 0.0, "grad_norm": 0.0,
           "skipped_updates": 0, "trained_seqs": len(keep), "seqs": len(lens),
           "trained_tokens": int((batch.prompt_lens + lens)[keep].sum()),
           "lr": trainer.scheduler.get_last_lr()[0]}
    if batch.engine_logprobs is not None:
        # The mismatch metrics describe the engine, so they cover every sampled token: those of
        # trained sequences come from the update below, the others from a no-grad pass here.
        rest = (~trained & (lens > 0)).nonzero().flatten()
        rest_mbs, rest_real = same_pass_count(micro_batches(rest, batch.prompt_lens + lens, cfg),
                                              trainer)
        for k, (idx, lp) in enumerate(zip(rest_mbs, frozen_logprobs(model, batch, rest_mbs, cfg,
                                                                    device))):
            if k < rest_real:
                mask = length_mask(lens[idx], lp.shape[1])
                _add_mismatch(raw["mismatch"], engine_mismatch(
                    lp, batch.engine_logprobs[idx][:, :lp.shape[1]], mask))
    # Every rank must agree on whether to step: a rank with nothing to train still joins the
    # gradient all-reduce; if no rank has anything, nobody steps (Adam would move on zero grads).
    if int(_all_reduce(torch.tensor(len(keep), device=device), group)) == 0:
        return raw
    # With several updates per rollout the policy drifts from the one that sampled, so pi_old must
    # be frozen before the first update. With one update pi_old == pi_theta: we reuse the current
    # log-probs, detached. The ratio is then exactly 1 but its gradient is not zero --
    # d/dtheta exp(lp - sg(lp)) = grad lp -- so the loss still trains (and its value is ~0).
    old_lps = frozen_logprobs(model, batch, mbs, cfg, device) if cfg.updates_per_rollout > 1 \
        else None
    ref_lps = frozen_logprobs(trainer.ref_model, batch, mbs, cfg, device) \
        if trainer.ref_model is not None else None
    seq_level = cfg.ratio_level == "sequence"
    for update in range(cfg.updates_per_rollout):
        model.train()
        update_loss, update_sums, update_tokens = 0.0, {}, 0
        for k, idx in enumerate(mbs):
            logprobs, entropy = policy_logprobs(model, batch, idx, cfg, device)
            mask = length_mask(lens[idx], logprobs.shape[1])  # (b, T)
            old = old_lps[k] if old_lps else logprobs.detach()
            weights = None
            if batch.engine_logprobs is not None:
                engine = batch.engine_logprobs[idx][:, :logprobs.shape[1]]  # (b, T)
                if update == 0 and k < real:
                    _add_mismatch(raw["mismatch"], engine_mismatch(old, engine, mask))
                if cfg.is_cap:  # truncated importance sampling: pi_old(trainer) / pi_engine
                    weights = torch.exp(old - engine).clamp(max=cfg.is_cap)
            loss, metrics = grpo_loss(logprobs, old, ref_lps[k] if ref_lps else None,
                                      batch.advantages[idx], mask,
                                      eps_low=cfg.seq_eps_low if seq_level else cfg.eps_low,
                                      eps_high=cfg.seq_eps_high if seq_level else cfg.eps_high,
                                      beta=cfg.beta, loss_agg=cfg.loss_agg,
                                      num_tokens=batch.denom, token_weights=weights,
                                      ratio_level=cfg.ratio_level)
            if k >= real:  # an FSDP padding pass: it only keeps the ranks in step
                (loss * 0.0).backward()
                continue
            (loss * world if trainer.sharded else loss).backward()  # micro-batch losses add up
            update_loss += float(loss.detach())
            tokens = int(mask.sum())
            metrics["entropy_trained"] = float((entropy * mask).sum()) / max(tokens, 1)
            for key, v in metrics.items():  # token-weighted, so they become full-batch means
                update_sums[key] = update_sums.get(key, 0.0) + v * tokens
            update_tokens += tokens
        if group is not None and not trainer.sharded:
            for p in model.parameters():  # data parallel: the global gradient is the sum
                if p.grad is None:  # a rank that had no sequence to train this step
                    p.grad = torch.zeros_like(p)
                _all_reduce(p.grad, group)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                          else grad_norm)
        # A non-finite loss or gradient would poison the weights (and every checkpoint after):
        # skip the update; main stops the run after a few in a row. grad_norm is all-reduced, so
        # every rank decides alike.
        if not (math.isfinite(grad_norm) and math.isfinite(update_loss)):
            trainer.optimizer.zero_grad(set_to_none=True)
            raw["skipped_updates"] += 1
            continue
        trainer.optimizer.step()
        trainer.scheduler.step()
        # Free the gradients now, not at the next step: a colocated engine generates in between.
        trainer.optimizer.zero_grad(set_to_none=True)
        raw["loss"] += update_loss / cfg.updates_per_rollout
        raw["grad_norm"] += grad_norm / cfg.updates_per_rollout
        for key, v in update_sums.items():
            raw["sums"][key] = raw["sums"].get(key, 0.0) + v
        raw["tokens"] += update_tokens
    raw["peak_memory_gb"] = peak_memory_gb(device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # hand the training peak's cached blocks back for the engine
        raw["resident_memory_gb"] = torch.cuda.memory_allocated() / 2**30  # kept between steps
    return raw


def peak_memory_gb(device: str) -> float:
    """Peak memory of this process: GPU memory allocated by PyTorch, or resident host memory."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def finish_metrics(raws: list[dict]) -> dict:
    """Combine the raw sums of one or more ranks into the step's metrics."""
    tokens = sum(r["tokens"] for r in raws)
    out = {}
    for r in raws:
        for key, v in r["sums"].items():
            out[key] = out.get(key, 0.0) + v / max(tokens, 1)
    out["loss"] = sum(r["loss"] for r in raws)  # each rank holds its share of the global loss
    out["grad_norm"] = raws[0]["grad_norm"]  # all-reduced: the same on every rank
    out["skipped_updates"] = max(r["skipped_updates"] for r in raws)
    out["trained_frac"] = sum(r["trained_seqs"] for r in raws) / sum(r["seqs"] for r in raws)
    out["trained_tokens"] = sum(r["trained_tokens"] for r in raws)
    out["lr"] = raws[0]["lr"]
    out["peak_memory_gb"] = max(r.get("peak_memory_gb", 0.0) for r in raws)  # of any one rank
    if "resident_memory_gb" in raws[0]:
        out["resident_memory_gb"] = max(r["resident_memory_gb"] for r in raws)
    mismatch = {}
    for r in raws:
        _add_mismatch(mismatch, r["mismatch"])
    n = mismatch.pop("mismatch_tokens", 0)
    for key, v in mismatch.items():
        out[key] = v if key.endswith("max_abs_diff") else v / max(n, 1)
    return out


# ---------------------------------------------------------------------------------------------
# The loop.


def has_signal(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """(N,) True for groups whose rewards are not all equal: only those have non-zero advantages."""
    return rewards.view(-1, G).std(1) > 1e-6


def groups_with_signal(rounds, G: int, limit: int):
    """Dynamic sampling: from scored rounds (rows, completions, rewards, ...), the first `limit`
    groups that have signal, as (rows, completions, rewards), and how many groups were dropped."""
    rows, parts, rewards, dropped = [], [], [], 0
    for round_rows, comps, round_rewards, *_ in rounds:
        signal = has_signal(round_rewards, G)
        dropped += int((~signal).sum())
        for i in signal.nonzero().flatten().tolist()[:limit - len(parts)]:
            samples = list(range(i * G, (i + 1) * G))
            rows += [round_rows[k] for k in samples]
            parts.append(comps.select(samples))
            rewards.append(round_rewards[i * G:(i + 1) * G])
    if not parts:
        return [], rounds[0][1].select([]), torch.zeros(0), dropped
    return rows, Completions.concat(parts), torch.cat(rewards), dropped


def overlong_penalty(lengths: list[int], max_new_tokens: int, buffer: int) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer, then falling linearly to
    -1 at max_new_tokens."""
    start = max_new_tokens - buffer
    return [0.0 if n <= start else -min(1.0, (n - start) / buffer) for n in lengths]


MAX_BAD_STEPS = 3  # non-finite updates in a row before the run stops


def main(cfg: Config):
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resume_dir = find_checkpoint(out, cfg.resume) if cfg.resume else ""
    G = cfg.num_generations

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
    reward_fns = RewardFunctions(cfg.reward, answer_format, grader, cfg.require_think_close)

    if cfg.num_trainers == 1 and cfg.num_engines == 1 and not cfg.ray_address:
        # One process: the trainer and the rollout engine live here.
        trainer = setup_trainer(cfg, resume_dir)
        tokenizer = trainer.tokenizer
        rollout = make_rollout(cfg.rollout, trainer.model, tokenizer, device=trainer.device,
                               seed=cfg.seed, max_new_tokens=cfg.max_new_tokens,
                               gpu_memory_utilization=cfg.gpu_memory_utilization)

        def train(batch):
            return finish_metrics([train_on_rollout(trainer, batch)])

        def sync_weights():
            return rollout.update_weights(trainer.model)

        def save(folder):
            save_trainer_state(trainer, folder)
    else:
        # Ray: the same functions, run by trainer and engine workers (see distributed.py).
        tokenizer, rollout, train, sync_weights, save = launch_on_ray(cfg, resume_dir)
    train_sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p)
    eval_sampling = Sampling(cfg.max_new_tokens, temperature=0.0)

    # A resumed run picks up its step, data position, RNG and metrics where the checkpoint left them.
    first_step, consumed, history = 1, 0, []
    bad_steps = 0  # steps in a row whose update was skipped (non-finite loss or gradient)
    if resume_dir:
        state = load_state(Path(resume_dir) / "driver_state.pt")
        first_step, consumed = state["step"] + 1, state["consumed"]
        random.setstate(state["python_rng"])
        kind, keys, *rest = state["numpy_rng"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
        history = [json.loads(line) for line in
                   (Path(resume_dir) / "metrics.jsonl").read_text().splitlines()]
        train_rows = islice(train_rows, consumed, None)  # the same stream, fast-forwarded
        print(f"resuming from {resume_dir} at step {first_step}")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    (out / "grpo_config.json").write_text(json.dumps(asdict(cfg), indent=2))

    def evaluate_now():
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

    def rollout_and_score(step, attempt):
        """N new prompts -> G scored completions each: (rows, completions, rewards, correct,
        per-function scores)."""
        nonlocal consumed
        rows = list(islice(train_rows, cfg.prompts_per_step))
        consumed += len(rows)
        train_sampling.seed = (cfg.seed * 1_000_003 + step) * 16 + attempt
        t0 = time.time()
        comps = rollout.generate(encode_prompts(tokenizer, rows, cfg.template, cfg.chat), G,
                                 train_sampling)
        timers["gen"] += time.time() - t0
        t0 = time.time()
        group_rows = [r for r in rows for _ in range(G)]
        problems = [r["problem"] for r in group_rows]
        rewards, per_fn = reward_fns(problems, comps.text, group_rows)
        correct = per_fn.get("correctness") or correctness_reward(
            problems, comps.text, [r["answer"] for r in group_rows],
            answer_format=answer_format, grader=grader)
        if cfg.overlong_buffer:
            penalty = overlong_penalty([len(c) for c in comps.completion_ids], cfg.max_new_tokens,
                                       cfg.overlong_buffer)
            rewards = [r + p for r, p in zip(rewards, penalty)]
        timers["reward"] += time.time() - t0
        return group_rows, comps, torch.tensor(rewards), correct, per_fn

    if evaluating and first_step == 1:
        record = {"step": 0, **evaluate_now()}
        log(record)
        tqdm.write(f"step 0 | held-out accuracy {record['eval_accuracy']:.3f} "
                   f"({len(eval_rows)} problems, greedy)")

    for step in tqdm(range(first_step, cfg.steps + 1), desc="grpo", unit="step",
                     initial=first_step - 1, total=cfg.steps):
        t_step = time.time()
        timers = {"gen": 0.0, "reward": 0.0}
        # 1. Rollout: G completions for each of N prompts; 2. rewards (and accuracy, always).
        rounds = [rollout_and_score(step, 0)]
        group_rows, comps, rewards_t, _, per_fn = rounds[0]
        # Dynamic sampling (DAPO): groups with zero reward spread carry no signal; drop them and
        # sample fresh prompts until N groups have some, for at most max_fill_rounds more rounds.
        dropped = 0
        if cfg.dynamic_sampling:
            while (sum(int(has_signal(r[2], G).sum()) for r in rounds) < cfg.prompts_per_step
                   and len(rounds) <= cfg.max_fill_rounds):
                rounds.append(rollout_and_score(step, len(rounds)))
            group_rows, comps, rewards_t, dropped = groups_with_signal(rounds, G,
                                                                       cfg.prompts_per_step)

        # 3. Advantages: each completion against the rest of its group.
        train_metrics = {"loss": 0.0, "grad_norm": 0.0, "trained_frac": 0.0, "trained_tokens": 0,
                         "skipped_updates": 0}
        t0 = time.time()
        if len(comps):
            advantages = group_advantages(rewards_t, G, scale=cfg.adv_scale,
                                          leave_one_out=cfg.leave_one_out)
            # 4. Policy update on the packed batch (masks come from lengths).
            train_metrics = train(train_batch(comps, advantages, cfg, tokenizer.pad_token_id))
        train_seconds = time.time() - t0
        bad_steps = bad_steps + 1 if train_metrics["skipped_updates"] else 0
        if train_metrics["skipped_updates"]:
            tqdm.write(f"step {step}: the loss or the gradient was not finite; update skipped, "
                       f"weights unchanged ({bad_steps} in a row)")
        if bad_steps >= MAX_BAD_STEPS:
            raise SystemExit(f"error: {bad_steps} steps in a row had a non-finite loss or gradient "
                             f"(lr {cfg.lr}, rewards of this step: {rewards_t.tolist()[:8]}...); "
                             f"stopping with the last good weights untouched. Lower --lr or check "
                             f"the reward functions; --resume from the last checkpoint.")
        sync_seconds = sync_weights()

        # 5. Metrics that tell the truth about RL, over everything sampled this step.
        all_rewards = torch.cat([r[2] for r in rounds])
        all_correct = [c for r in rounds for c in r[3]]
        all_comps = Completions.concat([r[1] for r in rounds])
        lens = torch.tensor([len(c) for c in all_comps.completion_ids], dtype=torch.float)
        record = {
            "step": step,
            "reward": float(all_rewards.mean()), "reward_std": float(all_rewards.std()),
            "accuracy": sum(all_correct) / len(all_correct),
            "zero_std_frac": float((~has_signal(all_rewards, G)).float().mean()),
            "completion_len": float(lens.mean()), "completion_len_max": int(lens.max()),
            "truncated_frac": sum(all_comps.truncated) / len(all_comps),
            **train_metrics,
            "gen_seconds": timers["gen"], "reward_seconds": timers["reward"],
            "train_seconds": train_seconds, "sync_seconds": sync_seconds,
            "gen_tokens_per_s": float(lens.sum()) / timers["gen"],
            "train_tokens_per_s": train_metrics["trained_tokens"] / max(train_seconds, 1e-9),
            "reward_errors": reward_fns.errors, "grader_timeouts": grader.timeouts,
        }
        if cfg.dynamic_sampling:
            record.update(dropped_groups=dropped, fill_rounds=len(rounds) - 1,
                          kept_groups=len(comps) // G)
        for name, scores in per_fn.items():
            if len(per_fn) > 1:
                record[f"reward_{name}"] = sum(scores) / len(scores)
        record["step_seconds"] = time.time() - t_step
        if evaluating and (step % cfg.eval_every == 0 or step == cfg.steps):
            record.update(evaluate_now())
        log(record)
        tqdm.write(format_line(record))
        if cfg.log_samples_every and step % cfg.log_samples_every == 0 and len(comps):
            for i in range(0, len(comps), max(1, len(comps) // 2))[:2]:
                tqdm.write(f"  sample (reward {float(rewards_t[i]):.2f}, answer "
                           f"{group_rows[i]['answer']}): {comps.text[i]!r}")
        if cfg.save_every and step % cfg.save_every == 0 and not bad_steps:
            save_checkpoint(out, step, save, consumed, cfg.keep_last)

    grader.close()
    save(str(out))
    plot_curves(history, out / "curves.png", title=f"GRPO on {cfg.data} ({cfg.model})")
    print(f"saved the model, metrics.jsonl and curves.png in {out}/")
    return history


# ---------------------------------------------------------------------------------------------
# Checkpoints: written to a temporary folder and renamed into place, so a kill -9 during a save
# leaves the previous checkpoint whole.


def save_checkpoint(out: Path, step: int, save_trainer, consumed: int, keep_last: int):
    folder = out / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_trainer(str(tmp))  # model (HF format), optimizer, LR schedule, torch RNG
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # as lists: loadable weights-only
    torch.save({"step": step, "consumed": consumed, "python_rng": random.getstate(),
                "numpy_rng": [kind, keys.tolist(), pos, has_gauss, gauss]},
               tmp / "driver_state.pt")
    shutil.copy(out / "metrics.jsonl", tmp / "metrics.jsonl")
    shutil.copy(out / "grpo_config.json", tmp / "grpo_config.json")
    final = folder / f"step_{step}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # atomic: the checkpoint exists whole, or not at all
    if keep_last:  # 0 keeps every checkpoint
        for old in sorted(_checkpoints(folder), key=_step_of)[:-keep_last]:
            shutil.rmtree(old)


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _checkpoints(folder: Path) -> list[Path]:
    return [p for p in folder.glob("step_*") if (p / "driver_state.pt").exists()]


def find_checkpoint(out: Path, resume: str) -> str:
    """--resume auto: the newest complete checkpoint in <out>/checkpoints; or the folder given.
    Its files are checked here, before any model loads, so a damaged one is named at once."""
    if resume != "auto":
        if not (Path(resume) / "driver_state.pt").exists():
            raise SystemExit(f"error: --resume {resume}: not a checkpoint folder (no driver_state.pt)")
        folder = Path(resume)
    else:
        found = _checkpoints(out / "checkpoints")
        if not found:
            raise SystemExit(f"error: --resume auto: no checkpoint in {out / 'checkpoints'}")
        folder = max(found, key=_step_of)
    for name in ("driver_state.pt", "trainer_state.pt"):
        load_state(folder / name, mmap=True)  # reads the structure, not gigabytes of tensors
    try:
        from safetensors import safe_open
        for weights in folder.glob("*.safetensors"):
            with safe_open(weights, "pt") as f:
                f.keys()
    except Exception as e:
        raise SystemExit(f"error: checkpoint {folder}: {weights.name} is damaged ({e}); resume "
                         f"from another checkpoint with --resume PATH") from None
    return str(folder)


# ---------------------------------------------------------------------------------------------
# Many processes: the same training step and engines, placed by Ray (distributed.py).


def weights_of(trainer: Trainer, dtype=None) -> dict | None:
    """The full weights on trainer rank 0 (cast to `dtype` where they are, before any copy to the
    host), None on the others. Every rank calls it: a sharded (FSDP) model gathers them."""
    weights = full_state_dict(trainer.model)  # references, unless sharded
    if trainer.group is not None and dist.get_rank() != 0:
        return None
    return {k: v.detach().to(dtype) if dtype and v.is_floating_point() else v
            for k, v in weights.items()}


def _make_engine(cfg: Config):
    model, tokenizer = load_model(cfg.model, pick_device())
    return make_rollout(cfg.rollout, model, tokenizer, device=pick_device(), seed=cfg.seed,
                        max_new_tokens=cfg.max_new_tokens,
                        gpu_memory_utilization=cfg.gpu_memory_utilization)


def launch_on_ray(cfg: Config, resume_dir: str = ""):
    """(tokenizer, engines, train, sync_weights, save) with the single-process signatures."""
    from distributed import Cluster, shard
    from model import load_tokenizer
    import grpo  # functions shipped to workers must come from an importable module, not __main__
    cfg = grpo.Config(**asdict(cfg))
    cluster = Cluster(cfg.num_trainers, cfg.num_engines, colocate=cfg.colocate,
                      address=cfg.ray_address)
    trainers = cluster.trainers(grpo.setup_trainer, cfg, resume_dir)
    engines = cluster.engines(grpo._make_engine, cfg)

    def train(batch):
        parts = shard(len(batch.advantages), cfg.num_trainers)  # each rank: a contiguous slice
        args = [(batch.select(slice(r.start, r.stop)),) for r in parts]
        return finish_metrics(trainers.run(grpo.train_on_rollout, args))

    def sync_weights():
        # engines run in bf16: cast on the trainer's device, so the host copy is half the size
        return engines.update_weights(trainers.weights_ref(
            functools.partial(grpo.weights_of, dtype=torch.bfloat16)))

    def save(folder):  # rank 0 writes; on several nodes --out must be on a shared filesystem
        trainers.run(grpo.save_trainer_state, [(folder,)] * cfg.num_trainers)

    sync_weights()  # engines start from exactly the trainers' weights
    return load_tokenizer(cfg.model), engines, train, sync_weights, save


def format_line(r: dict) -> str:
    line = (f"step {r['step']:4d} | reward {r['reward']:.3f} acc {r['accuracy']:.3f} "
            f"zero-std {r['zero_std_frac']:.2f} | len {r['completion_len']:.1f} "
            f"trunc {r['truncated_frac']:.2f} | gnorm {r['grad_norm']:.3f}")
    if "entropy_trained" in r:
        line += f" ent {r['entropy_trained']:.3f} clip {r['clip_low'] + r['clip_high']:.3f}"
    if "kl" in r:
        line += f" kl {r['kl']:.4f}"
    line += (f" | gen {r['gen_seconds']:.1f}s train {r['train_seconds']:.1f}s "
             f"({r['gen_tokens_per_s']:.0f} tok/s gen)")
    if "eval_accuracy" in r:
        line += f" | held-out {r['eval_accuracy']:.3f}"
    return line


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__.split("\n")[0]))

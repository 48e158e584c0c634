"""GRPO: Group Relative Policy Optimization, in one file you can read top to bottom.

For each prompt we sample a *group* of G completions, score each with a verifiable reward, and use
the group itself as the baseline -- no value network:

    A_i = (r_i - mean(r_group)) / std(r_group)                     group-relative advantage
    r_t = pi_theta(o_t | q, o_<t) / pi_old(o_t | q, o_<t)          per-token probability ratio
    L   = -min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i)  clipped surrogate (PPO)
          + beta * KL_k3(pi_theta || pi_ref)                       optional, k3 estimator

averaged over the valid tokens of the whole batch (DAPO's token-mean; see `loss_agg`).

One step of `main`: sample -> score -> advantages -> train -> sync the engine -> log / evaluate /
checkpoint. With --tools or --env a sample is an episode of several turns (env.py): the model
calls tools, their results are appended, and only the model's own tokens are trained
(TrainBatch.token_mask). What this file leaves out on purpose: a value model (that is PPO), reward
models (rewards here are verifiable: answer checking, or an environment's score), and sequence
packing. Generation engines live in rollout.py, rewards in reward.py, episodes in env.py,
evaluation in evaluate.py, log-probs and model plumbing in model.py, checkpoints in
checkpoint.py, Ray placement in distributed.py.

    python grpo.py                                   # CPU, offline: SmolLM2-135M learns arithmetic
    python grpo.py --model Qwen/Qwen2.5-Math-1.5B    # one GPU: MATH train -> MATH-500 (task math)
    python grpo.py --model Qwen/Qwen2.5-Math-1.5B --lora-rank 16 --lr 1e-5   # a 24 GB GPU
    python grpo.py --num-trainers 8 --num-engines 4 --rollout vllm   # 12 GPUs through Ray
    python grpo.py --ray-address auto --num-trainers 16 --num-engines 8 --rollout vllm  # nodes
"""

import importlib.util
import json
import random
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar, Literal

import torch
from tqdm import tqdm

from checkpoint import DriverState, claim_checkpoints, find_checkpoint, load_driver_state
from checkpoint import recorded_dtype, save_checkpoint
from data import TEMPLATES, ProblemStream, Template, apply_task, check, encode_prompts, flag
from data import load_problems, parse_config, task_summary
from env import Agent, load_environment, load_tools
from evaluate import TRACKERS, RunLog, evaluate_held_out, plot_curves, show_samples, step_record
from gpu_memory import PROMPT_TOKENS, Workload, plan_memory
from model import DEFAULT_MODEL, choose_dtype, length_mask, model_path, pack, pick_device
from model import right_pad
from reward import Grader, RewardFunctions, correctness_reward, overlong_penalty
from rollout import Completions, Ready, Sampling, policy_lag
from trainer import Trainer, UpdateStats, add_to_master_grads, any_rank_trains, count_bad_steps
from trainer import engine_correction, frozen_logprobs, micro_batches, optimizer_step
from trainer import policy_logprobs, reference_logprobs, same_pass_count, setup_local, setup_ray
from trainer import untrained_mismatch


@dataclass
class Config:
    CONFIG_FILE: ClassVar[str] = "grpo_config.json"  # written to --out, and into checkpoints

    # Model and data
    model: str = DEFAULT_MODEL
    """policy to train: the offline default, a hub id, or a local HF folder"""
    data: str = "auto"
    """a task -- arith (offline), math, gsm8k; auto: arith for the offline default model, math for
    any other (data.TASKS) -- or a .jsonl/.json/.csv/.parquet file or hub dataset id"""
    task: Literal["", "arith", "math", "gsm8k", "custom", "multiply", "guess"] = ""
    """whose defaults apply (data.TASKS); "" = what --data says, a file by its columns"""
    prompt_field: str = ""
    """the data's prompt column (default: `problem`, else `prompt`)"""
    answer_field: str = "answer"
    """the data's reference-answer column (e.g. `solution`); optional if no reward needs it"""
    split: str = ""
    """hub datasets: the split to train on (default: the task's, else train)"""
    template: Template | None = None
    """prompt template from data.TEMPLATES: answer-is, boxed, raw (default: the task's)"""
    chat: bool = True
    """wrap prompts in the model's chat template (turn off for base models)"""
    reward: str | None = None
    """reward functions, comma-separated `name=weight`: correctness, format, or module:function
    (default: the task's; an --env's get_reward() is added to them)"""
    require_think_close: bool = False
    """reasoning models: grade only the text after </think>; no </think> means reward 0"""
    seed: int = 0
    """seed for data order, sampling and initialisation"""

    # Sampling: the rollouts of one step
    rollout: Literal["auto", "hf", "vllm"] = "auto"
    """generation engine: hf (a decoding loop over the HF model) or vllm (in-process vLLM, synced);
    auto: vllm when a GPU and vLLM are there, else hf"""
    prompts_per_step: int = 8
    """prompts sampled per step (N)"""
    num_generations: int = 8
    """completions per prompt: the group size G"""
    max_new_tokens: int | None = None
    """response length limit; responses that hit it are truncated (default: the task's)"""
    temperature: float | None = None
    """sampling temperature for training rollouts; the log-probs use it too (default: the task's)"""
    top_p: float = 1.0
    """must stay 1: the trainer's log-probs describe the full distribution (see __post_init__)"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, sample more prompts to refill the batch"""
    max_fill_rounds: int = 3
    """dynamic sampling: extra rollout rounds per step at most (then train on what there is)"""
    async_steps: int = 0
    """1: engines sample step t+1's batch with step t's weights while the trainers train on step
    t (one step off-policy: pi_old is the engine's log-prob of each token); 0: on-policy"""

    # Agentic episodes (env.py): the model calls tools, over several turns
    tools: str | None = None
    """tools the model may call, comma-separated: calculator, python (sandboxed: sandbox.py), or
    module:function (TRL's tools=); default: the task's"""
    env: str | None = None
    """an environment, module:Class (TRL's environment_factory): reset(**row), its public methods
    as tools, get_reward(); default: the task's"""
    max_turns: int | None = None
    """episodes: assistant turns at most (a turn still calling a tool at the limit: truncated;
    default: the task's, 5 for guess, else 4)"""
    max_episode_tokens: int = 512
    """episodes: tokens after the prompt at most, tool results included (then truncated)"""

    # The GRPO loss
    adv_scale: Literal["group", "batch", "none"] = "group"
    """advantage scaling: group (GRPO), batch, none (Dr. GRPO)"""
    leave_one_out: bool = False
    """baseline = mean of the *other* samples of the group (RLOO)"""
    eps_low: float = 0.2
    """lower clip range: ratio floored at 1 - eps_low"""
    eps_high: float = 0.2
    """upper clip range: ratio capped at 1 + eps_high (DAPO's clip-higher uses 0.28)"""
    beta: float = 0.0
    """KL penalty weight against the initial policy (k3 estimator); 0 skips the reference model"""
    loss_agg: Literal["auto", "token-mean", "seq-mean", "seq-sum-norm"] = "auto"
    """token-mean (DAPO), seq-mean (original GRPO), seq-sum-norm (Dr. GRPO); auto: token-mean, or
    seq-mean with --ratio-level sequence (GSPO's objective is a mean over sequences)"""
    ratio_level: Literal["token", "sequence"] = "token"
    """token (GRPO/PPO) or sequence (GSPO: length-normalised sequence ratio, seq_eps clip range)"""
    seq_eps_low: float = 3e-4
    """GSPO lower clip range of the sequence ratio"""
    seq_eps_high: float = 4e-4
    """GSPO upper clip range of the sequence ratio"""
    overlong_filter: bool = False
    """DAPO: truncated samples get zero loss weight (they still count in their group's baseline)"""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty: reward falls linearly to -1 over the last N tokens (0 = off)"""
    is_cap: float = 0.0
    """vLLM: truncated importance-sampling correction, weight min(pi_trainer/pi_engine, cap); 0=off"""

    # Optimisation
    steps: int | None = None
    """optimizer steps, one rollout batch each when updates_per_rollout is 1 (default: the task's)"""
    lr: float | None = None
    """AdamW learning rate, constant after warmup (default: the task's)"""
    warmup_steps: int = 0
    """linear learning-rate warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    updates_per_rollout: int = 1
    """optimizer steps per rollout batch; >1 makes the ratio and the clipping matter"""
    micro_batch_size: int | None = None
    """sequences per forward/backward; gradients accumulate over the batch (default: the task's,
    64 for arith's short sequences, else 16)"""
    max_tokens_per_microbatch: int | None = None
    """micro-batches by token budget (padded tokens), sequences sorted by length (0 = by count;
    default: on a GPU what fits, gpu_memory.plan_memory; on a CPU 0)"""
    gradient_checkpointing: bool | None = None
    """recompute activations in backward: less memory for long responses, ~30 % more compute
    (default: on a GPU when micro-batches of a few whole sequences would not fit without it)"""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """compute dtype of the update, the KL reference and the engine (master weights stay fp32);
    auto: bf16 where the hardware has it natively, else fp32 (model.choose_dtype, printed)"""
    compile: bool = False
    """torch.compile the decoder layers for the update: 1.2-1.4x faster after a one-off ~45-60 s
    compile on a CPU (~10 s once cached on disk); pays off in runs longer than the default"""
    lora_rank: int = 0
    """LoRA (peft): train rank-R adapters only, for a 1.5B model on a 24 GB GPU (0 = full)"""
    lora_alpha: int = 0
    """LoRA scale numerator (0 = 2 * rank)"""
    lora_targets: str = "all-linear"
    """LoRA: the modules adapted (comma-separated names, e.g. q_proj,v_proj; or all-linear)"""

    # Evaluation and logging
    eval_data: str = ""
    """held-out problems (default: the task's eval set, else the last eval_size rows of --data)"""
    eval_size: int | None = None
    """number of held-out problems evaluated greedily (default: the task's)"""
    eval_every: int | None = None
    """held-out greedy evaluation every N steps, at step 0 and at the end (0 = never; default:
    the task's)"""
    log_samples_every: int = 10
    """print a few sampled completions every N steps (0 = never)"""
    out: str = "out/grpo"
    """output folder: metrics.jsonl, curves.png, checkpoints/, the final model in model/ (an HF
    folder; --model and --init-from also take the output folder itself)"""
    report_to: str = ""
    """also log metrics to: tensorboard, wandb (comma-separated; pip install them first)"""

    # Checkpoints
    save_every: int = 0
    """write <out>/checkpoints/step_N every N steps (0 = never)"""
    keep_last: int = 2
    """checkpoints kept (the oldest are deleted); 0 keeps all"""
    resume: str = ""
    """continue a run exactly: `auto` (latest checkpoint in --out) or a checkpoint folder"""
    init_from: str = ""
    """start a new run (fresh optimizer, step 0) from a checkpoint's or HF folder's weights"""

    # Scale-out: Ray placement (distributed.py) and engine memory
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
    gpu_memory_utilization: float | None = None
    """vLLM: fraction of GPU memory (of host memory on CPU) for weights and KV cache (default: on
    a GPU what holds one step's batch, gpu_memory.plan_memory; on a CPU 0.2)"""
    weight_sync: Literal["collective", "object-store"] = "collective"
    """Ray: trainer rank 0 broadcasts the weights to the engines (bf16, bucketed), or puts them in
    Ray's object store for every engine to pull"""

    def __post_init__(self):  # the task's defaults fill what is unset; impossible values stop here
        apply_task(self)
        # auto -> what computes fastest here; a resumed run keeps the dtype it recorded
        choice = choose_dtype(self.dtype, pick_device(),
                              recorded_dtype(self.out, self.resume, self.CONFIG_FILE))
        self.dtype, self.dtype_reason = choice.name, choice.reason  # (the reason is no option)
        if self.rollout == "auto":
            gpu_and_vllm = torch.cuda.is_available() and importlib.util.find_spec("vllm")
            self.rollout = "vllm" if gpu_and_vllm else "hf"
        self.memory_plan = None  # on a GPU: what the unset memory settings are based on
        if pick_device() == "cuda":
            self.memory_plan = plan_memory(self.workload(), torch.cuda.mem_get_info()[1],
                                           self.gradient_checkpointing,
                                           self.max_tokens_per_microbatch,
                                           self.gpu_memory_utilization)
            for name in ("gradient_checkpointing", "max_tokens_per_microbatch",
                         "gpu_memory_utilization"):
                setattr(self, name, getattr(self.memory_plan, name))
        for name, on_cpu in (("gradient_checkpointing", False), ("max_tokens_per_microbatch", 0),
                             ("gpu_memory_utilization", 0.2)):
            if getattr(self, name) is None or (name == "gpu_memory_utilization"
                                               and not getattr(self, name)):
                setattr(self, name, on_cpu)
        check(self.num_generations >= 2, f"--num-generations {self.num_generations}: a group needs "
              f"at least 2 samples, or it has no baseline to be better than")
        for name in ("prompts_per_step", "max_new_tokens", "updates_per_rollout",
                     "micro_batch_size", "num_trainers", "num_engines", "max_turns",
                     "max_episode_tokens"):
            check(getattr(self, name) >= 1, f"{flag(name)} must be at least 1")
        for name in ("steps", "warmup_steps", "max_fill_rounds", "overlong_buffer",
                     "max_tokens_per_microbatch", "save_every", "keep_last", "eval_every",
                     "log_samples_every", "lr", "weight_decay", "beta", "is_cap", "lora_rank",
                     "lora_alpha"):
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
        budget = "max_episode_tokens" if self.tools or self.env else "max_new_tokens"
        check(self.overlong_buffer <= getattr(self, budget), f"--overlong-buffer "
              f"{self.overlong_buffer} is longer than {flag(budget)} {getattr(self, budget)}")
        check(not (self.resume and self.init_from), "--resume continues a run, --init-from starts "
              "a new one from other weights: give one of them")
        check(all(n in TRACKERS for n in self.report_to.split(",") if n), f"--report-to "
              f"{self.report_to}: choose from {', '.join(TRACKERS)} (comma-separated)")
        check(self.async_steps in (0, 1), f"--async-steps {self.async_steps}: 0 (on-policy) or 1 "
              f"(one step off-policy) are supported")
        check(not (self.async_steps and (self.tools or self.env)), "--async-steps 1 with --tools "
              "or --env is not supported: episodes are played turn by turn in the driver, each "
              "turn waiting for the last")
        check(not (self.async_steps and self.is_cap), "--is-cap corrects on-policy training for "
              "the engine's numerics; with --async-steps 1 the ratio is already taken against the "
              "engine's log-probs: leave --is-cap out")
        check(not (self.fsdp and self.lora_rank), "--fsdp with --lora-rank is not supported: "
              "LoRA is for models that fit one device")
        check(not self.fsdp or self.num_trainers > 1, "--fsdp shards the model over several "
              "trainers: use it with --num-trainers N, N > 1")
        # GSPO's objective is (1/G) sum_i min(s_i A_i, clip(s_i) A_i): a mean over sequences. Any
        # other aggregation sums a sequence's |y_i| identical terms and weighs long answers more.
        if self.loss_agg == "auto":
            self.loss_agg = "seq-mean" if self.ratio_level == "sequence" else "token-mean"
        check(self.ratio_level == "token" or self.loss_agg == "seq-mean", f"--ratio-level sequence "
              f"(GSPO) averages over sequences: --loss-agg {self.loss_agg} contradicts it; "
              f"leave --loss-agg out or pass seq-mean")


    def workload(self) -> Workload:
        """What this run puts on one GPU, for gpu_memory.plan_memory."""
        samples = self.prompts_per_step * self.num_generations
        new_tokens = self.max_episode_tokens if self.tools or self.env else self.max_new_tokens
        on_ray = self.num_trainers > 1 or self.num_engines > 1 or bool(self.ray_address)
        return Workload(model_path(self), self.lora_rank, self.dtype == "bf16",
                        self.beta != 0 and not self.lora_rank,
                        self.num_trainers if self.fsdp else 1, self.rollout,
                        self.colocate or not on_ray, samples * (PROMPT_TOKENS + new_tokens),
                        samples, PROMPT_TOKENS + new_tokens)


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
# Sampling and scoring: N prompts -> G completions each -> rewards.


@dataclass
class Scored:
    """One round of rollouts, prompt-major (sample k of prompt i at i * G + k), with its scores."""
    rows: list[dict]  # the problem of every sample (each repeated G times)
    completions: Completions
    rewards: torch.Tensor  # (N*G,) weighted sum of the reward functions (+ overlong penalty)
    correct: list[float]  # (N*G,) answer correctness whatever the reward is ([]: no answers)
    per_fn: dict[str, list[float]]  # each reward function's scores
    gen_seconds: float = 0.0
    reward_seconds: float = 0.0
    episodes: list = field(default_factory=list)  # --tools / --env: each sample's env.Episode

    def select(self, indices: list[int]) -> "Scored":
        return Scored([self.rows[i] for i in indices], self.completions.select(indices),
                      self.rewards[indices],
                      [self.correct[i] for i in indices] if self.correct else [],
                      {name: [s[i] for i in indices] for name, s in self.per_fn.items()},
                      episodes=[self.episodes[i] for i in indices] if self.episodes else [])

    @staticmethod
    def concat(parts: list["Scored"]) -> "Scored":
        return Scored([r for p in parts for r in p.rows],
                      Completions.concat([p.completions for p in parts]),
                      torch.cat([p.rewards for p in parts]), [c for p in parts for c in p.correct],
                      {name: [s for p in parts for s in p.per_fn[name]] for name in parts[0].per_fn},
                      sum(p.gen_seconds for p in parts), sum(p.reward_seconds for p in parts),
                      [e for p in parts for e in p.episodes])


@dataclass
class Started:
    """A round of rollouts on its way: the problems, and the engines' work (.result())."""
    rows: list[dict]
    pending: object  # .result() -> Completions
    episodes: list = field(default_factory=list)  # --tools / --env: played to the end already


def start_rollout(run, rows: list[dict], cfg: Config, seed: int) -> Started:
    """Ask the engines (run: a trainer.Run) for G completions of each problem in `rows`. Engines on
    Ray work in the background; an engine in this process generates right away. Episodes
    (--tools, --env) are played here, turn by turn (env.Agent)."""
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p, seed)
    if run.agent:
        comps, episodes = run.agent.run(run.rollout, rows, cfg.num_generations, sampling)
        return Started(rows, Ready(comps), episodes)
    prompts = encode_prompts(run.tokenizer, rows, cfg.template, cfg.chat)
    return Started(rows, run.rollout.submit_generate(prompts, cfg.num_generations, sampling))


def score(started: Started, cfg: Config, reward_fns: RewardFunctions, grader: Grader) -> Scored:
    """The completions of a started round, and their rewards."""
    G, rows = cfg.num_generations, started.rows
    comps = started.pending.result()
    # The engines' own time: with --async-steps 1 a batch was started a training step ago.
    gen_seconds, t0 = comps.seconds, time.time()
    group_rows = [r for r in rows for _ in range(G)]
    # As TRL passes them: the prompt column as it is (chat messages, or the problem text); for
    # episodes, their messages and their environments.
    prompts = [r["prompt"] if isinstance(r.get("prompt"), list) else r["problem"]
               for r in group_rows]
    completions, extra = comps.text, {}
    if started.episodes:
        prompts, completions = [e.prompt for e in started.episodes], \
            [e.messages for e in started.episodes]
        if started.episodes[0].env is not None:
            extra["environments"] = [e.env for e in started.episodes]
    rewards, per_fn = reward_fns(prompts, completions, comps.completion_ids, group_rows, **extra)
    correct = per_fn.get("correctness") or ([] if "answer" not in rows[0] else correctness_reward(
        prompts, comps.text, [r["answer"] for r in group_rows],
        answer_format=TEMPLATES[cfg.template][1], grader=grader))
    if cfg.overlong_buffer:
        rewards = [r + p for r, p in zip(rewards, overlong(comps, cfg, bool(started.episodes)))]
    return Scored(group_rows, comps, torch.tensor(rewards), correct, per_fn, gen_seconds,
                  time.time() - t0, started.episodes)


def overlong(comps: Completions, cfg: Config, episodes: bool) -> list[float]:
    """DAPO's soft overlong penalty of each sample, against the budget it was cut at: a
    completion's length against --max-new-tokens; an episode's whole length (every turn and tool
    result: what --max-episode-tokens caps) against --max-episode-tokens. A two-turn episode is
    not "long" for having more tokens than one turn may."""
    budget = cfg.max_episode_tokens if episodes else cfg.max_new_tokens
    return overlong_penalty([len(c) for c in comps.completion_ids], budget, cfg.overlong_buffer)


def has_signal(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """(N,) True for groups whose rewards are not all equal: only those have non-zero advantages."""
    return rewards.view(-1, G).std(1) > 1e-6


def dynamic_sampling(run, problems: ProblemStream, first: Scored, cfg: Config, step: int,
                     reward_fns: RewardFunctions, grader: Grader) -> tuple[Scored, Scored, dict]:
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal; drop them and
    sample fresh prompts until N groups have some, for at most max_fill_rounds more rounds.
    Returns every round sampled (for the metrics), the groups to train on, and refill metrics."""
    G, N, rounds = cfg.num_generations, cfg.prompts_per_step, [first]
    while (sum(int(has_signal(r.rewards, G).sum()) for r in rounds) < N
           and len(rounds) <= cfg.max_fill_rounds):
        rounds.append(score(start_rollout(run, problems.take(N), cfg, sampling_seed(
            cfg, step, len(rounds))), cfg, reward_fns, grader))
    kept, dropped = groups_with_signal(rounds, G, N)
    return Scored.concat(rounds), kept, {"dropped_groups": dropped, "fill_rounds": len(rounds) - 1,
                                         "kept_groups": len(kept.completions) // G}


def groups_with_signal(rounds: list[Scored], G: int, limit: int) -> tuple[Scored, int]:
    """Dynamic sampling: the first `limit` groups of the rounds that have signal, as one Scored,
    and how many groups were dropped."""
    parts, dropped = [], 0
    for scored in rounds:
        signal = has_signal(scored.rewards, G)
        dropped += int((~signal).sum())
        for i in signal.nonzero().flatten().tolist()[:limit - len(parts)]:
            parts.append(scored.select(list(range(i * G, (i + 1) * G))))
    return Scored.concat(parts) if parts else rounds[0].select([]), dropped


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
    token_mask: torch.Tensor | None = None  # (B, T) episodes: True for the model's own tokens,
    # False for the environment's (tool results), which are never trained; None: all of them

    def loss_mask(self, idx, T: int) -> torch.Tensor:
        """(b, T) the tokens of rows `idx` that the loss covers: the completion's (from its
        length), less the environment's in an episode."""
        mask = length_mask(self.completion_lens[idx], T)
        return mask if self.token_mask is None else mask & self.token_mask[idx][:, :T]

    def select(self, idx) -> "TrainBatch":
        """Rows `idx` (a slice, or an index tensor)."""
        return self._map(lambda t: t[idx])

    def to(self, device) -> "TrainBatch":
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> "TrainBatch":
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


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
    token_mask, trained_lens = None, completion_lens  # (episodes: the model's tokens only)
    if comps.mask is not None:
        token_mask = right_pad(comps.mask, False, torch.bool)  # (B, T)
        trained_lens = token_mask.sum(1)
    denom = loss_denominator(cfg.loss_agg, trained_lens * in_loss, cfg.max_new_tokens)
    return TrainBatch(input_ids, prompt_lens, completion_lens, advantages, in_loss, engine_lps,
                      denom, token_mask)


def train_on_rollout(trainer: Trainer, batch: TrainBatch) -> dict:
    """`updates_per_rollout` optimizer steps on (this rank's shard of) one rollout batch.

    Returns raw sums (trainer.UpdateStats), combined over ranks by finish_metrics: every rank's
    loss is its share of one global loss (batch.denom counts the global batch).
    """
    cfg, model, device = trainer.cfg, trainer.compute, trainer.device  # (see trainer.bf16_copy)
    batch = batch.to(device)
    lens = batch.completion_lens
    # Without a KL term, a sequence with advantage 0 (e.g. from a zero-std group) adds exactly 0 to
    # the loss and its gradient, so we skip its forward/backward; it still counts in `denom`, which
    # keeps the loss identical. Early in training most groups are all-wrong: this halves step time.
    # (Under FSDP every rank trains all its sequences, so the ranks' passes line up.)
    trained = batch.in_loss & (lens > 0)
    if cfg.beta == 0.0 and not trainer.sharded:
        trained &= batch.advantages != 0
    keep = trained.nonzero().flatten()
    mbs, real = same_pass_count(micro_batches(keep, batch.prompt_lens + lens, cfg), trainer)
    stats = UpdateStats(trainer, batch, keep)
    untrained_mismatch(trainer, batch, trained, stats.mismatch)  # the engine's, on the rest
    if not any_rank_trains(trainer, len(keep)):
        return stats.result()
    # With several updates per rollout the policy drifts from the one that sampled, so pi_old must
    # be frozen before the first update. With one update pi_old == pi_theta: we reuse the current
    # log-probs, detached. The ratio is then exactly 1 but its gradient is not zero --
    # d/dtheta exp(lp - sg(lp)) = grad lp -- so the loss still trains (and its value is ~0).
    old_lps = frozen_logprobs(model, batch, mbs, cfg, device) \
        if cfg.updates_per_rollout > 1 and not cfg.async_steps else None  # (async: the engine's)
    ref_lps = reference_logprobs(trainer, batch, mbs)
    seq_level = cfg.ratio_level == "sequence"
    for update in range(cfg.updates_per_rollout):
        model.train()
        for k, idx in enumerate(mbs):
            logprobs, entropy = policy_logprobs(model, batch, idx, cfg, device)
            mask = batch.loss_mask(idx, logprobs.shape[1])  # (b, T)
            old = old_lps[k] if old_lps else logprobs.detach()
            weights = engine_correction(batch, idx, old, mask, cfg,
                                        stats.mismatch if update == 0 and k < real else None)
            if cfg.async_steps:  # sampled by the last step's weights: pi_old is the sampling
                old = batch.engine_logprobs[idx][:, :logprobs.shape[1]]  # policy, per the engine
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
            (loss * trainer.world if trainer.sharded else loss).backward()  # micro-batches add up
            add_to_master_grads(trainer)
            stats.add(loss, metrics, entropy, mask)
        stats.end_update(optimizer_step(trainer, stats.update_loss))
    return stats.result()


# ---------------------------------------------------------------------------------------------
# The loop.

def main(cfg: Config):
    session = start_session(cfg, train_on_rollout)
    run, driver, problems = session.run, session.driver, session.problems
    reward_fns, grader = session.reward_fns, session.grader
    G, N, bad_steps, started = cfg.num_generations, cfg.prompts_per_step, 0, None

    for step in tqdm(range(driver.step + 1, cfg.steps + 1), desc="grpo", unit="step",
                     initial=driver.step, total=cfg.steps):
        t_step = time.time()
        # 1-2. Rollout and rewards: G completions for each of N prompts, scored. (With
        # --async-steps 1 they were started during the last step, and sampled by its weights.)
        started = started or start_rollout(run, problems.take(N), cfg, sampling_seed(cfg, step, 0))
        sampled = scored = score(started, cfg, reward_fns, grader)  # all sampled / trained on
        lag, refill = policy_lag(sampled.completions, step, cfg.async_steps), {}
        if cfg.dynamic_sampling:  # DAPO: train on groups with a reward spread; sample more of them
            sampled, scored, refill = dynamic_sampling(run, problems, scored, cfg, step,
                                                       reward_fns, grader)
        # --async-steps 1: the engines sample the next step's batch while the trainers train.
        started = (start_rollout(run, problems.take(N), cfg, sampling_seed(cfg, step + 1, 0))
                   if cfg.async_steps and step < cfg.steps else None)
        # 3. Advantages: each completion against the rest of its group. 4. Policy update.
        t0 = time.time()
        update = {"loss": 0.0, "grad_norm": 0.0, "trained_frac": 0.0, "trained_tokens": 0,
                  "skipped_updates": 0}
        if len(scored.completions):
            advantages = group_advantages(scored.rewards, G, scale=cfg.adv_scale,
                                          leave_one_out=cfg.leave_one_out)
            update = run.train(train_batch(scored.completions, advantages, cfg,
                                           run.tokenizer.pad_token_id))
        train_seconds = time.time() - t0
        bad_steps = count_bad_steps(update, bad_steps, step, cfg.lr)
        # 5. The engines take the new weights.
        sync_seconds = run.sync_weights(step)
        # 6. Metrics, held-out evaluation, samples, checkpoint.
        record = step_record(step, sampled, update, train_seconds, sync_seconds, G)
        record.update(**refill, reward_errors=reward_fns.errors, grader_timeouts=grader.timeouts,
                      policy_lag=lag, step_seconds=time.time() - t_step)
        # (a started next batch is not consumed: a resumed run samples it anew, on-policy)
        end_step(session, cfg, step, record, scored, pending=N if started else 0,
                 save=not bad_steps)

    finish_session(session, cfg, title=f"GRPO on {cfg.data} ({cfg.model})")
    return driver.history


# ---------------------------------------------------------------------------------------------
# A run's set-up and its end: shared with distill.py, whose loop is this one with a teacher in
# place of the rewards.


@dataclass
class Session:
    """What a run's loop works with."""
    out: Path
    run: object  # trainer.Run: the engines, the trainers, weight sync, saving
    driver: DriverState  # the step, the data position, the metrics so far
    problems: ProblemStream  # the training problems, from where the run stands
    eval_rows: list[dict]
    reward_fns: RewardFunctions
    grader: Grader
    log: RunLog


def start_session(cfg, train_step, line=None) -> Session:
    """Everything before a run's first step, checked in the order that fails fastest: the task
    line, the checkpoints (a resumed run's, and never another run's), the data, the tools, then
    the models (train_step: what a trainer runs on a rollout batch); the config is written to
    <out>/<cfg.CONFIG_FILE>, and a fresh run is evaluated at step 0."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    print(task_summary(cfg))
    if cfg.memory_plan:
        print(cfg.memory_plan)
    resume_dir = find_checkpoint(out, cfg.resume) if cfg.resume else ""
    branched = claim_checkpoints(out, resume_dir)  # never touch another run's checkpoints
    if branched:
        print(branched)
    train_rows, eval_rows, columns = load_problems(cfg)  # data first: fail before the model loads
    tools, env_class = load_tools(cfg.tools), load_environment(cfg.env)  # checked here, too
    # episodes (--tools, --env): the model acts, tools and the environment answer
    agent = Agent.for_run(cfg, TEMPLATES[cfg.template][0], tools, env_class)
    grader = Grader()  # math-verify workers start (untimed) when an answer first needs them
    reward_fns = RewardFunctions(cfg.reward, TEMPLATES[cfg.template][1], grader,
                                 cfg.require_think_close, columns, env_class)
    # A resumed run picks up its step, data position, RNG and metrics where the checkpoint left them.
    driver = load_driver_state(resume_dir) if resume_dir else DriverState()
    on_ray = cfg.num_trainers > 1 or cfg.num_engines > 1 or cfg.ray_address
    run = (setup_ray if on_ray else setup_local)(cfg, train_step, resume_dir, driver.step)
    run.agent = agent
    if resume_dir:
        print(f"resuming from {resume_dir} at step {driver.step + 1}")
    problems = ProblemStream(train_rows, skip=driver.consumed)
    log = RunLog(out, driver.history, cfg.report_to, asdict(cfg), line)
    (out / cfg.CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2))
    if cfg.eval_every and eval_rows and driver.step == 0:
        log({"step": 0, **evaluate_held_out(run, eval_rows, cfg, grader)})
    return Session(out, run, driver, problems, eval_rows, reward_fns, grader, log)


def end_step(session: Session, cfg, step: int, record: dict, scored: Scored, pending: int = 0,
             save: bool = True):
    """A step's end: the held-out evaluation when due, the metrics logged, a few samples shown,
    and the checkpoint when due (save: the step's update was good). pending: problems drawn for a
    batch that was started but not trained on yet."""
    run, driver = session.run, session.driver
    if session.eval_rows and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
        record.update(evaluate_held_out(run, session.eval_rows, cfg, session.grader))
    session.log(record)
    if cfg.log_samples_every and step % cfg.log_samples_every == 0:
        show_samples(scored.rows, [run.tokenizer.decode(c) for c in  # (episodes: all turns)
                                   scored.completions.completion_ids] if scored.episodes
                     else scored.completions.text, scored.rewards)
    driver.step, driver.consumed = step, session.problems.taken - pending
    if cfg.save_every and step % cfg.save_every == 0 and save:
        save_checkpoint(session.out, driver, run.save, cfg.keep_last)


def finish_session(session: Session, cfg, title: str, **plot):
    """After the last step: the model alone (optimizer state lives in checkpoints only) in
    <out>/model, and the curves."""
    session.grader.close()
    session.log.close()
    session.run.export(str(session.out / "model"))
    plot_curves(session.driver.history, session.out / "curves.png", title=title, **plot)
    print(f"saved the model in {session.out}/model/, metrics.jsonl and curves.png in "
          f"{session.out}/")


def sampling_seed(cfg: Config, step: int, attempt: int) -> int:
    """A seed per step and rollout round, so a resumed run samples what the original would."""
    return (cfg.seed * 1_000_003 + step) * 16 + attempt


if __name__ == "__main__":
    # Run the importable module, not __main__: the functions Ray ships to workers (setup_trainer,
    # train_on_rollout, ...) must be grpo.*, which a worker can import.
    import grpo
    grpo.main(parse_config(grpo.Config, description=__doc__.split("\n")[0]))

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
(rl.TrainBatch.token_mask). What this file leaves out on purpose: a value model (that is PPO),
reward models (rewards here are verifiable: answer checking, or an environment's score), and
sequence packing. This file is GRPO's options, advantages, loss, update and loop; the loop's
shared pieces (set-up, rollouts, scores, the trainers' batch, a step's end) are rl.py's, the
options every algorithm shares options.py's, one training process trainer.py's.

    python grpo.py                                   # CPU, offline: SmolLM2-135M learns arithmetic
    python grpo.py --model Qwen/Qwen2.5-Math-1.5B    # one GPU: MATH train -> MATH-500 (task math)
    python grpo.py --model Qwen/Qwen2.5-Math-1.5B --lora-rank 16 --lr 1e-5   # a 24 GB GPU
    python grpo.py --num-trainers 8 --num-engines 4 --rollout vllm   # 12 GPUs through Ray
    python grpo.py --ray-address auto --num-trainers 16 --num-engines 8 --rollout vllm  # nodes
"""

import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from tqdm import tqdm

from cli import check, parse_config
from data import ProblemStream
from evaluate import step_record
from options import RLOptions
from reward import Grader, RewardFunctions, weighted
from rl import Scored, end_step, finish_session, sampling_seed, score, start_rollout
from rl import log_rollouts, replayed, start_session, train_batch, with_detail
from sampling import policy_lag
from session import one_run
from trainer import Trainer, UpdateStats, any_rank_trains, count_bad_steps
from trainer import engine_correction, frozen_logprobs, micro_batches, optimizer_step
from trainer import logprobs_after_update, policy_logprobs, reference_logprobs, same_pass_count
from trainer import untrained_mismatch


@dataclass
class Config(RLOptions):
    """The RL loop's options (options.RLOptions: model and data, sampling, episodes, the update's
    schedule, evaluation, checkpoints, scale-out), and GRPO's:"""
    CONFIG_FILE: ClassVar[str] = "grpo_config.json"  # written to --out, and into checkpoints
    out: str = "out/grpo"

    # The GRPO loss
    adv_scale: Literal["group", "batch", "none", "unit"] = "group"
    """advantage scaling: group (GRPO), batch, none (Dr. GRPO); unit: +1 where the reward is
    positive, -1 elsewhere, no baseline (Zhu et al. 2025; with --reinforce, their PSR or NSR)"""
    leave_one_out: bool = False
    """baseline = mean of the *other* samples of the group (RLOO)"""
    reinforce: Literal["all", "positive", "negative"] = "all"
    """the samples trained on: all; positive (PSR, Zhu et al. 2025: only those of a positive
    advantage, the others' set to 0); negative (NSR: only those of a negative one)"""
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
    is_cap: float = 0.0
    """vLLM: truncated importance-sampling correction, weight min(pi_trainer/pi_engine, cap); 0=off"""
    surrogate: Literal["clip", "cispo", "sapo"] = "clip"
    """the policy term per token: clip (PPO's clipped ratio), cispo (MiniMax-M1: a clipped,
    stop-gradient weight on every token's log-prob, --eps-low/--eps-high its bounds), sapo (a
    soft sigmoid gate in place of the clip, --sapo-tau-pos/--sapo-tau-neg its temperatures)"""
    sapo_tau_pos: float = 1.0
    """SAPO: the gate's temperature for tokens of a positive advantage"""
    sapo_tau_neg: float = 1.05
    """SAPO: the gate's temperature for tokens of a negative advantage (steeper: damps faster)"""

    # DAPO's sampling and reward shaping, and off-policy sampling
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, sample more prompts to refill the batch"""
    max_fill_rounds: int = 3
    """dynamic sampling: extra rollout rounds per step at most (then train on what there is)"""
    overlong_filter: bool = False
    """DAPO: truncated samples get zero loss weight (they still count in their group's baseline)"""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty: reward falls linearly to -1 over the last N tokens (0 = off)"""
    async_steps: int = 0
    """1: engines sample step t+1's batch with step t's weights while the trainers train on step
    t (one step off-policy: pi_old is the engine's log-prob of each token; in one process, and
    colocated on GPUs, the two take turns instead, as the run says); 0: on-policy"""

    def __post_init__(self):  # impossible values stop here, before anything loads
        super().__post_init__()
        for name in ("max_fill_rounds", "overlong_buffer", "beta", "is_cap"):
            check(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must not be negative")
        check(0 <= self.eps_low < 1 + (self.surrogate == "cispo") and self.eps_high >= 0,
              f"--eps-low {self.eps_low} --eps-high {self.eps_high}: need 0 <= eps-low < 1 (2 "
              f"with --surrogate cispo: 1 leaves its weight no floor) and eps-high >= 0")
        clashes = unit_clashes(self) if self.adv_scale == "unit" else []
        check(not clashes, f"--adv-scale unit reads a positive reward as right, any other as "
              f"wrong -- one verifier's verdict: not with {', '.join(clashes)}")
        check(self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0, "--sapo-tau-pos and "
              "--sapo-tau-neg must be positive")
        check(self.surrogate == "clip" or self.ratio_level == "token", f"--surrogate "
              f"{self.surrogate} weighs each token by its own ratio: --ratio-level sequence (GSPO) "
              f"clips a sequence's")
        check(0 <= self.seq_eps_low < 1 and self.seq_eps_high >= 0, "--seq-eps-low must be in "
              "[0, 1) and --seq-eps-high at least 0")
        budget = "max_episode_tokens" if self.tools or self.env else "max_new_tokens"
        check(self.overlong_buffer <= getattr(self, budget), f"--overlong-buffer "
              f"{self.overlong_buffer} is longer than --{budget.replace('_', '-')} "
              f"{getattr(self, budget)}")
        check(self.async_steps in (0, 1), f"--async-steps {self.async_steps}: 0 (on-policy) or 1 "
              f"(one step off-policy) are supported")
        check(not (self.async_steps and (self.tools or self.env)), "--async-steps 1 with --tools "
              "or --env is not supported: episodes are played turn by turn in the driver, each "
              "turn waiting for the last")
        check(not (self.async_steps and self.is_cap), "--is-cap corrects on-policy training for "
              "the engine's numerics; with --async-steps 1 the ratio is already taken against the "
              "engine's log-probs: leave --is-cap out")
        # GSPO's objective is (1/G) sum_i min(s_i A_i, clip(s_i) A_i): a mean over sequences. Any
        # other aggregation sums a sequence's |y_i| identical terms and weighs long answers more.
        if self.loss_agg == "auto":
            self.loss_agg = "seq-mean" if self.ratio_level == "sequence" else "token-mean"
        check(self.ratio_level == "token" or self.loss_agg == "seq-mean", f"--ratio-level sequence "
              f"(GSPO) averages over sequences: --loss-agg {self.loss_agg} contradicts it; "
              f"leave --loss-agg out or pass seq-mean")

    def reference(self) -> bool:
        return self.beta != 0.0

    def engine_logprobs(self) -> bool:
        return self.async_steps > 0


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


def unit_advantages(rewards):
    """(N*G,) +1 where a reward is positive (right), -1 elsewhere; no baseline (Zhu et al.)."""
    return torch.where(rewards > 0, 1.0, -1.0)


def keep_sign(advantages, reinforce: str):
    """(N*G,) advantages with those of the sign not reinforced set to 0 (Zhu et al. 2025, "The
    Surprising Effectiveness of Negative Reinforcement"): "positive" keeps A > 0 (PSR: the right
    answers pulled up), "negative" keeps A < 0 (NSR: the wrong ones pushed down), "all" both
    (GRPO). A sample set to 0 adds nothing to the loss but still counts in its denominator, so the
    kept samples weigh what they weigh in GRPO."""
    if reinforce == "positive":
        return advantages.clamp(min=0)
    if reinforce == "negative":
        return advantages.clamp(max=0)
    if reinforce != "all":
        raise ValueError(f"reinforce must be all, positive or negative, not {reinforce!r}")
    return advantages


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, eps_low=0.2,
              eps_high=0.2, beta=0.0, loss_agg="token-mean", num_tokens=None, token_weights=None,
              ratio_level="token", surrogate="clip", tau_pos=1.0, tau_neg=1.05):
    """Clipped-surrogate GRPO loss with an optional k3 KL penalty.

    logprobs, old_logprobs, ref_logprobs, mask: (B, T); advantages: (B,) -- one per sequence, as
    GRPO's -- or (B, T), one per token (ppo.py's GAE).
        r_t      = exp(logprobs - old_logprobs)
        L_t      = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * k3_t
        k3_t     = exp(ref - lp) - (ref - lp) - 1     (>= 0, unbiased for KL(pi || ref))
    surrogate picks the policy term in place of the clipped one: "cispo" (cispo_term) and "sapo"
    (sapo_term), which keep every token's gradient where the clip drops some.
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
    A = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, 1), or PPO's (B, T)
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
    if surrogate == "clip":
        per_token = -torch.min(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)  # (B, T)
    elif surrogate == "cispo":
        per_token = cispo_term(ratio, logprobs, A, eps_low, eps_high)  # (B, T)
    elif surrogate == "sapo":
        per_token = sapo_term(ratio, A, tau_pos, tau_neg)  # (B, T)
    else:
        raise ValueError(f"surrogate must be clip, cispo or sapo, not {surrogate!r}")
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
        if surrogate != "clip":  # (no gradient is cut: cispo clips the weight, sapo clips nothing)
            clipped_low = (ratio < 1 - eps_low) & (surrogate == "cispo")
            clipped_high = (ratio > 1 + eps_high) & (surrogate == "cispo")
        metrics = {"clip_low": float((clipped_low * mask).sum() / n),
                   "clip_high": float((clipped_high * mask).sum() / n),
                   "ratio": float((ratio * mask).sum() / n)}
        if kl is not None:
            metrics["kl"] = float((kl * mask).sum() / n)
    return loss, metrics


def cispo_term(ratio, logprobs, A, eps_low: float, eps_high: float):
    """CISPO's policy term (MiniMax-M1, Chen et al. 2025): the importance weight is clipped and
    detached, and multiplies the token's log-prob -- so every token keeps a gradient, scaled,
    where the clipped ratio drops the gradient of a token past its bound (the rare, decisive
    tokens of a reasoning chain, as the paper argues):

        L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log pi(y_t)

    ratio, logprobs: (B, T); A: (B, 1) or (B, T). MiniMax-M1 set no floor (eps_low 1) and tuned
    eps_high only. Its gradient is -clip(r_t) A grad log pi: at r = 1, the clipped loss's."""
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()  # (B, T)
    return -weight * A * logprobs  # (B, T)


def sapo_term(ratio, A, tau_pos: float, tau_neg: float):
    """SAPO's policy term (Gao et al. 2025, Soft Adaptive Policy Optimization): a smooth gate in
    place of the hard clip, steeper (tau_neg > tau_pos) for negative advantages:

        L_t = -(4 / tau) sigmoid(tau (r_t - 1)) A        tau = tau_pos if A > 0 else tau_neg

    ratio: (B, T); A: (B, 1) or (B, T). Its gradient is -4 s (1 - s) r_t A grad log pi with
    s = sigmoid(tau (r_t - 1)): the ratio's own gradient at r = 1, fading smoothly as r moves
    away -- an off-policy token is damped, never cut."""
    tau = torch.where(A > 0, tau_pos, tau_neg).expand_as(ratio)  # (B, T)
    return -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * A  # (B, T)


def unit_clashes(cfg) -> list[str]:
    """The options with which --adv-scale unit's +-1 would not be right and wrong (Config)."""
    specs = weighted(cfg.reward)
    weights = [w for _, w in specs]
    sources = len(specs) + bool(cfg.env)
    return [name for name, on in [
        ("--leave-one-out (a baseline: unit has none)", cfg.leave_one_out),
        ("--reward-model (a score of either sign)", cfg.reward_model),
        ("--judge (p(yes): always positive)", cfg.judge),
        ("--overlong-buffer (a right answer near the budget would count wrong)",
         cfg.overlong_buffer),
        ("--dynamic-sampling (it drops the all-wrong groups unit trains)", cfg.dynamic_sampling),
        ("--replay (the replayed run's rewards are not checked)", cfg.replay),
        ("--reward '' (no reward to read)", not sources),
        (f"{sources} reward sources (--reward {cfg.reward!r}"
         f"{' and the environment' if cfg.env else ''}: their sum is no verdict)", sources > 1),
        (f"a weight of 0 or less (--reward {cfg.reward!r})",
         any(w <= 0 for w in weights))] if on]  # (NaN: RLOptions names it)


# ---------------------------------------------------------------------------------------------
# DAPO's dynamic sampling: groups with a spread of rewards, refilled from fresh prompts.


def has_signal(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """(N,) True for groups whose rewards are not all equal: only those have non-zero advantages."""
    return rewards.view(-1, G).std(1) > 1e-6


def dynamic_sampling(run, problems: ProblemStream, first: Scored, cfg: Config, step: int,
                     reward_fns: RewardFunctions, grader: Grader
                     ) -> tuple[Scored, Scored, dict, list[bool]]:
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal; drop them and
    sample fresh prompts until N groups have some, for at most max_fill_rounds more rounds.
    Returns every round sampled (for the metrics), the groups to train on, refill metrics, and
    which samples of the rounds those are."""
    G, N, rounds = cfg.num_generations, cfg.prompts_per_step, [first]
    while (sum(int(has_signal(r.rewards, G).sum()) for r in rounds) < N
           and len(rounds) <= cfg.max_fill_rounds):
        rounds.append(score(start_rollout(run, problems.take(N), cfg, sampling_seed(
            cfg, step, len(rounds))), cfg, reward_fns, grader, cfg.overlong_buffer))
    kept, dropped, taken = groups_with_signal(rounds, G, N)
    return Scored.concat(rounds), kept, {"dropped_groups": dropped, "fill_rounds": len(rounds) - 1,
                                         "kept_groups": len(kept.completions) // G}, taken


def groups_with_signal(rounds: list[Scored], G: int, limit: int
                       ) -> tuple[Scored, int, list[bool]]:
    """Dynamic sampling: the first `limit` groups of the rounds that have signal, as one Scored,
    how many groups were dropped, and for every sample of the rounds whether it was taken."""
    parts, dropped, taken = [], 0, []
    for scored in rounds:
        signal = has_signal(scored.rewards, G)
        dropped += int((~signal).sum())
        chosen = signal.nonzero().flatten().tolist()[:limit - len(parts)]
        for i in chosen:
            parts.append(scored.select(list(range(i * G, (i + 1) * G))))
        taken += [g in chosen for g in range(len(scored.rewards) // G) for _ in range(G)]
    return Scored.concat(parts) if parts else rounds[0].select([]), dropped, taken


# ---------------------------------------------------------------------------------------------
# The training step: log-probs of a rollout batch under the current policy, loss, backward.


def train_on_rollout(trainer: Trainer, batch) -> dict:
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
            weights = engine_correction(batch, idx, old, mask, cfg.is_cap,
                                        stats.mismatch if update == 0 and k < real else None)
            if cfg.async_steps:  # sampled by the last step's weights: pi_old is the sampling
                old = batch.engine_logprobs[idx][:, :logprobs.shape[1]]  # policy, per the engine
            loss, metrics = grpo_loss(logprobs, old, ref_lps[k] if ref_lps else None,
                                      batch.advantages[idx], mask,
                                      eps_low=cfg.seq_eps_low if seq_level else cfg.eps_low,
                                      eps_high=cfg.seq_eps_high if seq_level else cfg.eps_high,
                                      beta=cfg.beta, loss_agg=cfg.loss_agg,
                                      num_tokens=batch.denom, token_weights=weights,
                                      ratio_level=cfg.ratio_level, surrogate=cfg.surrogate,
                                      tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg)
            if k >= real:  # an FSDP padding pass: it only keeps the ranks in step
                (loss * 0.0).backward()
                continue
            (loss * trainer.world if trainer.sharded else loss).backward()  # micro-batches add up
            stats.add(loss, metrics, entropy, mask)
            if update == 0:  # what the loss read, for the rollout log's detail rows
                stats.keep_tokens(batch, idx, logprob=logprobs, old_logprob=old, entropy=entropy,
                                  ref_logprob=ref_lps[k] if ref_lps else None)
        stats.end_update(optimizer_step(trainer, stats.update_loss))
    logprobs_after_update(trainer, batch, trained, stats)
    return stats.result()


# ---------------------------------------------------------------------------------------------
# The loop.


@one_run
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
        kept, refill = None, {}  # (which of the samples drawn are trained on: all of them)
        if session.replay:  # --replay: a saved run's samples and rewards (rollout_log.py)
            sampled, scored, kept = replayed(session, step)
        else:
            started = started or start_rollout(run, problems.take(N), cfg,
                                               sampling_seed(cfg, step, 0))
            sampled = scored = score(started, cfg, reward_fns, grader,  # all sampled / trained on
                                     cfg.overlong_buffer)
            if cfg.dynamic_sampling:  # DAPO: train on groups with a reward spread; sample more
                sampled, scored, refill, kept = dynamic_sampling(run, problems, scored, cfg,
                                                                 step, reward_fns, grader)
            # --async-steps 1: the engines sample the next step's batch while the trainers train.
            started = (start_rollout(run, problems.take(N), cfg, sampling_seed(cfg, step + 1, 0))
                       if cfg.async_steps and step < cfg.steps else None)
        lag = policy_lag(sampled.completions, step, cfg.async_steps)
        # 3. Advantages: each completion against the rest of its group. 4. Policy update.
        t0 = time.time()
        update = {"loss": 0.0, "grad_norm": 0.0, "trained_frac": 0.0, "trained_tokens": 0,
                  "skipped_updates": 0}
        batch = None
        if len(scored.completions):
            advantages = keep_sign(unit_advantages(scored.rewards) if cfg.adv_scale == "unit"
                                   else group_advantages(scored.rewards, G, scale=cfg.adv_scale,
                                                         leave_one_out=cfg.leave_one_out),
                                   cfg.reinforce)
            batch = with_detail(train_batch(scored.completions, advantages, cfg,
                                            run.tokenizer.pad_token_id, cfg.loss_agg,
                                            cfg.overlong_filter), scored.rewards, cfg)
            update = run.train(batch)
        train_seconds = time.time() - t0
        # Every sample, its advantage and what the update computed of it, to rollouts.jsonl.
        log_rollouts(session, cfg, step, sampled, batch, update.pop("token_detail", {}), kept)
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

    finish_session(session, title=f"GRPO on {cfg.data} ({cfg.model})")
    return driver.history


if __name__ == "__main__":
    # Run the importable module, not __main__: the functions Ray ships to workers (setup_trainer,
    # train_on_rollout, ...) must be grpo.*, which a worker can import.
    import grpo
    grpo.main(parse_config(grpo.Config, description=__doc__.split("\n")[0]))

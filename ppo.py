"""PPO: Proximal Policy Optimization with a critic and GAE, in one file you can read top to bottom --
what GRPO removes.

GRPO's baseline is the group: G samples of a prompt, each scored against the others. PPO's is a
second model, a critic V(s_t) that predicts, at every token, the return still to come, trained
beside the policy (Schulman et al. 2017; InstructGPT, Ouyang et al. 2022):

    r_t   = R [t = the last token] - beta (log pi(a_t | s_t) - log pi_ref(a_t | s_t))   rewards
    delta = r_t + gamma V(s_t+1) - V(s_t)                                             TD residual
    A_t   = sum_k (gamma lambda)^k delta_t+k      G_t = A_t + V(s_t)          GAE (Schulman 2016)
    L_pi  = -min(rho_t A'_t, clip(rho_t, 1 - eps, 1 + eps) A'_t)     grpo.grpo_loss, A' whitened
    L_V   = 1/2 max((V - G)^2, (clip(V, V_old +- eps_v) - G)^2)      value clip (OpenRLHF, verl)

The time steps are the model's own tokens: in an episode a tool's result is no action -- it
carries no reward, value target or advantage, and GAE passes over it as if the model's tokens
stood side by side (verl's masked GAE). R is the sample's reward (rl.score: verifiable rewards,
reward models, judges); the KL to the starting policy is a per-token reward by default
(InstructGPT; --kl-in-loss puts it in the loss as GRPO does, k3). The critic starts from the
policy's weights with a new scalar head, or from a reward model (--critic-from, InstructGPT's
choice); it has its own optimizer and learning rate, may train alone for --critic-warmup steps
before the policy moves (VAPO), and may use its own lambda (--critic-lam: VAPO's decoupled GAE).
Everything else -- engines, episodes, rewards, micro-batches, LoRA (adapters on both models, the
critic's head trained whole), Ray, checkpoints (the critic in <checkpoint>/critic), held-out
evaluation -- is the RL loop's (rl.py), as in grpo.py.

    python ppo.py                                         # CPU, offline: SmolLM2-135M learns arith
    python ppo.py --critic-from out/rm --kl-coef 0.05     # InstructGPT: the critic from the RM
    python ppo.py --data multiply --init-from out/sft     # episodes with a calculator

What this file leaves out: a shared policy-value network (two heads on one trunk), adaptive KL
control, and value normalisation.
"""

import copy
import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.distributed as dist
from tqdm import tqdm

from cli import check, parse_config
from grpo import grpo_loss
from hardware import autocast
from logprobs import length_mask, share_prompts
from model import check_reward_head, model_path, resolve
from options import RLOptions
from rl import after_update, finish_session, sampling_seed, score, start_rollout, start_session
from rl import replayed, train_batch, with_detail
from sampling import policy_lag
from session import one_run
from trainer import UpdateStats, any_rank_trains
from trainer import engine_correction, logprobs_after_update
from trainer import frozen_logprobs, micro_batches, optimizer_step, policy_logprobs
from trainer import reference_logprobs, refresh_bf16_copy, setup_trainer


@dataclass
class Config(RLOptions):
    """The RL loop's options (options.RLOptions), and PPO's:"""
    CONFIG_FILE: ClassVar[str] = "ppo_config.json"
    out: str = "out/ppo"

    # The critic and GAE
    critic_from: str = ""
    """the critic's starting weights: "" the policy's (--model / --init-from) with a new scalar head,
    or a reward model (rm.py's --out, an HF sequence-classification folder: InstructGPT's)"""
    critic_lr: float = 1e-5
    """the critic's AdamW learning rate (its own optimizer)"""
    critic_warmup: int = 0
    """steps on which the critic alone trains, before the policy moves (VAPO's value pretraining)"""
    gamma: float = 1.0
    """discount per token"""
    lam: float = 0.95
    """GAE's lambda for the policy's advantages"""
    critic_lam: float | None = None
    """GAE's lambda for the critic's returns (VAPO decouples them: 1.0); default: --lam"""
    value_clip: float = 0.2
    """the critic's new values stay within this of the old ones in the loss (0 = no clip)"""
    whiten: bool = True
    """advantages whitened over the batch's model tokens (mean 0, std 1)"""

    # The policy loss and the KL
    eps_low: float = 0.2
    """lower clip range: ratio floored at 1 - eps_low"""
    eps_high: float = 0.2
    """upper clip range: ratio capped at 1 + eps_high"""
    kl_coef: float = 0.0
    """beta: the KL penalty to the starting policy (0: none, and no reference is kept)"""
    kl_in_loss: bool = False
    """the KL as a loss term (k3, as grpo.py's --beta) instead of a per-token reward"""

    def __post_init__(self):  # impossible values stop here, before anything loads
        super().__post_init__()
        if self.critic_lam is None:
            self.critic_lam = self.lam
        for name in ("critic_lr", "critic_warmup", "value_clip", "kl_coef"):
            check(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must not be negative")
        check(0 <= self.lam <= 1 and 0 <= self.critic_lam <= 1 and 0 < self.gamma <= 1,
              "--lam and --critic-lam must be in [0, 1], --gamma in (0, 1]")
        check(0 <= self.eps_low < 1 and self.eps_high >= 0, f"--eps-low {self.eps_low} "
              f"--eps-high {self.eps_high}: need 0 <= eps-low < 1 and eps-high >= 0")
        check(not self.fsdp, "--fsdp is not supported by ppo.py (two models per trainer)")

    def reference(self) -> bool:
        return self.kl_coef != 0.0

    def workload(self):
        """The RL loop's, and the critic beside the policy: a second trained model (its own
        weights, gradients and AdamW state), from --critic-from or the policy's start."""
        critic = resolve(self.critic_from, "--critic-from") if self.critic_from else \
            model_path(self)
        return super().workload()._replace(critic=critic)

    def setup(self, resume_dir: str = "", group=None):
        """The policy's trainer, and the critic's beside it (trainer.critic): from --critic-from
        or the policy's start, a scalar head per token, its own optimizer; resumed from
        <checkpoint>/critic."""
        policy = setup_trainer(self, resume_dir, self.reference(), group)
        critic_cfg = copy.copy(self)  # (the same settings, but for where it starts and its lr)
        critic_cfg.model = self.critic_from or self.init_from or self.model
        critic_cfg.init_from, critic_cfg.lr = "", self.critic_lr
        policy.critic = setup_trainer(critic_cfg, f"{resume_dir}/critic" if resume_dir else "",
                                      False, group, head="reward")
        if not (resume_dir or self.critic_from):  # a new head predicts 0 everywhere at first:
            zero_head(policy.critic)  # the first advantages are the rewards' (lambda-decayed)
        return policy


def zero_head(critic):
    """The critic's new scalar head set to 0 (its trainable copy too, under LoRA)."""
    base = critic.model.get_base_model() if hasattr(critic.model, "peft_config") else critic.model
    with torch.no_grad():
        for p in base.score.parameters():
            p.zero_()
    refresh_bf16_copy(critic)


# ---------------------------------------------------------------------------------------------
# GAE, rewards per token, the value loss: pure functions of tensors.


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalized advantage estimation over the model's own tokens (Schulman et al. 2016).

        delta_t = r_t + gamma V_next(t) - V_t,   A_t = delta_t + gamma lam A_next(t),
        G_t = A_t + V_t

    rewards, values, mask: (B, T), mask True on the model's tokens. next(t) is the next model
    token of the row (its tool results skipped: no step); after the last one, 0 (the episode
    ends). Returns (advantages, returns), both (B, T), 0 where the mask is False."""
    advantages = torch.zeros_like(values)  # (B, T)
    running = torch.zeros_like(values[:, 0])  # (B,) A of the next model token
    next_value = torch.zeros_like(values[:, 0])  # (B,) V of the next model token
    for t in reversed(range(values.shape[1])):
        step = mask[:, t]  # (B,)
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        running = torch.where(step, delta + gamma * lam * running, running)  # (B,)
        advantages[:, t] = torch.where(step, running, torch.zeros_like(running))
        next_value = torch.where(step, values[:, t], next_value)  # (B,)
    returns = (advantages + values) * mask  # (B, T)
    return advantages, returns


def token_rewards(rewards, mask, logprobs=None, ref_logprobs=None, kl_coef: float = 0.0):
    """(B, T) per-token rewards: each sample's reward on its last model token, and the KL
    penalty -kl_coef (log pi - log pi_ref) on every model token (InstructGPT) when given.
    rewards: (B,); mask, logprobs, ref_logprobs: (B, T)."""
    T = mask.shape[1]
    last = (mask * torch.arange(1, T + 1, device=mask.device)).argmax(1)  # (B,) last model token
    out = torch.zeros(mask.shape, device=mask.device)  # (B, T)
    out[torch.arange(len(rewards)), last] = rewards.float() * mask.any(1)
    if kl_coef and ref_logprobs is not None:
        out = out - kl_coef * (logprobs - ref_logprobs) * mask  # (B, T)
    return out


def value_loss(values, old_values, returns, mask, clip: float, num_tokens: float):
    """The critic's clipped loss (PPO's; OpenRLHF, verl), summed over the mask's tokens and
    divided by num_tokens (the global batch's), so micro-batches add up:

        L_V = 1/2 max((V - G)^2, (clip(V, V_old - clip, V_old + clip) - G)^2)

    values, old_values, returns, mask: (B, T). Returns (loss, metrics summed over the tokens)."""
    mask = mask.float()  # (B, T)
    unclipped = (values - returns) ** 2  # (B, T)
    if clip:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
        per_token = 0.5 * torch.max(unclipped, clipped)  # (B, T)
        clip_frac = float(((clipped > unclipped).float() * mask).sum())
    else:
        per_token, clip_frac = 0.5 * unclipped, 0.0
    loss = (per_token * mask).sum() / num_tokens  # ()
    return loss, {"value_loss": float((per_token.detach() * mask).sum()),
                  "value_clip_frac": clip_frac,
                  "value_mean": float((values.detach() * mask).sum()),
                  "return_mean": float((returns * mask).sum())}


# ---------------------------------------------------------------------------------------------
# The critic's values, and the training step.


def token_values(critic, batch, idx, device, bf16: bool):
    """(b, T) V(s_t) for micro-batch `idx`: the critic's scalar head on the state before each
    completion token t -- position prompt_len + t - 1, the state the policy's log-prob of token t
    comes from (logprobs.completion_logprobs reads the same one) -- with a group's prompt run once
    where logprobs.share_prompts allows, as for the policy."""
    base = critic.get_base_model() if hasattr(critic, "peft_config") else critic
    decoder = getattr(base, base.base_model_prefix)
    mb = batch.select(idx)
    L = int((mb.prompt_lens + mb.completion_lens).max())  # (no padding columns it does not need)
    ids, T = mb.input_ids[:, :L], int(mb.completion_lens.max())
    rows, cols = length_mask(mb.completion_lens, T).nonzero(as_tuple=True)  # (n,) per token
    shared = share_prompts(base, ids, mb.prompt_lens, mb.completion_lens)
    with autocast(device, bf16 and next(critic.parameters()).dtype == torch.float32):
        if shared is None:  # right padding: causal attention needs no mask (completion_logprobs)
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state  # (b, L, H)
            states = hidden[rows, mb.prompt_lens[rows] + cols - 1]  # (n, H)
        else:
            hidden = shared.hidden(decoder)
            states = hidden[shared.row[rows], shared.state[rows, cols]]  # (n, H)
        values = base.score(states).squeeze(-1).float()  # (n,)
    return torch.zeros(len(idx), T, device=device).index_put((rows, cols), values)  # (b, T)


def train_on_rollout(trainer, batch) -> dict:
    """`updates_per_rollout` PPO updates on (this rank's shard of) one rollout batch. Each update
    steps the critic (its clipped value loss), then the policy (the clipped surrogate), each with
    its own optimizer; the first also makes what they train towards -- per-token rewards, the
    critic's values V_old, GAE's advantages (whitened over the global batch) and returns. The two
    losses share no weights, so their order changes nothing. Returns raw sums (UpdateStats)."""
    cfg, policy, device = trainer.cfg, trainer.compute, trainer.device
    critic, bf16 = trainer.critic, cfg.dtype == "bf16"
    batch = batch.to(device)
    keep = (batch.completion_lens > 0).nonzero().flatten()
    mbs = micro_batches(keep, batch.prompt_lens + batch.completion_lens, cfg)
    stats = UpdateStats(trainer, batch, keep)
    if not any_rank_trains(trainer, len(keep)):
        return stats.result()
    in_reward = cfg.kl_coef if not cfg.kl_in_loss else 0.0
    # pi_old, the policy that sampled: frozen before the first update where the KL reward needs it
    # or several updates move the policy; with one update and no KL reward, the current log-probs
    # (detached) are pi_old, as in grpo.py, and no extra forward runs.
    old = frozen_logprobs(policy, batch, mbs, cfg, device) \
        if cfg.updates_per_rollout > 1 or in_reward else None
    ref = reference_logprobs(trainer, batch, mbs)
    n = len(mbs)
    old_values, advantages, returns, masks, value_metrics = [None] * n, [None] * n, [None] * n, \
        [None] * n, [None] * n
    for update in range(cfg.updates_per_rollout):
        # 1. The critic: its values, with gradient. On the first update its weights are the ones
        # the rollout was valued by, so these values, detached, are V_old -- GAE's -- and no
        # separate no-grad pass is needed; later updates keep them.
        critic.compute.train()
        critic_loss = 0.0
        for k, idx in enumerate(mbs):
            values = token_values(critic.compute, batch, idx, device, bf16)  # (b, T)
            if update == 0:
                masks[k] = batch.loss_mask(idx, values.shape[1])  # (b, T) the model's tokens
                old_values[k] = values.detach()
                rewards = token_rewards(batch.rewards[idx], masks[k], old[k] if old else None,
                                        ref[k] if ref else None, in_reward)  # (b, T)
                advantages[k] = gae(rewards, old_values[k], masks[k], cfg.gamma, cfg.lam)[0]
                returns[k] = gae(rewards, old_values[k], masks[k], cfg.gamma, cfg.critic_lam)[1]
            v_loss, v_metrics = value_loss(values, old_values[k], returns[k], masks[k],
                                           cfg.value_clip, batch.denom)
            v_loss.backward()
            critic_loss += float(v_loss.detach())
            tokens = max(float(masks[k].sum()), 1.0)  # (per token, as the policy's metrics)
            value_metrics[k] = {key: v / tokens for key, v in v_metrics.items()}
        if update == 0:
            if cfg.whiten:
                advantages = whitened(advantages, masks, trainer.group)
            stats.raw["same_on_every_rank"] = {"explained_variance": explained_variance(
                returns, old_values, masks, trainer.group)}
        critic_norm = optimizer_step(critic, critic_loss)  # (None: not finite, not stepped)
        stats.raw["same_on_every_rank"]["value_grad_norm"] = \
            float("nan") if critic_norm is None else critic_norm
        # 2. The policy: grpo.py's clipped surrogate with the critic's advantages per token.
        policy.train()
        for k, idx in enumerate(mbs):
            metrics, mask = {}, masks[k]
            with torch.set_grad_enabled(batch.train_policy):  # (no graph in the critic's warm-up)
                logprobs, entropy = policy_logprobs(policy, batch, idx, cfg, device)
            pi_old = old[k] if old else logprobs.detach()  # (one update: pi_old == pi_theta)
            # (the trainer/engine mismatch metrics, with vLLM; grpo.py's --is-cap correction
            # is not offered here)
            engine_correction(batch, idx, pi_old, mask, 0.0,
                              stats.mismatch if update == 0 else None)
            if batch.train_policy:  # (not during the critic's warm-up)
                loss, metrics = grpo_loss(logprobs, pi_old, ref[k] if ref else None,
                                          advantages[k], mask, eps_low=cfg.eps_low,
                                          eps_high=cfg.eps_high,
                                          beta=cfg.kl_coef if cfg.kl_in_loss else 0.0,
                                          num_tokens=batch.denom)
                loss.backward()
            else:
                loss = torch.zeros(())
            stats.add(loss, {**metrics, **value_metrics[k]}, entropy, mask)
            if update == 0:  # what the losses read, for the rollout log's detail rows
                stats.keep_tokens(batch, idx, logprob=logprobs, old_logprob=pi_old,
                                  entropy=entropy, ref_logprob=ref[k] if ref else None,
                                  advantage=advantages[k], value=old_values[k],
                                  **{"return": returns[k]})
        stats.end_update(optimizer_step(trainer, stats.update_loss) if batch.train_policy
                         else 0.0)
    logprobs_after_update(trainer, batch, batch.completion_lens > 0, stats)
    return stats.result()


def whitened(advantages: list, masks: list, group) -> list:
    """Advantages with mean 0 and std 1 over every model token of the global batch (the ranks'
    sums all-reduced): the scale the clip range is set for."""
    sums = torch.stack([sum((a * m).sum() for a, m in zip(advantages, masks)),
                        sum(((a ** 2) * m).sum() for a, m in zip(advantages, masks)),
                        sum(m.sum() for m in masks).float()])  # (3,)
    if group is not None:
        dist.all_reduce(sums, group=group)
    mean = sums[0] / sums[2].clamp(min=1)
    std = (sums[1] / sums[2].clamp(min=1) - mean ** 2).clamp(min=0).sqrt()
    return [(a - mean) / (std + 1e-8) * m for a, m in zip(advantages, masks)]


def explained_variance(returns: list, values: list, masks: list, group) -> float:
    """1 - Var(G - V) / Var(G) over the global batch's model tokens: 1 when the critic predicts
    the returns, 0 when it does no better than their mean, < 0 when worse."""
    def moments(xs):
        return [sum((x * m).sum() for x, m in zip(xs, masks)),
                sum((x ** 2 * m).sum() for x, m in zip(xs, masks))]
    n = sum(m.sum() for m in masks).float()
    sums = torch.stack([*moments(returns), *moments([g - v for g, v in zip(returns, values)]), n])
    if group is not None:
        dist.all_reduce(sums, group=group)
    n = sums[4].clamp(min=1)
    var_g = sums[1] / n - (sums[0] / n) ** 2
    var_e = sums[3] / n - (sums[2] / n) ** 2
    return float(1 - var_e / var_g) if var_g > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# The loop: the RL loop (rl.py), with the critic's GAE in place of the group's baseline.


@one_run
def main(cfg: Config):
    if cfg.critic_from:  # no model there, or no trained head: one line, before any model loads
        check_reward_head(cfg.critic_from, "--critic-from", hint="start it from a reward model "
                          "(rm.py's --out), or leave --critic-from out (a new head on the policy)")
    session = start_session(cfg, train_on_rollout)
    run, driver, problems = session.run, session.driver, session.problems
    N, bad_steps = cfg.prompts_per_step, 0
    for step in tqdm(range(driver.step + 1, cfg.steps + 1), desc="ppo", unit="step",
                     initial=driver.step, total=cfg.steps):
        t_step = time.time()
        # 1-2. Rollout and rewards, as in GRPO (the critic makes the baseline, not the group).
        if session.replay:  # --replay: a saved run's samples and rewards (rollout_log.py)
            scored = replayed(session, step)[1]
        else:
            started = start_rollout(run, problems.take(N), cfg, sampling_seed(cfg, step, 0))
            scored = score(started, cfg, session.reward_fns, session.grader)
        # 3-4. Advantages (on the trainers: rewards per token, values, GAE) and both updates.
        t0 = time.time()
        batch = with_detail(train_batch(scored.completions, torch.zeros(len(scored.completions)),
                                        cfg, run.tokenizer.pad_token_id), scored.rewards, cfg)
        update = run.train(replace(batch, rewards=scored.rewards,
                                   train_policy=step > cfg.critic_warmup))
        train_seconds = time.time() - t0
        # 5. Every sample and what both losses computed of it (advantages per token) to the log;
        # the engines take the new weights. 6. Metrics, evaluation, samples, checkpoint.
        bad_steps = after_update(session, cfg, step, scored, batch, update, train_seconds, t_step,
                                 bad_steps, policy_lag=policy_lag(scored.completions, step, 0))
    finish_session(session, title=f"PPO on {cfg.data} ({cfg.model})",
                   loss_keys=("loss", "value_loss"))
    return driver.history


if __name__ == "__main__":
    # The importable module, not __main__: Ray ships ppo.train_on_rollout to its workers.
    import ppo
    ppo.main(parse_config(ppo.Config, description=__doc__.split("\n")[0]))

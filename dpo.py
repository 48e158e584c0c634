"""DPO: Direct Preference Optimization, in one file you can read top to bottom.

Given pairs (x, y_w, y_l) -- a prompt, a preferred ("chosen") and a dispreferred ("rejected")
response -- DPO fits the policy directly, with the frozen starting model as reference:

    h    = [log pi(y_w|x) - log ref(y_w|x)] - [log pi(y_l|x) - log ref(y_l|x)]    (Rafailov et al.)
    L    = -log sigmoid(beta * h)                                          ("sigmoid", the paper)

plus the variants in `dpo_loss`. The implicit reward of a response is beta * (log pi - log ref);
"reward accuracy" is how often the chosen response gets the higher one.

What this file leaves out on purpose: online/iterative DPO (re-sampling pairs during training),
reward-model scored pairs, and sequence packing.

    python dpo.py                      # CPU, offline: on-policy pairs from the built-in arith task
    python dpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data prefs.jsonl   # TRL-format pairs

Data: JSONL/Parquet rows or a hub dataset with `prompt`, `chosen`, `rejected`, each a string or a
list of chat messages (TRL's preference format). `--data builtin` samples several answers per
arith problem from the model itself, grades them with reward.py and pairs a correct answer (the
model's own when it has one, else the reference answer in the template's format) with an incorrect
one, so held-out task accuracy shows whether DPO helped.
"""

import random
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

from cli import check, parse_config
from data import Template, arith_heldout, load_table
from evaluate import evaluate_rows
from formats import check_pairs
from hardware import DTYPES, autocast
from logprobs import completion_logprobs, length_mask, pack
from model import full_weights, load_tokenizer, model_path
from options import ModelOptions, OfflineOptions, PairOptions, RunOptions, TrainOptions
from pairs import ANSWER_TOKENS, Pair, builtin_pairs, tokenize_pairs
from reward import Grader
from rollout import HFRollout, decoding_mode
from sampling import Sampling
from session import close_run, offline_loop, one_run, open_run, resume_driver, start_log
from trainer import export_model, optimizer_step, resume_trainer
from trainer import save_trainer, setup_trainer


# (Last base first: model, optimisation, epochs, evaluation and checkpoints, pairs.)
@dataclass
class Config(PairOptions, RunOptions, OfflineOptions, TrainOptions, ModelOptions):
    """The shared options (options.py), and DPO's:"""
    CONFIG_FILE: ClassVar[str] = "dpo_config.json"
    ADAM_BETAS: ClassVar[tuple] = (0.9, 0.999)  # (TRL's DPOTrainer's, as before the shared set-up)
    lr: float = 5e-6
    warmup_steps: int = 2
    epochs: int = 2
    out: str = "out/dpo"

    # The held-out task (builtin data)
    eval_size: int = 256
    """held-out arith problems for the task metric (builtin data only)"""

    # The DPO loss
    beta: float = 0.1
    """DPO temperature: strength of the pull towards the reference"""
    loss_type: Literal["sigmoid", "hinge", "ipo", "robust"] = "sigmoid"
    """sigmoid (DPO), hinge (SLiC), ipo (IPO, length-averaged log-probs), robust (rDPO)"""
    label_smoothing: float = 0.0
    """assumed fraction of flipped labels (cDPO for sigmoid, rDPO for robust)"""
    sft_weight: float = 0.0
    """weight of an NLL term on the chosen response (RPO); 0 turns it off"""
    reference_free: bool = False
    """use log ref = 0, i.e. no reference model"""

    def __post_init__(self):  # impossible values stop here, before anything loads
        super().__post_init__()
        check(self.eval_size >= 1, "--eval-size must be at least 1")
        check(self.sft_weight >= 0, "--sft-weight must not be negative")
        check(self.beta > 0, f"--beta {self.beta}: must be positive")
        check(0 <= self.label_smoothing < 0.5, f"--label-smoothing {self.label_smoothing}: must "
              f"be in [0, 0.5) (at 0.5 the labels carry no information)")


# ---------------------------------------------------------------------------------------------
# The loss: a pure function of summed response log-probs.


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
             beta=0.1, loss_type="sigmoid", label_smoothing=0.0):
    """Per-pair DPO losses and implicit rewards. All inputs (B,): log-probs summed over response
    tokens -- for loss_type="ipo" pass them *averaged* over response tokens (IPO's convention).

        h = (pi_c - ref_c) - (pi_r - ref_r)
        sigmoid: -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)     (eps = 0: DPO; cDPO)
        hinge:   max(0, 1 - beta h)                                        (SLiC)
        ipo:     (h - 1 / (2 beta))^2                                      (IPO)
        robust:  [-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)] / (1 - 2 eps)   (rDPO)
    Returns (losses (B,), chosen_rewards (B,), rejected_rewards (B,)), rewards = beta (pi - ref).
    """
    chosen_logratio = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratio = policy_rejected_logps - ref_rejected_logps  # (B,)
    h = chosen_logratio - rejected_logratio  # (B,)
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    else:
        raise ValueError(f"loss_type must be sigmoid, hinge, ipo or robust, not {loss_type!r}")
    chosen_rewards = beta * chosen_logratio.detach()  # (B,)
    rejected_rewards = beta * rejected_logratio.detach()  # (B,)
    return losses, chosen_rewards, rejected_rewards


# ---------------------------------------------------------------------------------------------
# Log-probs of a micro-batch of pairs: chosen and rejected in one forward pass.


def pair_logps(model, pairs, cfg, device, average=False):
    """Summed (or, with average, length-averaged) response log-probs: (chosen (B,), rejected (B,))."""
    prompts = [p.prompt for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    input_ids, prompt_lens, response_lens = pack(prompts, responses, 0, device)
    # (autocast for fp32 weights: LoRA's base; a bf16 copy computes in bf16 already)
    with autocast(device, cfg.dtype == "bf16" and next(model.parameters()).dtype == torch.float32):
        logprobs, _ = completion_logprobs(model, input_ids, prompt_lens, response_lens)  # (2B, T)
    mask = length_mask(response_lens, logprobs.shape[1])  # (2B, T): prompt tokens never count
    logps = (logprobs * mask).sum(1)  # (2B,)
    if average:
        logps = logps / response_lens
    return logps[:len(pairs)], logps[len(pairs):]


@torch.no_grad()
def reference_logps(model, pairs, cfg, device):
    """One pass over every pair with the starting model, cached, so no reference model is kept in
    memory while training."""
    average = cfg.loss_type == "ipo"
    out = []
    for s in tqdm(range(0, len(pairs), cfg.micro_batch_size), desc="reference log-probs",
                  leave=False):
        c, r = pair_logps(model, pairs[s:s + cfg.micro_batch_size], cfg, device, average)
        out += list(zip(c.tolist(), r.tolist()))
    return out


def batch_loss(model, pairs, refs, cfg, device, num_pairs):
    """Loss of a micro-batch, scaled so micro-batches of a batch of `num_pairs` add up to the
    batch mean. Returns (loss, metrics summed over the micro-batch's pairs)."""
    pc, pr = pair_logps(model, pairs, cfg, device, average=cfg.loss_type == "ipo")
    if cfg.reference_free:
        rc = rr = torch.zeros_like(pc)
    else:
        rc = torch.tensor([r[0] for r in refs], device=device)
        rr = torch.tensor([r[1] for r in refs], device=device)
    losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, beta=cfg.beta,
                                                        loss_type=cfg.loss_type,
                                                        label_smoothing=cfg.label_smoothing)
    loss = losses.sum() / num_pairs
    if cfg.sft_weight:
        chosen_lens = torch.tensor([len(p.chosen) for p in pairs], device=device)
        nll = -(pc if cfg.loss_type == "ipo" else pc / chosen_lens)  # per-token NLL, (B,)
        loss = loss + cfg.sft_weight * nll.sum() / num_pairs
    metrics = {"loss": float(losses.detach().sum()),
               "reward_accuracy": float((chosen_rewards > rejected_rewards).float().sum()),
               "reward_margin": float((chosen_rewards - rejected_rewards).sum()),
               "chosen_reward": float(chosen_rewards.sum()),
               "rejected_reward": float(rejected_rewards.sum()),
               "chosen_logp": float(pc.detach().sum()), "rejected_logp": float(pr.detach().sum())}
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# The loop.


@one_run
def main(cfg: Config):
    folder = open_run(cfg)
    # Every row is checked before the model loads: a bad file fails in a second, not a minute.
    rows = None if cfg.data == "builtin" else check_pairs(load_table(cfg.data, cfg.split),
                                                          cfg.data, cfg)
    # ... and tokenized (the tokenizer alone: a file whose pairs all exceed --max-length stops now)
    file_pairs = tokenize_pairs(load_tokenizer(model_path(cfg)), rows, cfg.data, cfg)[0] \
        if rows is not None else None
    print(f"dtype {cfg.dtype} ({cfg.dtype_reason})")
    if cfg.memory_plan:
        print(cfg.memory_plan)
    # The starting weights, also on --resume: they sample the builtin pairs and are the reference.
    trainer = setup_trainer(cfg)
    tokenizer, device = trainer.tokenizer, trainer.device
    # Built-in data: one generation engine samples the pairs and later runs the task evaluation.
    task_rows = arith_heldout(cfg.eval_size) if rows is None else []
    # (decoding as a resumed run recorded: in bf16 another choice would sample other pairs)
    rollout = HFRollout(trainer.model, tokenizer, device=device, dtype=DTYPES[cfg.dtype],
                        decode=cfg.decoding) if rows is None else None
    pairs = builtin_pairs(rollout, tokenizer, cfg) if rows is None else file_pairs
    random.Random(cfg.seed).shuffle(pairs)
    n_eval = min(cfg.eval_pairs, len(pairs) // 5)
    # The reference's log-probs, once, from the starting weights (no second model is kept).
    refs = None if cfg.reference_free else reference_logps(trainer.compute, pairs, cfg, device)
    held_out = (pairs[:n_eval], refs[:n_eval] if refs else None)
    train, train_refs = pairs[n_eval:], refs[n_eval:] if refs else None
    if folder.resume_dir:  # the checkpoint's weights, optimizer, schedule and RNG
        resume_trainer(trainer, folder.resume_dir)
    resume_driver(folder)
    start_log(folder, cfg, format_dpo_step, decoding_mode(rollout))  # ("" with a file)
    grader = Grader()
    offline_loop(folder, cfg, len(train), f"{len(train)} training pairs, {n_eval} held-out "
                 f"pairs", evaluate=held_out_evaluation(trainer, *held_out, rollout, task_rows,
                                                        cfg, grader),
                 train_step=lambda idx: train_step(trainer, [train[i] for i in idx], [
                     train_refs[i] for i in idx] if train_refs else None, cfg),
                 save=lambda checkpoint: save_trainer(trainer, checkpoint))
    grader.close()
    close_run(folder, lambda model_dir: export_model(trainer, model_dir),
              title=f"DPO on {cfg.data} ({cfg.model})", train_keys=("reward_accuracy",),
              eval_keys=("eval_accuracy", "eval_reward_accuracy"))
    return folder.driver.history


def train_step(trainer, pairs: list[Pair], refs: list | None, cfg: Config) -> dict:
    """One optimizer step on a batch of pairs, micro-batch by micro-batch (trainer.py's step:
    clipping, the non-finite guard, the bf16 copy)."""
    t0 = time.time()
    trainer.compute.train()
    sums = {}
    for s in range(0, len(pairs), cfg.micro_batch_size):
        loss, m = batch_loss(trainer.compute, pairs[s:s + cfg.micro_batch_size],
                             refs[s:s + cfg.micro_batch_size] if refs else None, cfg,
                             trainer.device, len(pairs))
        loss.backward()
        sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
    grad_norm = optimizer_step(trainer, sums["loss"])
    seconds = time.time() - t0
    tokens = sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs)
    return {**{k: v / len(pairs) for k, v in sums.items()},
            "grad_norm": float("nan") if grad_norm is None else grad_norm,
            "lr": trainer.scheduler.get_last_lr()[0], "step_seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds}


def held_out_evaluation(trainer, pairs, refs, rollout, task_rows, cfg: Config, grader):
    """The step's held-out metrics, as a function: reward accuracy and margin on the held-out
    pairs, and (builtin data) greedy accuracy on held-out arith problems."""
    def evaluate_now():
        record, t0 = {}, time.time()
        if pairs:
            trainer.compute.eval()
            with torch.no_grad():
                sums = {}
                for s in range(0, len(pairs), cfg.micro_batch_size):
                    _, m = batch_loss(trainer.compute, pairs[s:s + cfg.micro_batch_size],
                                      refs[s:s + cfg.micro_batch_size] if refs else None,
                                      cfg, trainer.device, 1)
                    sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
            record["eval_reward_accuracy"] = sums["reward_accuracy"] / len(pairs)
            record["eval_reward_margin"] = sums["reward_margin"] / len(pairs)
        if rollout:
            rollout.update_weights(full_weights(trainer.model))
            summary, _ = evaluate_rows(rollout, trainer.tokenizer, task_rows,
                                       template=cfg.template, chat=cfg.chat,
                                       sampling=Sampling(ANSWER_TOKENS, temperature=0.0), n=1,
                                       grader=grader, dataset="held-out")
            record["eval_accuracy"] = summary["avg@n"]
        record["eval_seconds"] = time.time() - t0
        return record
    return evaluate_now


def format_dpo_step(record: dict) -> str:
    shown = ("step", "loss", "reward_accuracy", "reward_margin", "chosen_logp", "rejected_logp",
             "step_seconds", "eval_reward_accuracy", "eval_accuracy")
    return " | ".join(f"{k} {record[k]:.4g}" if isinstance(record[k], float) else
                      f"{k} {record[k]}" for k in shown if k in record)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__.split("\n")[0]))

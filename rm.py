"""Reward modelling: a score per response, learned from preference pairs, in one file you can read
top to bottom.

A reward model r(x, y) is the policy's decoder with its language-model head replaced by one
linear layer to a single number, read at the last token of prompt + response. Given pairs
(x, y_c, y_r) -- a prompt, a preferred ("chosen") and a dispreferred ("rejected") response -- it
is fitted so that the chosen scores higher, the Bradley-Terry model of a human's choice
(Stiennon et al. 2020; Ouyang et al. 2022, InstructGPT's second stage):

    P(y_c > y_r | x) = sigmoid(r(x, y_c) - r(x, y_r))
    L = -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2

m is a pair's margin (TRL's optional `margin` column: how much more the chosen must score) and c
--center-rewards-coefficient (TRL's; Eisenstein et al. 2023): it keeps the scores near 0, which
their difference alone never does. Pair accuracy is how often r_c > r_r.

    python rm.py                     # CPU, offline: the default model's own arith answers, a right
                                     # one preferred to a wrong one (the pairs dpo.py trains on)
    python rm.py --model Qwen/Qwen2.5-0.5B-Instruct --data prefs.jsonl --steps 200 --out out/rm
    python grpo.py --reward-model out/rm     # then GRPO optimises it (docs/reward-models.md)

Data: TRL's preference format (formats.py), explicit prompt or implicit, plain or conversational,
a file or a hub dataset. A sequence is the conversation as the model's chat template renders it,
whole, its last turn closed even where the response was cut: rendered and scored by the very
functions grpo.py's --reward-model reads a completion with (reward_models.reward_model_ids and
reward_models.scores), so that the model scores what it learned on. <out>/model/ is an HF
AutoModelForSequenceClassification folder (num_labels 1, its tokenizer and chat template beside
it) that transformers and TRL load as it is. What this file leaves out: rankings of more
than two responses, ensembles, and a value per token (ppo.py's critic).
"""

import random
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from jinja2 import TemplateError

from cli import check, parse_config
from data import InputError, load_table
from formats import check_pairs
from hardware import DTYPES
from model import load_model, load_tokenizer, model_path
from options import ModelOptions, OfflineOptions, PairOptions, RunOptions, TrainOptions
from pairs import Pair, builtin_pairs
from reward_models import common_prefix, reward_model_ids, scores
from rollout import HFRollout, decoding_mode
from session import close_run, offline_loop, one_run, open_run, resume_driver, start_log
from trainer import export_model, optimizer_step, resume_trainer
from trainer import save_trainer, setup_trainer


# (Last base first: model, optimisation, epochs, evaluation and checkpoints, pairs.)
@dataclass
class Config(PairOptions, RunOptions, OfflineOptions, TrainOptions, ModelOptions):
    """The shared options (options.py), and the reward model's:"""
    CONFIG_FILE: ClassVar[str] = "rm_config.json"
    HEAD: ClassVar[str] = "reward"  # trainer.setup_trainer loads a scalar head
    ADAM_BETAS: ClassVar[tuple] = (0.9, 0.999)  # (TRL's RewardTrainer's)
    lr: float = 2e-5
    warmup_steps: int = 2
    out: str = "out/rm"
    eval_pairs: int = 64
    builtin_problems: int = 128

    # The reward model's pairs: a margin, and the builtin set's chosen answers
    margin_field: str = "margin"
    """an optional column of margins: how much more the chosen must score (TRL's); 0 without it;
    without a prompt column, the prompt is implicit"""
    builtin_corrected: bool = True
    """builtin set: where the model never got a problem right, prefer its wrong answer with the
    number corrected (the two differ in correctness alone) to the wrong answer, not the reference
    answer (which differs in form too: a model learns the form, docs/reward-models.md)"""

    # The loss
    center_rewards_coefficient: float = 0.0
    """c of c (r_c + r_r)^2: pulls the scores towards 0 (TRL's; 0 turns it off)"""

    def __post_init__(self):  # impossible values stop here, before anything loads
        super().__post_init__()
        check(self.center_rewards_coefficient >= 0, "--center-rewards-coefficient must not be "
              "negative")

    def workload(self):
        """The pairs' (options.PairOptions), the builtin pairs' sampler freed before training."""
        return super().workload()._replace(engine_freed=True)


# ---------------------------------------------------------------------------------------------
# The loss: a pure function of the two scores of each pair.


def reward_loss(chosen, rejected, margin=None, center_coefficient: float = 0.0):
    """Bradley-Terry loss per pair, and what it tells:

        L = -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2

    chosen, rejected, margin: (B,) scores of each pair's responses, its margin (None: 0).
    Returns (losses (B,), metrics summed over the pairs: accuracy, the margin r_c - r_r, and the
    mean scores' sums)."""
    gap = chosen - rejected  # (B,)
    losses = -F.logsigmoid(gap - (0.0 if margin is None else margin))  # (B,)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2  # (B,)
    metrics = {"accuracy": float((gap > 0).float().sum()), "margin": float(gap.detach().sum()),
               "chosen_reward": float(chosen.detach().sum()),
               "rejected_reward": float(rejected.detach().sum())}
    return losses, metrics


# ---------------------------------------------------------------------------------------------
# Pairs as the reward model reads them, and their scores: one forward over a micro-batch's chosen
# and rejected sequences (reward_models.scores, the scorer --reward-model scores with), each pair's
# common prefix (its prompt at least) run once.


def reward_pairs(tokenizer, rows: list[dict], source: str, cfg: Config) -> list[Pair]:
    """Each row's chosen and rejected conversations (check_pairs' rows, or the builtin pairs'
    `.row`) as the reward model reads them: reward_models.reward_model_ids, whole, every turn
    closed -- the form it will be scored in. A Pair's prompt is what the two sequences share up to
    the prompt's end. A pair longer than --max-length loses prompt tokens from the start, down to
    --max-prompt-length, then a response still too long is cut at a token of its content and its
    turn closed again by the template: the form a policy's completion cut at --max-new-tokens is
    scored in. A pair whose prompt leaves no room for a response is skipped, and counted."""
    pairs, skipped = [], 0
    for i, row in enumerate(rows, start=1):
        try:
            pair = _rendered_pair(tokenizer, row, cfg)
        except TemplateError as e:  # (e.g. a template that wants user and assistant to alternate)
            raise InputError(f"{source}: row {i}: the chat template cannot render it "
                             f"({e})") from None
        skipped += pair is None
        pairs += [pair] if pair is not None else []
    if skipped:
        print(f"{source}: skipped {skipped} of {len(rows)} pairs whose prompt leaves no room for a "
              f"response in --max-length {cfg.max_length}")
    if not pairs:
        raise InputError(f"{source}: no usable pairs (all {skipped} prompts leave no room for a "
                         f"response in --max-length {cfg.max_length})")
    return pairs


def _rendered_pair(tokenizer, row: dict, cfg: Config) -> Pair | None:
    prompt = row["prompt"] if isinstance(row["prompt"], list) else \
        [{"role": "user", "content": row["prompt"]}] if row["prompt"] else []  # ("": implicit)
    prompt_len = len(reward_model_ids(tokenizer, prompt)) if prompt else 0
    if prompt_len >= cfg.max_length:
        return None
    turns = [row[k] if isinstance(row[k], list) else [{"role": "assistant", "content": row[k]}]
             for k in ("chosen", "rejected")]
    both, cut = [reward_model_ids(tokenizer, prompt + t) for t in turns], 0
    if max(map(len, both)) > cfg.max_length:
        cut = max(0, prompt_len - cfg.max_prompt_length)  # prompt tokens dropped from the start
        both = [_fitted(tokenizer, prompt, t, cfg.max_length + cut) for t in turns]
        if None in both:
            return None
        both = [ids[cut:] for ids in both]
    chosen, rejected = both
    n = min(prompt_len - cut, common_prefix(chosen, rejected))
    return Pair(chosen[:n], chosen[n:], rejected[n:], row.get("margin", 0.0))


def _fitted(tokenizer, prompt: list[dict], turns: list[dict], limit: int) -> list[int] | None:
    """reward_model_ids of prompt + turns in at most `limit` tokens: the first turn that does not
    fit cut at a token of its content (the template closes it again), the turns after it dropped;
    None where not even an empty first turn fits."""
    whole = reward_model_ids(tokenizer, prompt + turns)
    if len(whole) <= limit:
        return whole
    j = next(j for j in range(len(turns))
             if len(reward_model_ids(tokenizer, prompt + turns[:j + 1])) > limit)
    content = tokenizer(turns[j]["content"], add_special_tokens=False)["input_ids"]

    def kept(k: int) -> list[int]:  # the turn's first k tokens of content, closed
        return reward_model_ids(tokenizer, prompt + turns[:j] + [
            {**turns[j], "content": tokenizer.decode(content[:k])}])

    if len(kept(0)) > limit:  # (not even the turn's frame fits: the turns before it, if any)
        return reward_model_ids(tokenizer, prompt + turns[:j]) if j else None
    lo, hi = 0, len(content)  # kept(lo) fits, kept(hi) does not: bisect
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(kept(mid)) <= limit else (lo, mid)
    return kept(lo)


def pair_sequences(pairs: list[Pair]):
    """A micro-batch's 2B sequences (its chosen, then its rejected) and how many first tokens each
    has in common with the other of its pair: the prompt, and often the start of both responses
    (pairs that differ in their last sentence), which scores then runs once."""
    chosen = [p.prompt + p.chosen for p in pairs]
    rejected = [p.prompt + p.rejected for p in pairs]
    common = [common_prefix(c, r) for c, r in zip(chosen, rejected)]
    return chosen + rejected, common + common


def batch_loss(model, pairs: list[Pair], cfg: Config, device: str, pad_id: int,
               num_pairs: int):
    """A micro-batch's loss, scaled so that micro-batches of a batch of num_pairs add up to the
    batch's mean; and its metrics, summed over its pairs."""
    seqs, shared_lens = pair_sequences(pairs)
    both = scores(model, seqs, device, pad_id, cfg.dtype == "bf16", shared_lens)  # (2B,)
    chosen, rejected = both[:len(pairs)], both[len(pairs):]  # (B,), (B,)
    margin = torch.tensor([p.margin for p in pairs], device=device)  # (B,)
    losses, metrics = reward_loss(chosen, rejected, margin, cfg.center_rewards_coefficient)
    return losses.sum() / num_pairs, {"loss": float(losses.detach().sum()), **metrics}


def train_step(trainer, pairs: list[Pair], cfg: Config) -> dict:
    """One optimizer step on a batch of pairs (trainer.py's: clipping, the non-finite guard)."""
    t0 = time.time()
    trainer.compute.train()
    sums, pad = {}, trainer.tokenizer.pad_token_id
    for s in range(0, len(pairs), cfg.micro_batch_size):
        loss, m = batch_loss(trainer.compute, pairs[s:s + cfg.micro_batch_size], cfg,
                             trainer.device, pad, len(pairs))
        loss.backward()
        sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
    grad_norm = optimizer_step(trainer, sums["loss"])
    seconds = time.time() - t0
    # Every token of the 2B sequences scored (as TRL's num_tokens counts them), whether a pair's
    # shared prefix ran once or twice
    tokens = sum(map(len, pair_sequences(pairs)[0]))
    return {**{k: v / len(pairs) for k, v in sums.items()},
            "grad_norm": float("nan") if grad_norm is None else grad_norm,
            "lr": trainer.scheduler.get_last_lr()[0], "step_seconds": seconds,
            "tokens": tokens, "tokens_per_s": tokens / seconds}


def held_out_evaluation(trainer, pairs: list[Pair], cfg: Config):
    """The held-out pairs' accuracy, margin, scores and loss, as a function of no arguments."""
    def evaluate_now() -> dict:
        t0, sums = time.time(), {}
        trainer.compute.eval()
        with torch.no_grad():
            for s in range(0, len(pairs), cfg.micro_batch_size):
                _, m = batch_loss(trainer.compute, pairs[s:s + cfg.micro_batch_size], cfg,
                                  trainer.device, trainer.tokenizer.pad_token_id, 1)
                sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
        return {**{f"eval_{k}": v / max(len(pairs), 1) for k, v in sums.items()},
                "eval_seconds": time.time() - t0}
    return evaluate_now


# ---------------------------------------------------------------------------------------------
# The loop.


@one_run
def main(cfg: Config):
    folder = open_run(cfg)
    # Every row is checked, and rendered, before the model loads: a bad file fails in a second.
    pairs = None if cfg.data == "builtin" else reward_pairs(
        load_tokenizer(model_path(cfg)), check_pairs(load_table(cfg.data, cfg.split), cfg.data,
                                                     cfg, need_prompt=False,
                                                     margin_field=cfg.margin_field), cfg.data, cfg)
    print(f"dtype {cfg.dtype} ({cfg.dtype_reason})")
    if cfg.memory_plan:
        print(cfg.memory_plan)
    trainer = setup_trainer(cfg)  # (a resumed run's state comes after its pairs are made)
    tokenizer = trainer.tokenizer
    decoding = ""  # (how the builtin pairs were sampled: a resumed run samples them alike)
    if pairs is None:  # the starting model's own answers, sampled as dpo.py samples them
        sampler = HFRollout(load_model(cfg.model, trainer.device, DTYPES[cfg.dtype])[0],
                            tokenizer, device=trainer.device, dtype=DTYPES[cfg.dtype],
                            shares_weights=True, decode=cfg.decoding)  # (as dpo.py's)
        rows = [p.row for p in builtin_pairs(sampler, tokenizer, cfg, cfg.builtin_corrected)]
        decoding = decoding_mode(sampler)
        del sampler
        pairs = reward_pairs(tokenizer, rows, "builtin pairs", cfg)
    random.Random(cfg.seed).shuffle(pairs)
    n_eval = min(cfg.eval_pairs, len(pairs) // 5)
    held_out, train = pairs[:n_eval], pairs[n_eval:]
    if folder.resume_dir:
        resume_trainer(trainer, folder.resume_dir)
    resume_driver(folder)
    start_log(folder, cfg, format_rm_step, decoding)
    offline_loop(folder, cfg, len(train), f"{len(train)} training pairs, {n_eval} held-out pairs",
                 train_step=lambda idx: train_step(trainer, [train[i] for i in idx], cfg),
                 evaluate=held_out_evaluation(trainer, held_out, cfg),
                 save=lambda checkpoint: save_trainer(trainer, checkpoint))
    close_run(folder, lambda model_dir: export_model(trainer, model_dir),
              title=f"reward model on {cfg.data} ({cfg.model})", train_keys=("accuracy",),
              eval_keys=("eval_accuracy",), loss_keys=("loss", "eval_loss"))
    return folder.driver.history


def format_rm_step(r: dict) -> str:
    shown = ("step", "loss", "accuracy", "margin", "chosen_reward", "rejected_reward",
             "tokens_per_s", "eval_accuracy", "eval_margin")
    return " | ".join(f"{k} {r[k]:.4g}" if isinstance(r[k], float) else f"{k} {r[k]}"
                      for k in shown if k in r)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__.split("\n")[0]))

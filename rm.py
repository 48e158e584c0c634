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
a file or a hub dataset; a sequence is the conversation as the model's chat template renders it,
whole (what grpo.py's --reward-model renders to score a completion, as TRL does). <out>/model/ is
an HF AutoModelForSequenceClassification folder (num_labels 1, its tokenizer and chat template
beside it) that transformers and TRL load as it is. What this file leaves out: rankings of more
than two responses, ensembles, and a value per token (ppo.py's critic).
"""

import random
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from data import Template, check, load_table, parse_config
from formats import check_pairs
from model import DTYPES, autocast, load_model, right_pad, share_prompts
from options import ModelOptions, OfflineOptions, PairOptions, RunOptions, TrainOptions
from pairs import Pair, builtin_pairs, tokenize_pairs
from rollout import HFRollout
from session import close_run, offline_loop, open_run, resume_driver, start_log
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
# Scores: one forward over a micro-batch's chosen and rejected sequences, each pair's common
# prefix (its prompt at least) run once.


def sequence(pair_prompt: list[int], response: list[int], suffix: list[int], pad_id) -> list[int]:
    """A pair's response as the reward model reads it: after its prompt, and, where it ends its
    turn, followed by what the chat template writes after a turn (`suffix`: ChatML's newline) --
    so that the sequence is the conversation as rendered whole. The score is read at its last
    token, which is never the pad token (transformers' head finds the last token by it)."""
    ids = pair_prompt + response + (suffix if suffix and response[-1:] != suffix[-1:] else [])
    while len(ids) > 1 and ids[-1] == pad_id:
        ids = ids[:-1]
    return ids


def turn_suffix(tokenizer) -> list[int]:
    """The tokens the chat template puts after an assistant turn's end-of-turn token."""
    if not tokenizer.chat_template:
        return []
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"},
                                          {"role": "assistant", "content": "y"}], tokenize=False)
    after = text[text.rindex(tokenizer.eos_token) + len(tokenizer.eos_token):]
    return tokenizer(after, add_special_tokens=False)["input_ids"] if after else []


def scores(model, sequences: list[list[int]], device: str, pad_id: int, bf16: bool,
           shared_lens: list[int] | None = None):
    """(B,) the reward model's score of each sequence: the decoder's state at its last token (found
    from its length, not from the pad), through the scalar head. bf16: the run computes in bf16
    (autocast where the weights are fp32: LoRA's base). shared_lens: (B,) how many first tokens
    each sequence has in common with another of the batch (a pair's prompt, and the start its two
    responses share): those then run once (model.share_prompts), where the model is verified to
    allow it; without them, or where it is not, every sequence runs in its own padded row."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    decoder = getattr(base, base.base_model_prefix)
    B = len(sequences)
    lengths = torch.tensor([len(s) for s in sequences])  # (B,)
    # share_prompts hands back the state that *predicts* each completion token, never the last
    # token's own; so each sequence gets one dummy token (the pad) after it, and the state that
    # predicts the dummy is the last real token's. Causal attention: it changes no state before it.
    ids = right_pad([s + [pad_id] for s in sequences], pad_id)  # (B, L + 1)
    shared = None
    if shared_lens is not None:
        # (at least one token, so the first completion token has a state to predict it)
        prompt_lens = torch.tensor([min(max(n, 1), len(s))
                                    for n, s in zip(shared_lens, sequences)])  # (B,)
        shared = share_prompts(base, ids, prompt_lens, lengths + 1 - prompt_lens)
    with autocast(device, bf16 and next(model.parameters()).dtype == torch.float32):
        if shared is None:
            # Right padding needs no attention mask: causal attention never looks at the later pad,
            # positions 0..L-1 are already right, and SDPA keeps its fast causal kernel (a padding
            # mask makes transformers build an (L, L) mask per row). No KV cache to build.
            hidden = decoder(input_ids=ids[:, :-1].to(device),  # (the rows without the dummy)
                             use_cache=False).last_hidden_state  # (B, L, H)
            last = hidden[torch.arange(B, device=device), lengths.to(device) - 1]  # (B, H)
        else:  # each distinct prefix once, then each sequence's own rest and its dummy
            hidden = shared.hidden(decoder)
            # hidden: (R, L', H), one row per distinct prefix
            dummy = (lengths - prompt_lens).to(device)  # (B,) its index in the "completion"
            state = shared.state[torch.arange(B, device=device), dummy]  # (B,) predicts it
            last = hidden[shared.row, state]  # (B, H)
        return base.score(last).squeeze(-1).float()  # (B,)


def pair_sequences(pairs: list[Pair], suffix: list[int], pad_id: int):
    """A micro-batch's 2B sequences (its chosen, then its rejected) and how many first tokens each
    has in common with the other of its pair: the prompt, and often the start of both responses
    (pairs that differ in their last sentence), which scores then runs once."""
    chosen = [sequence(p.prompt, p.chosen, suffix, pad_id) for p in pairs]
    rejected = [sequence(p.prompt, p.rejected, suffix, pad_id) for p in pairs]
    common = [next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r)))
              for c, r in zip(chosen, rejected)]
    return chosen + rejected, common + common


def batch_loss(model, pairs: list[Pair], cfg: Config, device: str, pad_id: int,
               suffix: list[int], num_pairs: int):
    """A micro-batch's loss, scaled so that micro-batches of a batch of num_pairs add up to the
    batch's mean; and its metrics, summed over its pairs."""
    seqs, shared_lens = pair_sequences(pairs, suffix, pad_id)
    both = scores(model, seqs, device, pad_id, cfg.dtype == "bf16", shared_lens)  # (2B,)
    chosen, rejected = both[:len(pairs)], both[len(pairs):]  # (B,), (B,)
    margin = torch.tensor([p.margin for p in pairs], device=device)  # (B,)
    losses, metrics = reward_loss(chosen, rejected, margin, cfg.center_rewards_coefficient)
    return losses.sum() / num_pairs, {"loss": float(losses.detach().sum()), **metrics}


def train_step(trainer, pairs: list[Pair], cfg: Config, suffix: list[int]) -> dict:
    """One optimizer step on a batch of pairs (trainer.py's: clipping, the non-finite guard)."""
    t0 = time.time()
    trainer.compute.train()
    sums, pad = {}, trainer.tokenizer.pad_token_id
    for s in range(0, len(pairs), cfg.micro_batch_size):
        loss, m = batch_loss(trainer.compute, pairs[s:s + cfg.micro_batch_size], cfg,
                             trainer.device, pad, suffix, len(pairs))
        loss.backward()
        sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
    grad_norm = optimizer_step(trainer, sums["loss"])
    seconds = time.time() - t0
    # Every token of the 2B sequences scored (as TRL's num_tokens counts them), whether a pair's
    # shared prefix ran once or twice
    tokens = sum(map(len, pair_sequences(pairs, suffix, pad)[0]))
    return {**{k: v / len(pairs) for k, v in sums.items()},
            "grad_norm": float("nan") if grad_norm is None else grad_norm,
            "lr": trainer.scheduler.get_last_lr()[0], "step_seconds": seconds,
            "tokens": tokens, "tokens_per_s": tokens / seconds}


def held_out_evaluation(trainer, pairs: list[Pair], cfg: Config, suffix: list[int]):
    """The held-out pairs' accuracy, margin, scores and loss, as a function of no arguments."""
    def evaluate_now() -> dict:
        t0, sums = time.time(), {}
        trainer.compute.eval()
        with torch.no_grad():
            for s in range(0, len(pairs), cfg.micro_batch_size):
                _, m = batch_loss(trainer.compute, pairs[s:s + cfg.micro_batch_size], cfg,
                                  trainer.device, trainer.tokenizer.pad_token_id, suffix, 1)
                sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
        return {**{f"eval_{k}": v / max(len(pairs), 1) for k, v in sums.items()},
                "eval_seconds": time.time() - t0}
    return evaluate_now


# ---------------------------------------------------------------------------------------------
# The loop.


def main(cfg: Config):
    folder = open_run(cfg)
    # Every row is checked before the model loads: a bad file fails in a second, not a minute.
    rows = None if cfg.data == "builtin" else check_pairs(
        load_table(cfg.data, cfg.split), cfg.data, cfg, need_prompt=False,
        margin_field=cfg.margin_field)
    print(f"dtype {cfg.dtype} ({cfg.dtype_reason})")
    if cfg.memory_plan:
        print(cfg.memory_plan)
    trainer = setup_trainer(cfg)  # (a resumed run's state comes after its pairs are made)
    tokenizer = trainer.tokenizer
    if rows is None:  # the starting model's own answers, sampled as dpo.py samples them
        sampler = HFRollout(load_model(cfg.model, trainer.device, DTYPES[cfg.dtype])[0],
                            tokenizer, device=trainer.device, dtype=DTYPES[cfg.dtype],
                            shares_weights=True)
        pairs = builtin_pairs(sampler, tokenizer, cfg, cfg.builtin_corrected)
        del sampler
    else:
        pairs = tokenize_pairs(tokenizer, rows, cfg.data, cfg)[0]
    random.Random(cfg.seed).shuffle(pairs)
    n_eval = min(cfg.eval_pairs, len(pairs) // 5)
    held_out, train, suffix = pairs[:n_eval], pairs[n_eval:], turn_suffix(tokenizer)
    if folder.resume_dir:
        resume_trainer(trainer, folder.resume_dir)
    resume_driver(folder)
    start_log(folder, cfg, line=format_rm_step)
    offline_loop(folder, cfg, len(train), f"{len(train)} training pairs, {n_eval} held-out pairs",
                 train_step=lambda idx: train_step(trainer, [train[i] for i in idx], cfg, suffix),
                 evaluate=held_out_evaluation(trainer, held_out, cfg, suffix),
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

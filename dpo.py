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

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

from checkpoint import DriverState, find_checkpoint, load_driver_state, load_trainer_state
from checkpoint import claim_checkpoints, recorded_dtype, save_checkpoint, save_trainer_state
from data import InputError, TEMPLATES, arith_heldout, arith_stream, encode_prompts, load_table
from data import Template, check, epoch_batches, flag, parse_config
from evaluate import TRACKERS, RunLog, evaluate_rows, plot_curves
from model import DEFAULT_MODEL, autocast, completion_logprobs, length_mask, load_model, pack
from model import adamw_with_warmup, add_lora, check_head_logits, full_state_dict, full_weights
from model import load_adapters
from model import DTYPES, choose_dtype, pick_device, save_model, source_dtype
from reward import Grader, extract_answer
from rollout import HFRollout, Sampling


@dataclass
class Config:
    model: str = DEFAULT_MODEL
    """policy to train (and, frozen, the reference): offline default, hub id or local HF folder"""
    data: str = "builtin"
    """`builtin` (on-policy arith pairs), a .jsonl/.json/.csv/.parquet file, or a hub dataset id"""
    prompt_field: str = "prompt"
    """the data's prompt column (a string or chat messages)"""
    chosen_field: str = "chosen"
    """the data's preferred-response column"""
    rejected_field: str = "rejected"
    """the data's dispreferred-response column"""
    split: str = ""
    """hub datasets: the split (default: train)"""
    eval_pairs: int = 32
    """preference pairs held out to measure reward accuracy on data the model never trained on"""
    template: Template = "answer-is"
    """prompt template for the builtin pairs and the held-out task evaluation"""
    chat: bool = True
    """wrap string prompts in the model's chat template"""
    builtin_problems: int = 256
    """builtin set: arith problems to sample answers for"""
    builtin_samples: int = 4
    """builtin set: answers sampled per problem (temperature 0.7)"""
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
    lr: float = 5e-6
    """AdamW learning rate (constant after warmup)"""
    warmup_steps: int = 2
    """linear learning-rate warmup steps"""
    epochs: int = 2
    """passes over the training pairs"""
    steps: int = 0
    """optimizer steps in all, overriding --epochs (TRL's max_steps): the pairs are gone through
    again, reshuffled, as often as it takes (0 = --epochs' worth)"""
    batch_size: int = 16
    """pairs per optimizer step"""
    micro_batch_size: int = 8
    """pairs per forward/backward (chosen and rejected go through one forward together)"""
    max_length: int = 512
    """prompt + response tokens; longer pairs lose prompt tokens first, then response tokens"""
    max_prompt_length: int = 256
    """prompt tokens kept (from the end) when a pair is too long"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    eval_every: int = 5
    """held-out evaluation every N steps, at step 0 and at the end (0 = never)"""
    eval_size: int = 256
    """held-out arith problems for the task metric (builtin data only)"""
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """compute dtype (master weights stay fp32; bf16 by autocast); auto: bf16 where the hardware
    has it natively, else fp32 (model.choose_dtype, printed)"""
    lora_rank: int = 0
    """LoRA (peft): train rank-R adapters only (0 = full fine-tuning); the reference stays the base"""
    lora_alpha: int = 0
    """LoRA scale numerator (0 = 2 * rank)"""
    lora_targets: str = "all-linear"
    """LoRA: the modules adapted (comma-separated names, or all-linear)"""
    save_every: int = 0
    """write <out>/checkpoints/step_N every N steps (0 = never); the format is checkpoint.py's"""
    keep_last: int = 2
    """checkpoints kept (the oldest are deleted); 0 keeps all"""
    resume: str = ""
    """continue a run exactly: `auto` (latest checkpoint in --out) or a checkpoint folder"""
    report_to: str = ""
    """also log metrics to: tensorboard, wandb (comma-separated; pip install them first)"""
    seed: int = 0
    """seed for sampling, data order and splits"""
    out: str = "out/dpo"
    """output folder: metrics.jsonl, curves.png, checkpoints/, the final model in model/"""

    def __post_init__(self):  # impossible values stop here, before anything loads
        # auto -> what computes fastest here; a resumed run keeps the dtype it recorded
        choice = choose_dtype(self.dtype, pick_device(),
                              recorded_dtype(self.out, self.resume, "dpo_config.json"))
        self.dtype, self.dtype_reason = choice.name, choice.reason
        for name in ("epochs", "batch_size", "micro_batch_size", "max_length",
                     "max_prompt_length", "builtin_problems", "eval_size"):
            check(getattr(self, name) >= 1, f"{flag(name)} must be at least 1")
        for name in ("eval_pairs", "steps", "lr", "warmup_steps", "eval_every", "sft_weight",
                     "save_every",
                     "keep_last", "lora_rank", "lora_alpha"):
            check(getattr(self, name) >= 0, f"{flag(name)} must not be negative")
        check(self.builtin_samples >= 2, "--builtin-samples must be at least 2 (a pair needs two "
              "answers)")
        check(self.beta > 0, f"--beta {self.beta}: must be positive")
        check(0 <= self.label_smoothing < 0.5, f"--label-smoothing {self.label_smoothing}: must "
              f"be in [0, 0.5) (at 0.5 the labels carry no information)")
        check(self.max_grad_norm > 0, "--max-grad-norm must be positive")
        check(all(n in TRACKERS for n in self.report_to.split(",") if n), f"--report-to "
              f"{self.report_to}: choose from {', '.join(TRACKERS)} (comma-separated)")


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
# Pairs: tokenised (prompt, chosen, rejected), from a file or sampled from the model itself.


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def _chat_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _text_response(tokenizer, text: str) -> list[int]:
    """A plain-string response, closed with the end-of-turn token the model must learn to emit."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _response_ids(tokenizer, prompt, prompt_ids, response) -> list[int]:
    """Token ids of `response` (a string or assistant messages) as it follows the prompt."""
    if isinstance(response, list) and isinstance(prompt, list):
        # Render the whole conversation and take what follows the prompt, up to end-of-turn.
        full = _chat_ids(tokenizer, prompt + response)
        if full[:len(prompt_ids)] == prompt_ids:
            tail = full[len(prompt_ids):]
            if tokenizer.eos_token_id in tail:
                tail = tail[:tail.index(tokenizer.eos_token_id) + 1]
            return tail
    if isinstance(response, list):
        response = "".join(m.get("content", "") for m in response if isinstance(m, dict))
    return _text_response(tokenizer, response)


def check_pairs(rows, source, cfg) -> list[dict]:
    """Every row, before any model loads: {prompt, chosen, rejected} from the configured columns,
    each a non-empty string or a list of {role, content} messages (TRL's preference format)."""
    out = []
    for i, row in enumerate(rows, start=1):
        pair = {}
        for key, field in (("prompt", cfg.prompt_field), ("chosen", cfg.chosen_field),
                           ("rejected", cfg.rejected_field)):
            value = row.get(field) if isinstance(row, dict) else None
            if not value or (isinstance(value, str) and not value.strip()):
                raise InputError(f"{source}: row {i} has no '{field}' field (or it is empty)")
            if isinstance(value, list) and not all(
                    isinstance(m, dict) and m.get("role") and isinstance(m.get("content"), str)
                    for m in value):
                raise InputError(f"{source}: row {i}: '{field}' is a list but not of "
                                 f"{{'role', 'content'}} messages")
            pair[key] = value
        out.append(pair)
    return out


def tokenize_pairs(tokenizer, rows, source, cfg):
    """Pairs of token ids from check_pairs' rows. Over-long pairs lose prompt tokens (from the
    left) down to max_prompt_length, then response tokens; a pair whose prompt alone is too long
    is skipped and counted."""
    pairs, skipped = [], 0
    for row in rows:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            prompt_ids = _chat_ids(tokenizer, prompt, add_generation_prompt=True)
        elif cfg.chat and tokenizer.chat_template:
            prompt_ids = _chat_ids(tokenizer, [{"role": "user", "content": prompt}], True)
        else:
            prompt_ids = tokenizer(prompt)["input_ids"]
        if len(prompt_ids) >= cfg.max_length:
            skipped += 1
            continue
        chosen = _response_ids(tokenizer, prompt, prompt_ids, row["chosen"])
        rejected = _response_ids(tokenizer, prompt, prompt_ids, row["rejected"])
        if len(prompt_ids) + max(len(chosen), len(rejected)) > cfg.max_length:
            prompt_ids = prompt_ids[-cfg.max_prompt_length:]
            room = cfg.max_length - len(prompt_ids)
            chosen, rejected = chosen[:room], rejected[:room]
        pairs.append(Pair(prompt_ids, chosen, rejected))
    if skipped:
        print(f"{source}: skipped {skipped} of {len(rows)} pairs whose prompt alone is longer "
              f"than --max-length {cfg.max_length}")
    if not pairs:
        raise InputError(f"{source}: no usable pairs (all {skipped} prompts exceed --max-length)")
    return pairs, skipped


def builtin_pairs(rollout, tokenizer, cfg):
    """On-policy pairs from the arith task: the model's own wrong answer is rejected; its own right
    answer is chosen when it has one, else the reference answer in the template's format."""
    stream = arith_stream(cfg.seed + 1)
    problems = [next(stream) for _ in range(cfg.builtin_problems)]
    prompt_ids = encode_prompts(tokenizer, problems, cfg.template, cfg.chat)
    n = cfg.builtin_samples
    comps = rollout.generate(prompt_ids, n, Sampling(32, temperature=0.7, seed=cfg.seed))
    fmt = TEMPLATES[cfg.template][1]
    grader = Grader()
    correct = grader.grade([extract_answer(t, fmt) for t in comps.text],
                           [p["answer"] for p in problems for _ in range(n)])
    grader.close()
    pairs, own_chosen = [], 0
    for i, problem in enumerate(problems):
        group = range(i * n, (i + 1) * n)
        right = [k for k in group if correct[k] and not comps.truncated[k]]
        wrong = [k for k in group if not correct[k]]
        if not wrong:
            continue  # nothing to prefer against
        if right:
            chosen = comps.completion_ids[right[0]]
            own_chosen += 1
        else:
            reference = (f"The answer is {problem['answer']}." if fmt == "answer-is"
                         else f"\\boxed{{{problem['answer']}}}")
            chosen = _text_response(tokenizer, reference)
        pairs.append(Pair(prompt_ids[i], chosen, comps.completion_ids[wrong[0]]))
    print(f"builtin pairs: {len(pairs)} from {len(problems)} problems x {n} samples; chosen is the "
          f"model's own answer in {own_chosen}, the reference answer in {len(pairs) - own_chosen}")
    return pairs


# ---------------------------------------------------------------------------------------------
# Log-probs of a micro-batch of pairs: chosen and rejected in one forward pass.


def pair_logps(model, pairs, cfg, device, average=False):
    """Summed (or, with average, length-averaged) response log-probs: (chosen (B,), rejected (B,))."""
    prompts = [p.prompt for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    input_ids, prompt_lens, response_lens = pack(prompts, responses, 0, device)
    with autocast(device, cfg.dtype == "bf16"):
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


def main(cfg: Config):
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    resume_dir = find_checkpoint(out, cfg.resume) if cfg.resume else ""
    branched = claim_checkpoints(out, resume_dir)  # never touch another run's checkpoints
    if branched:
        print(branched)
    # Every row is checked before the model loads: a bad file fails in a second, not a minute.
    rows = None if cfg.data == "builtin" else check_pairs(load_table(cfg.data, cfg.split),
                                                          cfg.data, cfg)

    device = pick_device()
    print(f"dtype {cfg.dtype} ({cfg.dtype_reason})")
    model, tokenizer = load_model(cfg.model, device)
    check_head_logits(model)
    # Built-in data: one generation engine samples the pairs and later runs the task evaluation.
    task_rows = arith_heldout(cfg.eval_size) if rows is None else []
    rollout = HFRollout(model, tokenizer, device=device, dtype=DTYPES[cfg.dtype]) \
        if rows is None else None
    if rows is None:
        pairs = builtin_pairs(rollout, tokenizer, cfg)
    else:
        pairs, _ = tokenize_pairs(tokenizer, rows, cfg.data, cfg)
    random.Random(cfg.seed).shuffle(pairs)
    n_eval = min(cfg.eval_pairs, len(pairs) // 5)
    eval_pairs, train_pairs = pairs[:n_eval], pairs[n_eval:]

    # The reference is the starting model, also on --resume: its log-probs come first.
    refs = None if cfg.reference_free else reference_logps(model, pairs, cfg, device)
    eval_refs, train_refs = (refs[:n_eval], refs[n_eval:]) if refs else (None, None)

    grader = Grader()
    if cfg.lora_rank:  # train adapters only; the reference log-probs above are the base's
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    optimizer, scheduler = adamw_with_warmup(model, cfg.lr, cfg.warmup_steps)
    driver = DriverState()
    if resume_dir:  # the checkpoint's weights, optimizer, schedule, RNG, step and metrics
        if cfg.lora_rank:
            load_adapters(model, resume_dir)
        else:
            model.load_state_dict(load_model(resume_dir, device)[0].state_dict())
        load_trainer_state(resume_dir, model, optimizer, scheduler)
        driver = load_driver_state(resume_dir)
        print(f"resuming from {resume_dir} at step {driver.step + 1}")
    log = RunLog(out, driver.history, cfg.report_to, asdict(cfg), line=format_dpo_step)
    (out / "dpo_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    batches = epoch_batches(len(train_pairs), cfg.batch_size, cfg.epochs, cfg.steps, cfg.seed)

    def evaluate_now():
        record, t0 = {}, time.time()
        if eval_pairs:
            model.eval()
            with torch.no_grad():
                sums = {}
                for s in range(0, len(eval_pairs), cfg.micro_batch_size):
                    _, m = batch_loss(model, eval_pairs[s:s + cfg.micro_batch_size],
                                      eval_refs[s:s + cfg.micro_batch_size] if eval_refs else None,
                                      cfg, device, 1)
                    sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
            record["eval_reward_accuracy"] = sums["reward_accuracy"] / len(eval_pairs)
            record["eval_reward_margin"] = sums["reward_margin"] / len(eval_pairs)
        if rollout:
            rollout.update_weights(full_weights(model))
            summary, _ = evaluate_rows(rollout, tokenizer, task_rows, template=cfg.template,
                                       chat=cfg.chat, sampling=Sampling(32, temperature=0.0), n=1,
                                       grader=grader, dataset="held-out")
            record["eval_accuracy"] = summary["avg@n"]
        record["eval_seconds"] = time.time() - t0
        return record

    print(f"{len(train_pairs)} training pairs, {len(eval_pairs)} held-out pairs, "
          f"{len(batches)} steps of {cfg.batch_size} pairs")
    if cfg.eval_every and driver.step == 0:
        log({"step": 0, **evaluate_now()})
    bar = tqdm(total=len(batches), desc="dpo", unit="step", initial=driver.step)
    for batch in batches[driver.step:]:  # (on --resume, from the step after the checkpoint)
        t0 = time.time()
        step, idx = batch.step, batch.rows
        model.train()
        optimizer.zero_grad(set_to_none=True)
        sums = {}
        for s in range(0, len(idx), cfg.micro_batch_size):
            mb = idx[s:s + cfg.micro_batch_size]
            loss, m = batch_loss(model, [train_pairs[i] for i in mb],
                                 [train_refs[i] for i in mb] if train_refs else None,
                                 cfg, device, len(idx))
            loss.backward()
            sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        seconds = time.time() - t0
        tokens = sum(2 * len(train_pairs[i].prompt) + len(train_pairs[i].chosen)
                     + len(train_pairs[i].rejected) for i in idx)  # (chosen and rejected rows)
        record = {"step": step, "epoch": batch.epoch,
                  **{k: v / len(idx) for k, v in sums.items()},
                  "grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0],
                  "step_seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == len(batches)):
            record.update(evaluate_now())
        log(record)
        bar.update(1)
        if cfg.save_every and step % cfg.save_every == 0:
            driver.step = driver.consumed = step
            save_checkpoint(out, driver, lambda folder: save_trainer_state(
                folder, model, tokenizer, optimizer, scheduler), cfg.keep_last)
    bar.close()
    grader.close()
    log.close()
    # The model alone (LoRA merged in), in the dtype it came in.
    save_model(model, tokenizer, out / "model", full_state_dict(model), dtype=source_dtype(cfg.model))
    plot_curves(log.history, out / "curves.png", title=f"DPO on {cfg.data} ({cfg.model})",
                train_keys=("reward_accuracy",), eval_keys=("eval_accuracy", "eval_reward_accuracy"))
    print(f"saved the model in {out}/model/, metrics.jsonl and curves.png in {out}/")
    return log.history


def format_dpo_step(record: dict) -> str:
    shown = ("step", "loss", "reward_accuracy", "reward_margin", "chosen_logp", "rejected_logp",
             "step_seconds", "eval_reward_accuracy", "eval_accuracy")
    return " | ".join(f"{k} {record[k]:.4g}" if isinstance(record[k], float) else
                      f"{k} {record[k]}" for k in shown if k in record)


if __name__ == "__main__":
    main(parse_config(Config, description=__doc__.split("\n")[0]))

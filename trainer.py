"""One GRPO training process and what runs around its loss: set-up (model, KL reference, FSDP2,
optimizer, resume), log-probs of micro-batches, the engine's importance correction and mismatch,
agreement between ranks, the gradient all-reduce and the optimizer step, the ranks' metrics
combined, a guard against non-finite steps -- and the `Run` the loop drives, built in this process
or on Ray.

grpo.py holds the algorithm (the loss, the training step, the loop); this module holds the
plumbing it needs, so a student reads the first without the second. It imports nothing above it:
the training step is handed in (`train_step`), and Ray runs the functions it is given
(distributed.py).
"""

import functools
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from attention import on_cuda
from checkpoint import load_trainer_state, save_trainer_state
from hardware import DTYPES, ModelCost, autocast, model_cost, peak_flops, peak_memory_gb
from hardware import pick_device, processed_tokens, train_flops_per_token
from logprobs import check_head_logits, completion_logprobs
from model import adamw_with_warmup, add_lora, cast_copy, check_lora_targets, full_state_dict
from model import is_lora, load_adapters
from model import load_model, model_path, save_model, shard_model, source_dtype
from recompute import keep_less
from rollout import add_mismatch, engine_mismatch, make_rollout, tokens_after_prompt
from weight_sync import weight_sync_by_collective, weight_sync_by_object_store, weight_sync_in_place
from weight_sync import weights_of


@dataclass
class Trainer:
    """What one training process holds. One of them in a plain run; one per rank under Ray."""
    model: torch.nn.Module  # the weights the optimizer steps (fp32)
    compute: torch.nn.Module  # what forward and backward run on: `model`, or its bf16 copy
    tokenizer: object
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: object
    cfg: object  # the algorithm's Config
    device: str
    group: object = None  # the trainers' data-parallel process group; None for one trainer
    reference: bool = False  # a KL reference is kept: ref_model, or with LoRA the base
    critic: "Trainer | None" = None  # ppo.py: the value model's own trainer, beside the policy's
    weight_group: object = None  # rank 0 on Ray: its weight_sync.WeightGroup with the engines
    weight_layout: list | None = None  # what a weight sync sends, bucket by bucket
    engine_bytes: int = 0  # a vLLM engine in this process: its pool of the same CUDA allocator
    cost: ModelCost | None = None  # N, L, d of the trained model, for its FLOPs (hardware.py)
    source_dtype: torch.dtype = torch.float32  # what the model came in: its export's dtype

    @property
    def sharded(self) -> bool:  # FSDP2 over the trainers
        return fsdp(self.cfg, self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1


def setup_trainer(cfg, resume_dir: str = "", reference: bool = False, group=None,
                  head: str | None = None) -> Trainer:
    """Model, optimizer and schedule of one training process: from --model, from --init-from's
    weights, or (resume_dir) from a checkpoint with its optimizer and schedule state. reference:
    keep the initial policy, frozen, for a KL term (the algorithm says whether). group: the
    trainers' data-parallel process group (distributed.py passes it), None for one trainer -- never
    whatever torch.distributed happens to hold (vLLM's in-process engine sets up a group of its
    own, one rank, in this very process)."""
    torch.manual_seed(cfg.seed)
    device = pick_device()
    start = model_path(cfg)
    # A LoRA checkpoint holds adapters only: the base comes from where the run started.
    head = head or cfg.HEAD  # ("reward": a scalar head -- rm.py's model, ppo.py's critic)
    if cfg.lora_rank:
        check_lora_targets(start, cfg.lora_targets, head)  # (before the weights load)
    model, tokenizer = load_model(resume_dir if resume_dir and not cfg.lora_rank else start,
                                  device, head=head)
    if head == "lm":
        check_head_logits(model)
    ref_model = None
    if cfg.lora_rank:  # the reference is this base model with the adapters off: no second copy
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        if resume_dir:
            load_adapters(model, resume_dir)
    elif reference:  # a frozen copy of the *initial* policy, made in the dtype it computes in
        dtype = torch.bfloat16 if uses_bf16_copy(cfg, group) else torch.float32
        initial = load_model(start, device, dtype)[0] if resume_dir else cast_copy(model, dtype)
        ref_model = computing_like(initial, model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    # What is cheap to make again, the backward makes again (recompute.py), but not under
    # checkpointing or --compile, which remake activations their own way. Checked on the model
    # that computes: here before FSDP2 shards it (under the bf16 autocast it will compute in),
    # or below on the bf16 copy.
    remakes = not cfg.gradient_checkpointing and not cfg.compile
    if remakes and not uses_bf16_copy(cfg, group):
        keep_less(model, autocast=cfg.dtype == "bf16")
    cost = model_cost(model)  # (before FSDP shards the parameters it counts)
    if fsdp(cfg, group):
        # Models too large for one GPU: shard parameters, gradients and optimizer state over the
        # ranks (FSDP2). Its gradient reduction *averages* over ranks, so train_on_rollout scales
        # the loss by the world size to keep the sum-over-global-batch convention.
        shard_model(model)
        if ref_model is not None:
            shard_model(ref_model)
    optimizer, scheduler = adamw_with_warmup(model, cfg.lr, cfg.warmup_steps, cfg.weight_decay,
                                             betas=cfg.ADAM_BETAS,
                                             group=None if fsdp(cfg, group) else group)
    if resume_dir:
        load_trainer_state(resume_dir, model, optimizer, scheduler)
    compute = bf16_copy(model) if uses_bf16_copy(cfg, group) else model
    if remakes and compute is not model:
        keep_less(compute)
    if cfg.compile:  # the policy's forward, and the reference's: the same numerics
        compile_layers(compute, *([ref_model] if ref_model is not None else []))
    # Read now, with the weights: --model may be this run's own --out, whose model/ the run moves
    # aside before it writes anything (session.start_log).
    return Trainer(model, compute, tokenizer, ref_model, optimizer, scheduler, cfg, device, group,
                   reference, cost=cost, source_dtype=source_dtype(start))


def resume_trainer(trainer: Trainer, resume_dir: str):
    """Put a checkpoint's weights (LoRA: its adapters), optimizer, schedule and torch RNG into a
    trainer set up from the start -- for an algorithm that needs the starting weights first
    (dpo.py: its pairs and reference log-probs). One process, no FSDP."""
    if is_lora(trainer.model):
        load_adapters(trainer.model, resume_dir)
    else:
        trainer.model.load_state_dict(load_model(resume_dir, trainer.device,
                                                 head=trainer.cfg.HEAD)[0].state_dict())
    load_trainer_state(resume_dir, trainer.model, trainer.optimizer, trainer.scheduler)
    refresh_bf16_copy(trainer)


def setup_for(cfg, resume_dir: str = "", group=None) -> Trainer:
    """What a trainer process holds for an RL Config: cfg.setup (what Ray's workers run)."""
    return cfg.setup(resume_dir, group)


def fsdp(cfg, group) -> bool:
    """--fsdp, on trainers that have a group to shard over (an RL loop option: options.py)."""
    return getattr(cfg, "fsdp", False) and group is not None


def computing_like(ref, policy):
    """The KL reference: the initial weights, set up to compute exactly as the policy's forward
    does -- the same dtype (its bf16 copy, or fp32 weights under autocast: setup_trainer makes
    `ref` in it), the same prompt-sharing verdict (the policy's, made once in fp32: a check of its
    own in bf16 could refuse what the policy does), compiled when the policy is (setup_trainer) --
    so that KL(pi || ref) is exactly 0 before the first update, not numerical noise with a
    gradient."""
    ref.smolrl_shares_prompts = policy.smolrl_shares_prompts
    return ref.eval()


def compile_layers(*models):
    """--compile: torch.compile each decoder layer of the models that forward and backward run on
    -- the policy's and its KL reference's -- (not the rollout's copy, whose decoding loop would
    recompile at every length). The layers share one class, so one compiled graph serves them all;
    dynamic=True keeps it across the sequence lengths of later steps (a batch of one row, a forward
    without grad or without share_prompts' mask each compile once more). Inductor fuses each
    layer's element-wise chain -- RMSNorm's fp32 round trip, rotary, SiLU times up-projection,
    residual adds -- which on a CPU costs nearly as much as the matmuls (1.2-1.4x faster updates,
    measured in the README). Without a C++ compiler (inductor's CPU kernels are C++) the layers run
    eagerly; any other compile error stops the run with torch's message, rather than leaving it
    silently slower."""
    for model in models:
        if getattr(model.get_decoder(), "layers", None) is None:
            raise SystemExit(f"error: --compile: {type(model).__name__} keeps its decoder layers "
                             f"somewhere other than model.get_decoder().layers; run without "
                             f"--compile")
    from torch._inductor import config as inductor
    compiler = inductor.cpp.cxx[-1]  # $CXX when torch was imported, else g++ (clang++ on macOS)
    if models[0].device.type == "cpu" and not shutil.which(compiler):
        print(f"warning: --compile needs a C++ compiler on a CPU ({compiler}; set CXX to choose "
              f"another) and found none: the layers run eagerly", file=sys.stderr)
        return
    for model in models:
        for layer in model.get_decoder().layers:
            layer.compile(dynamic=True)


# Mixed precision. Forward and backward run on a bf16 copy of the weights; the optimizer steps
# fp32 master weights (`model`: what checkpoints save and the engines receive). Autocast would
# cast every fp32 weight to bf16 in every forward and every bf16 weight gradient back in every
# backward, and carry the residual stream in fp32 (~1.4x slower on a CPU). In the copy everything
# is bf16, as in the engines that sampled the tokens; softmaxes and norms still compute in fp32.
# LoRA (few trained weights) and FSDP2 (which shards the weights) keep fp32 under autocast.


def uses_bf16_copy(cfg, group) -> bool:
    return cfg.dtype == "bf16" and not cfg.lora_rank and not fsdp(cfg, group)


def bf16_copy(model):
    """The bf16 copy forward and backward run on. Each of its gradients is added to its fp32
    master's as soon as the backward has computed it, and freed (a hook): micro-batches sum in
    fp32, and the copy's gradients never all exist at once (on SmolLM2-135M, 270 MB less at the
    update's peak than adding them up after the backward). Made straight in bf16 (cast_copy).

    On a CPU the master gradients are written into buffers kept from step to step: fp32
    gradients made afresh each step (540 MB for SmolLM2-135M) are memory the kernel maps and
    zeroes again each time -- ~100 ms a step of page faults, ~4 % of the default run's update on a
    Zen 4. The price is memory: the buffers are there from the backward's start, where fresh
    gradients came as its activations went (the default run's peak resident memory 4.2-4.4 ->
    4.7-4.8 GB). On a GPU, whose allocator keeps freed memory itself, they are made as before and
    freed after each step, for a colocated engine to use."""
    compute = cast_copy(model, torch.bfloat16)
    kept = not on_cuda(next(model.parameters()).device)
    for master, p in zip(model.parameters(), compute.parameters()):
        if not p.requires_grad:  # frozen: no gradient, and torch takes no hook on it
            continue
        buffer = torch.empty_like(master) if kept else None
        p.register_post_accumulate_grad_hook(functools.partial(_into_master_grad, master, buffer))
    return compute


def _into_master_grad(master, buffer, p):
    if master.grad is not None:  # a later micro-batch of the step
        master.grad.add_(p.grad)
    else:
        master.grad = p.grad.float() if buffer is None else buffer.copy_(p.grad)
    p.grad = None


@torch.no_grad()
def refresh_bf16_copy(trainer: Trainer):
    """After the optimizer step: the bf16 copy takes the new master weights."""
    if trainer.compute is not trainer.model:
        for master, p in zip(trainer.model.parameters(), trainer.compute.parameters()):
            p.copy_(master)


def export_model(trainer: Trainer, folder: str):
    """The run's result: the model alone, in the dtype it came in (no optimizer state, which
    belongs in checkpoints). Every rank calls it; rank 0 writes."""
    dtype = trainer.source_dtype
    weights = full_state_dict(trainer.model, dtype)  # (LoRA: merged, only in the saved dtype)
    if trainer.group is None or dist.get_rank() == 0:
        save_model(trainer.model, trainer.tokenizer, folder, weights, dtype=dtype)


def save_trainer(trainer: Trainer, folder: str):
    """The trainer's half of a checkpoint (checkpoint.py), and a critic's in <folder>/critic;
    every rank calls it, rank 0 writes."""
    save_trainer_state(folder, trainer.model, trainer.tokenizer, trainer.optimizer,
                       trainer.scheduler, writer=trainer.group is None or dist.get_rank() == 0)
    if trainer.critic is not None:
        save_trainer(trainer.critic, str(Path(folder) / "critic"))


def policy_logprobs(model, batch, idx, cfg, device):
    """Log-probs (and entropy) of micro-batch `idx` of a grpo.TrainBatch under `model`."""
    mb = batch.select(idx)
    L = int((mb.prompt_lens + mb.completion_lens).max())  # drop padding columns it does not need
    # An FSDP-sharded model carries completion_logprobs as a registered forward (shard_model).
    logprobs_of = getattr(model, "completion_logprobs", functools.partial(completion_logprobs, model))
    with autocast(device, cfg.dtype == "bf16" and next(model.parameters()).dtype == torch.float32):
        return logprobs_of(mb.input_ids[:, :L], mb.prompt_lens, mb.completion_lens,
                           temperature=cfg.temperature)


@torch.no_grad()
def frozen_logprobs(model, batch, mbs, cfg, device):
    """Per-micro-batch log-probs under a model we do not train (reference, or the old policy)."""
    return [policy_logprobs(model, batch, idx, cfg, device)[0] for idx in mbs]


def reference_logprobs(trainer, batch, mbs):
    """Per-micro-batch log-probs under the initial policy (for the KL term; None without one):
    its frozen copy, or with LoRA the model itself with its adapters switched off."""
    if not trainer.reference:
        return None
    if trainer.ref_model is not None:
        return frozen_logprobs(trainer.ref_model, batch, mbs, trainer.cfg, trainer.device)
    with trainer.compute.disable_adapter():  # (LoRA: `compute` is `model`)
        return frozen_logprobs(trainer.compute, batch, mbs, trainer.cfg, trainer.device)


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


def engine_correction(batch, idx, old, mask, is_cap: float, mismatch: dict | None):
    """With a vLLM engine: add the engine's mismatch against the trainer's log-probs to `mismatch`
    (when given), and return the truncated importance weights min(pi_old / pi_engine, is_cap)
    (None when --is-cap is off)."""
    if batch.engine_logprobs is None:
        return None
    engine = batch.engine_logprobs[idx][:, :old.shape[1]]  # (b, T)
    if mismatch is not None:
        add_mismatch(mismatch, engine_mismatch(old, engine, mask))
    return torch.exp(old - engine).clamp(max=is_cap) if is_cap else None


def untrained_mismatch(trainer, batch, trained, mismatch: dict):
    """The mismatch metrics describe the engine, so they cover every sampled token: the sequences
    not `trained` (zero advantage, overlong-filtered) get a no-grad pass for them. Nothing to do
    without the engine's log-probs."""
    if batch.engine_logprobs is None:
        return
    cfg, lens = trainer.cfg, batch.completion_lens
    rest = (~trained & (lens > 0)).nonzero().flatten()
    mbs, real = same_pass_count(micro_batches(rest, batch.prompt_lens + lens, cfg), trainer)
    for idx, lp in list(zip(mbs, frozen_logprobs(trainer.compute, batch, mbs, cfg,
                                                 trainer.device)))[:real]:
        mask = batch.loss_mask(idx, lp.shape[1])  # (the model's tokens)
        add_mismatch(mismatch, engine_mismatch(lp, batch.engine_logprobs[idx][:, :lp.shape[1]],
                                                mask))


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


def any_rank_trains(trainer, trained: int) -> bool:
    """Every rank must agree on whether to step: a rank with nothing to train still joins the
    gradient all-reduce; if no rank has anything, nobody steps (Adam would move on zero grads)."""
    return int(_all_reduce(torch.tensor(trained, device=trainer.device), trainer.group)) > 0


def optimizer_step(trainer, loss: float) -> float | None:
    """Reduce the gradients over the ranks, clip, step; returns the gradient norm, or None when
    the loss or the gradient is not finite: then the weights are left alone (main stops the run
    after a few such steps in a row). grad_norm is global, so every rank decides alike."""
    model, group = trainer.model, trainer.group
    if group is not None and not trainer.sharded:
        # Data parallel: the global gradient is the sum. Trained parameters only: with LoRA the
        # frozen base weights have no gradient, and a zero one would cost their full size in
        # memory and in every all-reduce.
        for p in (p for p in model.parameters() if p.requires_grad):
            if p.grad is None:  # a rank that had no sequence to train this step
                p.grad = torch.zeros_like(p)
            _all_reduce(p.grad, group)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.cfg.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    finite = math.isfinite(grad_norm) and math.isfinite(loss)
    if finite:
        trainer.optimizer.step()
        trainer.scheduler.step()
        refresh_bf16_copy(trainer)
    # Free the gradients now, not at the next step: a colocated engine generates in between.
    trainer.optimizer.zero_grad(set_to_none=True)
    return grad_norm if finite else None


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def update_flops(trainer, batch, keep) -> float:
    """The model FLOPs of one update over rows `keep` (hardware.py's count): the policy's forward
    and backward over the tokens its forward runs, and the KL reference's forward. Not counted:
    ppo.py's critic, distill.py's teacher, an old-policy pass (--updates-per-rollout > 1)."""
    if not len(keep) or trainer.cost is None:
        return 0.0
    # Per micro-batch, as the update runs them: a group split between two runs its prompt twice.
    lengths = batch.prompt_lens + batch.completion_lens
    shares = getattr(trainer.compute, "smolrl_shares_prompts", False)
    tokens = sum(processed_tokens(batch.input_ids, batch.prompt_lens, batch.completion_lens, idx,
                                  shares) for idx in micro_batches(keep, lengths, trainer.cfg))
    length = float(lengths[keep].float().mean())
    return tokens * train_flops_per_token(trainer.cost, length,
                                          lora=is_lora(trainer.model),
                                          extra_forwards=int(trainer.reference))


class UpdateStats:
    """What train_on_rollout reports, as raw sums on this rank: finish_metrics turns the ranks'
    sums into the step's metrics (token-weighted means, the loss summed over ranks)."""

    def __init__(self, trainer, batch, keep):
        self.device, self.engine_bytes = trainer.device, trainer.engine_bytes
        self.raw = {"sums": {}, "tokens": 0, "mismatch": {}, "loss": 0.0, "grad_norm": 0.0,
                    "token_detail": {},
                    "skipped_updates": 0, "applied_updates": 0, "trained_seqs": len(keep),
                    "seqs": len(batch.completion_lens),
                    "trained_tokens": int((batch.prompt_lens + batch.completion_lens)[keep].sum()),
                    "lr": trainer.scheduler.get_last_lr()[0],
                    "model_flops": 0.0}  # (result: what the machine did, counted once at the end)
        self._update = (trainer, batch, keep)
        self.dtype, self.started = next(trainer.compute.parameters()).dtype, time.perf_counter()
        self.mismatch = self.raw["mismatch"]
        self.update_loss, self._sums, self._tokens = 0.0, {}, 0  # of the update in progress

    def add(self, loss, metrics: dict, entropy, mask):
        """One micro-batch of the current update: its loss, grpo_loss's metrics, the entropy."""
        self.update_loss += float(loss.detach())
        tokens = int(mask.sum())
        metrics["entropy_trained"] = float((entropy * mask).sum()) / max(tokens, 1)
        for key, v in metrics.items():  # token-weighted, so they become full-batch means
            self._sums[key] = self._sums.get(key, 0.0) + v * tokens
        self._tokens += tokens

    def keep_tokens(self, batch, idx, **series):
        """Per-token numbers (name=(b, T) tensor, None: not computed) of the rows of micro-batch
        `idx` that the rollout log keeps in detail (batch.detail), by sample index."""
        if batch.detail is None:
            return
        for j, i in enumerate(idx.tolist()):
            sample, n = int(batch.detail[i]), int(batch.completion_lens[i])
            if sample >= 0:
                entry = self.raw["token_detail"].setdefault(sample, {})
                entry.update({name: t[j, :n].float().tolist() for name, t in series.items()
                              if t is not None})

    def end_update(self, grad_norm: float | None):
        """The update's optimizer step happened (grad_norm), or was skipped (None: not finite):
        the loss and gradient norm reported are the means over the updates that happened."""
        if grad_norm is None:
            self.raw["skipped_updates"] += 1
        else:
            self.raw["applied_updates"] += 1
            self.raw["loss"] += self.update_loss
            self.raw["grad_norm"] += grad_norm
            for key, v in self._sums.items():
                self.raw["sums"][key] = self.raw["sums"].get(key, 0.0) + v
            self.raw["tokens"] += self._tokens
        self.update_loss, self._sums, self._tokens = 0.0, {}, 0

    def result(self) -> dict:
        """The sums, and what the update asked of the machine: its model FLOPs (update_flops),
        the device's peak -- raised to what the update achieved if more (hardware.peak_flops: a
        busy start measures it low) -- and the peak memory."""
        seconds = time.perf_counter() - self.started - self.raw.get("detail_seconds", 0.0)
        self.raw["model_flops"] = update_flops(*self._update) * self.raw["applied_updates"]
        self.raw["peak_flops"] = peak_flops(
            torch.device(self.device).type, self.dtype,
            achieved=self.raw["model_flops"] / seconds if seconds > 0 else 0.0)[0]
        applied = max(self.raw.pop("applied_updates"), 1)
        self.raw["loss"] /= applied
        self.raw["grad_norm"] /= applied
        self.raw["peak_memory_gb"] = peak_memory_gb(self.device, self.engine_bytes)
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()  # hand the training peak's cached blocks back for the engine
            self.raw["resident_memory_gb"] = (torch.cuda.memory_allocated()  # between steps
                                              - self.engine_bytes) / 2**30
            self.raw["engine_memory_gb"] = self.engine_bytes / 2**30
        return self.raw


MAX_BAD_STEPS = 3  # non-finite updates in a row before the run stops


def count_bad_steps(update: dict, bad_steps: int, step: int, lr: float) -> int:
    """Steps in a row whose update was skipped (non-finite loss or gradient); stop at the limit."""
    if not update["skipped_updates"]:
        return 0
    bad_steps += 1
    tqdm.write(f"step {step}: the loss or the gradient was not finite; update skipped, weights "
               f"unchanged ({bad_steps} in a row)")
    if bad_steps >= MAX_BAD_STEPS:
        raise SystemExit(f"error: {bad_steps} steps in a row had a non-finite loss or gradient "
                         f"(lr {lr}); stopping with the last good weights untouched. Lower "
                         f"--lr or check the reward functions; --resume from the last checkpoint.")
    return bad_steps


@torch.no_grad()
def logprobs_after_update(trainer, batch, trained, stats: UpdateStats):
    """The rollout log's `new_logprob`: the log-probs of its detail rows that were trained, under
    the weights the step's updates left (no-grad passes over a few rows, in the update's
    micro-batches). Not under FSDP, whose ranks would each need the same passes."""
    if batch.detail is None or trainer.sharded:
        return
    rows = (trained & (batch.detail >= 0)).nonzero().flatten()
    if len(rows):
        t0 = time.perf_counter()
        trainer.compute.eval()
        # A group's samples often repeat one another once the policy is sure (the same answer,
        # token for token): each distinct row once, its log-probs copied to its repeats.
        lengths = batch.prompt_lens + batch.completion_lens
        by_tokens: dict[tuple, list[int]] = {}  # a row's tokens -> the rows that hold them
        for i in rows.tolist():
            by_tokens.setdefault(tuple(batch.input_ids[i, :lengths[i]].tolist()), []).append(i)
        copies_of = {same[0]: same for same in by_tokens.values()}  # a distinct row -> its copies
        # Cut as the update's passes are: all rows in one pass could outgrow what the update
        # fits on the device (~14 GB for one group of 16 x 24K tokens).
        mbs = micro_batches(torch.tensor(list(copies_of), device=rows.device), lengths,
                            trainer.cfg)
        for idx, lp in zip(mbs, frozen_logprobs(trainer.compute, batch, mbs, trainer.cfg,
                                                trainer.device)):  # lp (b, T): idx's rows
            held = [r for i in idx.tolist() for r in copies_of[i]]  # every copy of idx's rows
            place = [j for j, i in enumerate(idx.tolist()) for _ in copies_of[i]]  # (in lp)
            stats.keep_tokens(batch, torch.tensor(held),
                              new_logprob=lp[torch.tensor(place, device=lp.device)])  # (h, T)
        stats.raw["detail_seconds"] = time.perf_counter() - t0  # (what the log costs the step)


def finish_metrics(raws: list[dict]) -> dict:
    """Combine the raw sums of one or more ranks into the step's metrics (and the per-token
    numbers of the rollout log's samples, as `token_detail`)."""
    tokens = sum(r["tokens"] for r in raws)
    out = {"token_detail": {k: v for r in raws for k, v in r["token_detail"].items()}}
    for r in raws:
        for key, v in r["sums"].items():
            out[key] = out.get(key, 0.0) + v / max(tokens, 1)
    out["loss"] = sum(r["loss"] for r in raws)  # each rank holds its share of the global loss
    out["grad_norm"] = raws[0]["grad_norm"]  # all-reduced: the same on every rank
    out["skipped_updates"] = max(r["skipped_updates"] for r in raws)
    out["trained_frac"] = sum(r["trained_seqs"] for r in raws) / sum(r["seqs"] for r in raws)
    out["trained_tokens"] = sum(r["trained_tokens"] for r in raws)
    out["lr"] = raws[0]["lr"]
    out.update(raws[0].get("same_on_every_rank", {}))  # (all-reduced figures, e.g. ppo.py's)
    out["peak_memory_gb"] = max(r.get("peak_memory_gb", 0.0) for r in raws)  # of any one rank
    out["detail_seconds"] = max(r.get("detail_seconds", 0.0) for r in raws)
    out["model_flops"] = sum(r["model_flops"] for r in raws)
    out["peak_flops"] = sum(r["peak_flops"] for r in raws)  # (the trainers' devices together)
    for key in ("resident_memory_gb", "engine_memory_gb"):
        if key in raws[0]:
            out[key] = max(r[key] for r in raws)
    mismatch = {}
    for r in raws:
        add_mismatch(mismatch, r["mismatch"])
    n = mismatch.pop("mismatch_tokens", 0)
    for key, v in mismatch.items():
        out[key] = v if key.endswith("max_abs_diff") else v / max(n, 1)
    return out


def make_engine(cfg):
    """A rollout engine on an engine worker: from what the trainers start from (--init-from's
    folder, else --model: its config, chat template and vocabulary), verified as the trainers'
    model is, so that it shares prompts exactly where theirs does."""
    # In the engine's dtype (the trainers' weights replace these at once), on the GPU only for
    # the HF engine: vLLM reads the folder itself, and takes these weights from the host.
    device = pick_device() if cfg.rollout == "hf" else "cpu"
    model, tokenizer = load_model(model_path(cfg), device, DTYPES[cfg.dtype])
    check_head_logits(model)  # (sets model.smolrl_shares_prompts, which the HF engine reads)
    return _rollout(cfg, model, tokenizer, pick_device())


def engine_beside(trainer, cfg, shared: bool = True):
    """A rollout engine in the trainer's process (one process; or on Ray with --colocate, where
    engine i lives in trainer i's worker): shared, the HF engine decoding from the very tensors
    the trainer computes with (cfg.engine_shares_weights says when), else a copy of its own."""
    rollout = _rollout(cfg, trainer.compute if shared else trainer.model, trainer.tokenizer,
                       trainer.device, shared)
    assert not shared or rollout.shares_weights  # (the memory plan counts on it)
    return rollout


def _rollout(cfg, model, tokenizer, device, shared: bool = False):
    """The run's engine over `model`, sized for this engine's share of a step's samples (decoding
    as a resumed run recorded, cfg.decoding: options.settle; else as it times)."""
    return make_rollout(cfg.rollout, model, tokenizer, device=device, shares_weights=shared,
                        dtype=DTYPES[cfg.dtype], decode=cfg.decoding, seed=cfg.seed,
                        max_new_tokens=tokens_after_prompt(cfg),
                        max_prompt_tokens=cfg.max_prompt_tokens,
                        gpu_memory_utilization=cfg.gpu_memory_utilization,
                        logprobs=cfg.engine_logprobs(),
                        max_num_seqs=-(-cfg.prompts_per_step * cfg.num_generations
                                       // cfg.num_engines))


@dataclass
class Run:
    """What the loop drives, the same whether everything lives in this process or on Ray."""
    tokenizer: object
    rollout: object  # generate(prompt_ids, n, sampling) -> Completions (rollout.py)
    train: Callable[[object], dict]  # one policy update on a grpo.TrainBatch -> its metrics
    sync_weights: Callable[[int], float]  # the engines take the weights of step N -> seconds
    save: Callable[[str], None]  # the trainer's half of a checkpoint
    export: Callable[[str], None]  # the trained model alone, in the dtype it came in
    agent: object = None  # --tools / --env: how episodes go (env.Agent), set by grpo.main


# --async-steps 1 starts step t+1's generation before step t's update. Where engines and trainers
# cannot work at once, the batch is one step off-policy all the same, but the two take turns; the
# run says so at start (and docs/distributed.md, in these words).
ASYNC_TURNS = {
    "one process": "--async-steps 1 in one process: the engine generates step t+1's batch, then "
                   "the trainer trains on step t's, one after the other (the batch is one step "
                   "off-policy all the same); they work at once only on Ray, with engines of "
                   "their own or colocated on CPUs",
    "colocated on GPUs": "--async-steps 1 --colocate on GPUs: each engine shares its trainer's "
                         "GPU, and the update needs the memory the engine generates in, so the "
                         "trainers wait for the engines to finish step t+1's batch (a vLLM engine "
                         "then sleeps) before they train on step t's: one step off-policy, no time "
                         "saved; without --colocate the engines generate on GPUs of their own "
                         "while the trainers train",
}


def async_turns(cfg, on_ray: bool, gpus: bool) -> str | None:
    """The line a run with --async-steps 1 prints where generation and training take turns
    (ASYNC_TURNS), or None where they overlap. gpus: the Ray cluster's (on_ray) has GPUs."""
    if not getattr(cfg, "async_steps", 0):
        return None
    if not on_ray:
        return ASYNC_TURNS["one process"]
    return ASYNC_TURNS["colocated on GPUs"] if cfg.colocate and gpus else None


def setup_local(cfg, train_step, resume_dir: str = "", start_step: int = 0) -> "Run":
    """One process: the trainer and the rollout engine live here. train_step(trainer, batch) is
    grpo.train_on_rollout; start_step: the step the weights are from (a resumed run's)."""
    if turns := async_turns(cfg, on_ray=False, gpus=False):
        print(turns)
    trainer = cfg.setup(resume_dir)
    # The HF engine samples from the very tensors the trainer computes with (its bf16 copy, or
    # its fp32 weights), which each optimizer step updates in place: no copy of its own (270 MB
    # on SmolLM2-135M in bf16), nothing to sync. Else (vLLM; LoRA, whose engine holds the merged
    # weights; compiled layers, which decoding's shapes would recompile) the engine holds a
    # plain model of its own, built without a second copy of the trainer's, and takes its weights.
    shared = cfg.engine_shares_weights()
    rollout = engine_beside(trainer, cfg, shared)
    rollout.update_weights(weights_of(trainer), version=start_step)
    trainer.engine_bytes = getattr(rollout, "memory_bytes", 0)

    def train(batch):
        rollout.sleep()  # the engine's GPU memory is the trainer's until the sync that follows
        # On a CPU what the rollout freed stays in the C heap for the update, and the update's for
        # the next rollout: handed back to the kernel between phases (malloc_trim), it came back
        # as fresh pages, each a fault the kernel zeroes; the default run took ~13 % longer that
        # way, at the same peak (docs/benchmarks.md, "Between phases, the heap kept").
        metrics = finish_metrics([train_step(trainer, batch)])
        if shared:  # its weights changed under it now, not at the sync: no kept keys survive
            rollout.release_kept()
        return metrics

    return Run(trainer.tokenizer, rollout, train,
               sync_weights=lambda step: rollout.update_weights(weights_of(trainer), step),
               save=lambda folder: save_trainer(trainer, folder),
               export=lambda folder: export_model(trainer, folder))


def setup_ray(cfg, train_step, resume_dir: str = "", start_step: int = 0) -> "Run":
    """Ray: the same functions, run by trainer and engine workers placed by distributed.py."""
    from distributed import Cluster, shard
    from model import load_tokenizer
    cluster = Cluster(cfg.num_trainers, cfg.num_engines, colocate=cfg.colocate,
                      address=cfg.ray_address)
    if turns := async_turns(cfg, on_ray=True, gpus=cluster.use_gpu):
        print(turns)
    trainers = cluster.trainers(setup_for, cfg, resume_dir)
    trainers.check_shared_folder(cfg.out)  # before anything is trained, not at the first save
    shared = cfg.engine_shares_weights()  # --colocate: engine i in trainer i's process
    engines = cluster.engines_in(trainers, engine_beside, cfg) if shared else \
        cluster.engines(make_engine, cfg)
    engines.decode_alike()
    print(cluster.placement())
    if shared:  # engine i decodes from trainer i's tensors: no copy, nothing to send
        sync_weights = weight_sync_in_place(engines)
    elif cfg.weight_sync == "collective":
        sync_weights = weight_sync_by_collective(trainers, engines,
                                                 nccl=cluster.use_gpu and not cfg.colocate)
    else:
        sync_weights = weight_sync_by_object_store(trainers, engines, DTYPES[cfg.dtype])

    def train(batch):
        if cfg.colocate and cluster.use_gpu:  # engines sharing the trainers' GPUs free them
            # until the next sync. (An engine takes its calls in order: with --async-steps 1 this
            # waits for the next batch's generation, ASYNC_TURNS.)
            engines.run(_engine_sleeps)
        parts = shard(len(batch.advantages), cfg.num_trainers)  # each rank: a contiguous slice
        metrics = finish_metrics(trainers.run(train_step, [(batch.select(slice(r.start, r.stop)),)
                                                           for r in parts]))
        if shared:  # their weights changed under them now: no kept keys survive
            engines.release_kept()
        return metrics

    def save(folder):  # rank 0 writes; on several nodes --out must be on a shared filesystem
        trainers.run(save_trainer, [(folder,)] * cfg.num_trainers)

    def export(folder):
        trainers.run(export_model, [(folder,)] * cfg.num_trainers)

    sync_weights(start_step)  # engines start from exactly the trainers' weights
    return Run(load_tokenizer(cfg.init_from or cfg.model), engines, train, sync_weights, save,
               export)


def _engine_sleeps(engine):
    engine.sleep()

"""GPU memory: what a run needs on one GPU, estimated before anything loads, and the settings that
make it fit.

A trainer and its engine share the GPU (unless Ray gives the engine a GPU of its own). While the
engine generates, every trained model's weights, gradients and optimizer state (the policy's, and
ppo.py's critic's) stay resident beside the engine's weights and KV cache; while the trainer
trains, a vLLM engine sleeps (its memory discarded, a workspace kept), the HF engine keeps its
weights, and the activations saved for backward take what is left. Frozen models -- a KL
reference, distill.py's teacher, --reward-model and --judge models -- stay resident throughout. So:

    generation:  trained + frozen + engine (weights, KV cache, workspace)            <= usable
    training:    trained + frozen + what the engine keeps + activations + logits   <= usable
                                                                      (usable = 90 % of the GPU)

Every algorithm's Config describes its run as a Workload (workload()) and asks plan_memory for
whatever of --gradient-checkpointing, --max-tokens-per-microbatch and --gpu-memory-utilization
the command line left unset (dpo.py and rm.py fix their micro-batch: the plan only checks it, and
checkpoints when it must). The run prints the plan; --dry-run prints it and stops, and with
--gpu-gb N it plans a bf16 GPU of N GiB on any machine, one without a GPU included. Every figure
comes from the models' configs: their parameters are counted on PyTorch's meta device (shapes
only, no memory, no weights read), and the activations one token saves for backward are measured
by CPU forwards of a one-layer copy at the model's widths, computing as the trained copy computes
(its dtype, smolrl's attention, recompute.keep_less).
"""

import functools
import math
from typing import NamedTuple

import torch

GiB = 2**30
USABLE = 0.9  # of the GPU: the CUDA context, the allocator's fragmentation, NCCL buffers
PROMPT_TOKENS = 512  # a prompt's length, assumed: the data is not read before the plan
ENGINE_WORKSPACE = 1 * GiB  # vLLM's activations and CUDA graphs beside weights, KV and sampler
# vLLM's start-up profile runs its sampler on max_num_seqs dummy requests with top-p and top-k
# (vllm/v1/worker/gpu_model_runner.py: _dummy_run takes min(max_num_batched_tokens, max_num_seqs)
# requests, _dummy_sampler_run samples them): fp32 logits, probabilities and a sort's values and
# int64 indices per (request, vocabulary entry). At the default 1,024 requests and Qwen's 151,936
# entries that alone is ~3 GiB: the engine is started with max_num_seqs = one step's samples.
SAMPLER_BYTES = 20
# Per (token, vocabulary entry) of a log-prob chunk at its peak (logprobs.LinearHeadLogprobs): the
# bf16 logits 2, and fp32 copies of an eighth of the rows at a time (two in the forward) 1 --
# measured on a CPU with the GPU's row blocks (tests/test_long_context.py). Beside them a
# (vocabulary x hidden) tensor: logits_bytes.
LOGITS_BYTES = 3
LOGPROB_CHUNK = 2048  # logprobs.completion_logprobs' chunk_tokens
# Activations are planned at this many times their estimate: the allocator rounds each saved
# tensor up to its block size, and a sequence's backward briefly holds a gradient beside them.
ACTIVATION_HEADROOM = 1.1


class Workload(NamedTuple):
    """What a run puts on one GPU: each algorithm's Config describes itself as one (workload())."""
    model: str  # folder or hub id of the trained model
    lora_rank: int  # 0: full fine-tuning
    bf16: bool  # the compute dtype is bf16 (a bf16 copy of the weights trains)
    reference: bool  # a frozen copy of the initial weights (the KL reference; none under LoRA)
    shards: int  # FSDP: the trainers the trainer state is sharded over (1: none)
    engine: str  # "vllm", "hf" (never sleeps) or "" (none)
    engine_on_this_gpu: bool  # False: Ray gives the engines GPUs of their own
    batch_tokens: int  # what one generation call holds: samples x (prompt + new tokens)
    max_num_seqs: int  # samples one generation call decodes together (vLLM's max_num_seqs)
    seq_len: int  # the longest sequence trained
    frozen: tuple = ()  # (name, folder or hub id, head) of each model resident throughout in the
    #                     compute dtype, never trained: distill.py's teacher, reward models, judges
    engine_shares_weights: bool = False  # the HF engine decodes from the trainer's own tensors
    head: str = "lm"  # the trained model's head: "lm", or "reward" (rm.py's scalar head)
    critic: str = ""  # ppo.py: the critic's start, a second model trained as the policy is
    moment_shards: int = 1  # data-parallel trainers splitting AdamW's moments (ZeRO-1; 1: none)
    microbatch_tokens: int = 0  # the tokens of a micro-batch where the algorithm fixes them
    #                             (dpo.py, rm.py: pairs x 2 sequences x --max-length); 0: planned
    engine_freed: bool = False  # the engine is gone before the first update (rm.py's sampler)
    packed_row: int = 2048  # the longest row of several sequences a micro-batch packs, whose
    #                         (row x row) mask a model whose layers take no layout gets (a
    #                         sliding window, soft-capping: attention.takes_layouts):
    #                         share_prompts' under SDPA's mask (logprobs.MAX_SHARED_LEN), sft.py
    #                         --packing's (--max-length); 0: none


class Resident(NamedTuple):
    """A model the run keeps on the GPU from start to end."""
    name: str  # policy, KL reference, critic, teacher, rm:<name>, judge:<name>
    gb: float
    what: str  # what its bytes are


class MemoryPlan(NamedTuple):
    device_gb: float
    trainer_gb: float  # what trains: weights, gradients, AdamW state, the bf16 copy, the KL
    #                    reference (and ppo.py's critic, all of it again)
    frozen_gb: float  # never trained, in the compute dtype: a teacher, reward models, judges
    engine_gb: float  # generating: its weights, the KV cache of one step's batch, its workspace
    engine_kept_gb: float  # training: what the engine keeps (the HF engine its weights)
    activations_kb: float  # per token, saved for backward (as checkpointed, when it is)
    logits_gb: float  # one chunk of log-probs through the LM head
    gradient_checkpointing: bool
    max_tokens_per_microbatch: int
    gpu_memory_utilization: float  # vLLM's share of the GPU (0 for the HF engine)
    resident: tuple = ()  # Resident records: every model held throughout, trainer_gb + frozen_gb

    def training_gb(self) -> float:
        """What the update adds to the resident models: the engine's kept share, one
        micro-batch's activations and a chunk of logits."""
        return (self.engine_kept_gb + self.logits_gb
                + self.activations_kb * self.max_tokens_per_microbatch / 2**20)

    def peak_gb(self) -> float:
        """The larger of the two phases: resident models + the engine generating, or + training."""
        return self.trainer_gb + self.frozen_gb + max(self.engine_gb, self.training_gb())

    def __str__(self):
        lines = [f"memory plan for a {self.device_gb:g} GB GPU ({USABLE:.0%} usable: "
                 f"{USABLE * self.device_gb:.1f} GB); resident throughout:"]
        lines += [f"  {r.name:<16} {r.gb:6.1f} GB  {r.what}" for r in self.resident]
        if self.gpu_memory_utilization:
            lines.append(f"  {'vLLM engine':<16} {self.engine_gb:6.1f} GB  generating "
                         f"(--gpu-memory-utilization {self.gpu_memory_utilization:.2f}); "
                         f"{self.engine_kept_gb:.1f} GB kept asleep while training")
        elif self.engine_gb:
            lines.append(f"  {'HF engine':<16} {self.engine_gb:6.1f} GB  generating; "
                         f"{self.engine_kept_gb:.1f} GB kept while training"
                         + (" (its own weights)" if self.engine_kept_gb else ""))
        lines.append(f"  {'training':<16} {self.training_gb() - self.engine_kept_gb:6.1f} GB  "
                     f"{self.activations_kb:.0f} KB/token of activations"
                     f"{' (checkpointed)' if self.gradient_checkpointing else ''} x "
                     f"{self.max_tokens_per_microbatch:,} tokens/micro-batch + "
                     f"{self.logits_gb:.1f} GB of logits")
        lines.append(f"  {'peak':<16} {self.peak_gb():6.1f} GB")
        return "\n".join(lines)


class ModelShape(NamedTuple):
    params: int
    hidden: int
    layers: int
    vocab: int
    kv_bytes_per_token: int  # the engine's KV cache, bf16
    head_dim: int


@functools.cache
def model_shape(path: str) -> ModelShape:
    """The model of folder/hub id `path` built on the meta device from its config: its parameter
    count and the sizes the plan needs."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return ModelShape(sum(p.numel() for p in model.parameters()), text.hidden_size,
                      text.num_hidden_layers, text.vocab_size,
                      2 * text.num_hidden_layers * kv_heads * head_dim * 2, head_dim)


@functools.cache
def layer_bytes(path: str, lora_rank: int = 0, bf16: bool = True) -> tuple[float, float, float]:
    """(outside the layers, one layer as the trained copy keeps it, one layer as a checkpointed
    backward makes it again): the bytes a token leaves for backward, measured by CPU forwards of
    copies of the model at `path` with no layer and with one, at its widths and a 256-entry
    vocabulary, computing as the trainer computes: full fine-tuning on a bf16 copy (fp32 where
    not bf16), LoRA on fp32 weights with rank-`lora_rank` adapters under bf16 autocast (which
    keeps some tensors fp32 and casts each linear's input anew: ~1.3x the bf16 figure); smolrl's
    attention; recompute.keep_less, which makes half of a Llama layer's bytes again in the
    backward -- but not under checkpointing, whose backward remakes whole layers its own way.
    Measured on the meta device through the model's own forward (every save counted: meta
    tensors have no storage to tell them apart; keep_less unseen) the figure was 2.5-2.8x what a
    Qwen2.5- or SmolLM2-shaped trained copy keeps (issue 69)."""
    from recompute import keep_less
    measured = []
    for layers in (0, 1):
        model = _copy(path, layers, lora_rank, bf16)
        autocast = bool(lora_rank) and bf16
        plain = _kept_per_token(model, autocast)
        keep_less(model, autocast=autocast)
        measured.append((plain, _kept_per_token(model, autocast)))
    (_, outside), (plain, kept) = measured
    return outside, kept - outside, plain - measured[0][0]


def _copy(path: str, layers: int, lora_rank: int, bf16: bool):
    """The model at `path` with `layers` layers and a 256-entry vocabulary, random weights, on the
    CPU in the dtype its trained copy computes in, with smolrl's attention (and adapters)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from attention import use_smolrl_attention
    from model import add_lora
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    text = config.get_text_config()
    text.num_hidden_layers, text.vocab_size = layers, 256
    if isinstance(getattr(text, "layer_types", None), list):  # (one entry a layer)
        text.layer_types = text.layer_types[:layers]
    dtype = torch.bfloat16 if bf16 and not lora_rank else torch.float32
    with torch.random.fork_rng(devices=[]):  # (the run's own draws stay as they were)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    use_smolrl_attention(model)
    if lora_rank and layers:  # (no layer, no linear to adapt)
        model = add_lora(model, lora_rank)
    return model.train()


def _kept_per_token(model, autocast: bool) -> float:
    """Bytes per token a forward of the model's decoder leaves for backward (recompute.Made: the
    storages its ops made that are still alive, less its output): the linear term of three
    lengths, so that scores an eager attention keeps (T x T) do not count as per token."""
    from recompute import Made
    held = []
    for T in (32, 64, 128):
        made = Made()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), made:
            out = model.get_decoder()(input_ids=torch.zeros(1, T, dtype=torch.long),
                                      use_cache=False).last_hidden_state
        held.append(made.held_bytes() - out.untyped_storage().nbytes())
        del out
    d1, d2 = (held[1] - held[0]) / 32, (held[2] - held[1]) / 64  # b + 96 c, b + 192 c
    return 2 * d1 - d2


@functools.cache
def head_params(path: str, head: str = "lm") -> int:
    """Parameters of the model at `path` with its language-model head ("lm") or a scalar one
    ("reward": rm.py's model, ppo.py's critic, a --reward-model), counted on the meta device. The
    two differ by the LM head where it is not tied to the embeddings (545M at Qwen2.5-7B's)."""
    if head == "lm":
        return model_shape(path).params
    from transformers import AutoConfig, AutoModelForSequenceClassification
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    config.num_labels = 1
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def _trained(run: Workload, path: str, head: str, name: str) -> Resident:
    """A trained model's resident bytes: full fine-tuning keeps fp32 master weights 4, their
    gradients 4, AdamW's two moments 8 and a bf16 copy 2 (whose gradients go into the fp32 ones
    one tensor at a time: trainer.bf16_copy) a parameter; LoRA the frozen fp32 base (the
    adapters and their state are negligible). FSDP shards it over the trainers; data-parallel
    trainers split the moments (ZeRO-1), planned as even shares: they are whole tensors, so the
    rank with the embedding may hold more (Qwen2.5-0.5B's is 27.5 % of it, over 12.5 % on 8)."""
    P = head_params(path, head)
    if run.lora_rank:
        return Resident(name, 4 * P / run.shards / GiB, "fp32 base under LoRA (the adapters train)")
    split = f", moments split over {run.moment_shards}" if run.moment_shards > 1 else ""
    return Resident(name, ((8 + 2 * run.bf16) + 8 / run.moment_shards) * P / run.shards / GiB,
                    "fp32 weights, gradients, AdamW moments" + (", bf16 copy" if run.bf16 else "")
                    + (f", sharded over {run.shards}" if run.shards > 1 else "") + split)


def residents(run: Workload) -> list[Resident]:
    """Every model the run keeps on the GPU from start to end."""
    dtype_bytes, kind = (2, "bf16") if run.bf16 else (4, "fp32")
    out = [_trained(run, run.model, run.head, "policy" if run.head == "lm" else "reward model")]
    if run.reference:
        out.append(Resident("KL reference", dtype_bytes * model_shape(run.model).params
                            / run.shards / GiB, f"frozen initial weights, {kind}"))
    if run.critic:
        out.append(_trained(run, run.critic, "reward", "critic"))
    out += [Resident(name, dtype_bytes * head_params(path, head) / GiB, f"frozen, {kind}")
            for name, path, head in run.frozen]
    return out


def activation_bytes(path: str, lora_rank: int = 0, bf16: bool = True) -> tuple[float, float]:
    """(full, checkpointed) bytes a token saves for backward through the model at `path`, as its
    trained copy computes (layer_bytes). Checkpointed, backward keeps every layer's input (the
    residual stream: bf16 on a bf16 copy, fp32 under LoRA's autocast, beside the layers' shared
    fp32 rotary cos and sin) and makes one layer again at a time."""
    shape = model_shape(path)
    outside, kept, plain = layer_bytes(path, lora_rank, bf16)
    width = 4 if lora_rank or not bf16 else 2
    inputs = shape.layers * shape.hidden * width + 2 * shape.head_dim * 4
    return outside + shape.layers * kept, inputs + outside + plain


def mask_bytes(path: str, packed_row: int, seq_len: int = 0) -> tuple[float, float]:
    """(full, checkpointed) bytes a token's share of the dense masks of packed rows up to
    `packed_row` long: none where the model's layers take layouts (smolrl's attention finds the
    sequences by place, and makes no mask longer than a small block); else its row of the
    bool mask, and on a GPU SDPA's bf16 bias of it, made by every layer and kept for its backward
    (one layer at a time, checkpointed) -- soft-capped layers keep the bool mask itself. And a
    sliding window's: an unpacked row of `seq_len` tokens past the window gets transformers'
    (T x T) mask too (found by review), except a soft-capped model's (softcapped_attention makes
    its own a chunk at a time)."""
    from transformers import AutoConfig
    from attention import takes_layouts
    config = AutoConfig.from_pretrained(path, trust_remote_code=False).get_text_config()
    window = getattr(config, "sliding_window", None)
    if window and seq_len >= window and not getattr(config, "attn_logit_softcapping", None):
        packed_row = max(packed_row, seq_len)  # (transformers skips the mask within the window)
    if not packed_row or takes_layouts(config):
        return 0.0, 0.0
    if getattr(config, "attn_logit_softcapping", None):
        return float(packed_row), float(packed_row)
    return packed_row * (1 + 2 * config.num_hidden_layers), packed_row * 3.0


def logits_bytes(tokens: int, vocab: int, hidden: int, lora_rank: int, bf16: bool) -> float:
    """The most a log-prob chunk of `tokens` holds at once (logprobs.LinearHeadLogprobs): its logits
    in the matmul dtype and the fp32 row blocks (LOGITS_BYTES an entry in bf16; an fp32 run's
    logits take 2 more), and a (vocabulary, hidden) tensor in that dtype beside them: the head's
    gradient under full fine-tuning, and under LoRA with bf16 autocast the frozen fp32 head cast
    to bf16 for the matmul, forward and backward (found by review: unplanned, ~1.4 GiB at
    Qwen2.5-7B's head). Only fp32 LoRA, whose head is neither cast nor trained, has neither."""
    width = 2 if bf16 else 4
    head = 0 if lora_rank and not bf16 else width * vocab * hidden
    return tokens * vocab * (LOGITS_BYTES - 2 + width) + head


def plan_memory(run: Workload, device_bytes: int, gradient_checkpointing=None,
                max_tokens_per_microbatch=None, gpu_memory_utilization=None) -> MemoryPlan:
    """The three settings, those passed as None chosen to fit a GPU of device_bytes, the others
    kept and only checked. Stops with one line that says what does not fit, and by how much."""
    shape = model_shape(run.model)
    P, usable, dtype_bytes = shape.params, USABLE * device_bytes, 2 if run.bf16 else 4
    gpu = f"a {device_bytes / GiB:g} GB GPU ({usable / GiB:.1f} GB usable)"
    held = residents(run)
    trainer = GiB * sum(r.gb for r in held if r.name in ("policy", "reward model",
                                                         "KL reference", "critic"))
    frozen = GiB * sum(r.gb for r in held) - trainer
    kv = 1.1 * run.batch_tokens * shape.kv_bytes_per_token * dtype_bytes / 2
    utilization, engine, kept = 0.0, 0.0, 0.0
    if run.engine == "vllm":
        engine = (dtype_bytes * P + kv + ENGINE_WORKSPACE
                  + run.max_num_seqs * shape.vocab * SAMPLER_BYTES)
        utilization = gpu_memory_utilization or math.ceil(100 * engine / device_bytes) / 100
        engine, kept = utilization * device_bytes, ENGINE_WORKSPACE  # (asleep: some stays)
    elif run.engine == "hf":  # never sleeps: its weights stay while the trainer trains (unless
        from rollout import PREFILL_TOKENS  # they are the trainer's)
        kept = 0.0 if run.engine_shares_weights else dtype_bytes * P
        # + a decode step's logits, and a prefill chunk's mask (its rows x columns x the row's
        # length) with the bf16 bias a layer makes of it
        row = run.batch_tokens / max(run.max_num_seqs, 1)
        engine = kept + kv + run.max_num_seqs * shape.vocab * 4 + 3 * PREFILL_TOKENS * row
    if not run.engine_on_this_gpu:
        engine = kept = 0.0
    if run.engine_freed:
        kept = 0.0
    generating = trainer + frozen + engine
    if generating > usable:
        parts = " + ".join(f"{r.name} {r.gb:.1f}" for r in held) + \
            (f" + engine {engine / GiB:.1f}" if engine else "")
        what = (f"{run.model} does not fit {gpu} while generating: {parts} = "
                f"{generating / GiB:.1f} GB, {(generating - usable) / GiB:.1f} GB over; try "
                f"{_smaller(run)}")
        if run.engine != "vllm" or gpu_memory_utilization is None:
            raise SystemExit(f"error: {what}")
        print(f"warning: by the memory plan's estimate, {what}")  # (the user's choice stands)
    logits = 0.0  # (rm.py's model has a scalar head: no vocabulary)
    if run.head == "lm":  # a chunk's logits, and the head's gradient unless LoRA freezes it
        logits = logits_bytes(LOGPROB_CHUNK, shape.vocab, shape.hidden, run.lora_rank, run.bf16)
    room = usable - trainer - frozen - kept - logits
    # The policy and ppo.py's critic train one after the other: the larger one's activations.
    full, checkpointed = (max(pair) for pair in zip(*(
        [a + m for a, m in zip(activation_bytes(path, run.lora_rank, run.bf16),
                               mask_bytes(path, run.packed_row, run.seq_len))]
        for path in {run.model, run.critic or run.model})))
    checkpointed, full = ACTIVATION_HEADROOM * checkpointed, ACTIVATION_HEADROOM * full
    tokens = max_tokens_per_microbatch or run.microbatch_tokens or None  # (None: planned)
    # Recomputing activations costs ~30 % more compute: only when micro-batches of a few whole
    # sequences (or the algorithm's own micro-batch) would not fit without it.
    ckpt = gradient_checkpointing
    if ckpt is None:
        ckpt = room < (tokens or 4 * run.seq_len) * full
    per_token = checkpointed if ckpt else full
    if tokens is None:
        tokens = int(room // per_token) // 1024 * 1024
        if tokens < run.seq_len:
            need = run.seq_len * per_token
            raise SystemExit(f"error: {run.model} does not fit {gpu} while training: one "
                             f"{run.seq_len}-token sequence's activations ({need / GiB:.1f} GB) "
                             f"need {(need - room) / GiB:.1f} GB more than is left beside the "
                             f"resident models ({(trainer + frozen) / GiB:.1f} GB); try "
                             f"{_smaller(run)}")
    elif tokens * per_token > room:
        need = tokens * per_token
        what = (f"{run.model} does not fit {gpu} while training: a micro-batch of {tokens} "
                f"tokens saves {need / GiB:.1f} GB of activations, {(need - room) / GiB:.1f} GB "
                f"more than is left beside the resident models")
        if not max_tokens_per_microbatch:  # (the algorithm's micro-batch: dpo.py's, rm.py's)
            raise SystemExit(f"error: {what}; lower --micro-batch-size or --max-length"
                             + ("" if run.lora_rank else ", or try --lora-rank 16"))
        print(f"warning: by the memory plan's estimate, {what} (--max-tokens-per-microbatch "
              f"{tokens} as given)")
    return MemoryPlan(device_bytes / GiB, trainer / GiB, frozen / GiB, engine / GiB, kept / GiB,
                      per_token / 1024, logits / GiB, ckpt, tokens, utilization, tuple(held))


def _smaller(run: Workload) -> str:
    """What a run that does not fit can try."""
    return ("" if run.lora_rank else "--lora-rank 16, ") + "fewer samples, shorter sequences" \
        + (" or a smaller --critic-from" if run.critic else "") + " or a larger GPU"

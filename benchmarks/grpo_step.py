"""Seconds per GRPO step, split into generation / scoring / training, on a fixed config.

    python benchmarks/grpo_step.py              # SmolLM2-135M-Instruct, 8 prompts x 4 samples,
                                                # <= 64 new tokens, 1 warm-up + 4 timed steps
    python benchmarks/grpo_step.py --dtype fp32  # either dtype (default: hardware.choose_dtype's)
    python benchmarks/grpo_step.py --train-all  # the policy update alone, every sequence trained
    python benchmarks/grpo_step.py --train-all --distinct-prompts  # no prompt shared by samples
    python benchmarks/grpo_step.py --train-all --compile  # the decoder layers torch.compiled

Prints one row per timed step and the median. Training time depends on how many sequences carry
a non-zero advantage (grpo.py skips the others when beta = 0), so `trained` is printed beside it;
`--beta 1e-9` forces every sequence through forward and backward for a worst-case figure.

--train-all times `train_on_rollout` alone on a fixed batch shaped like the benchmark's (8 random
40-token prompts x 4 samples of 64 random tokens, every advantage non-zero, no reference model),
and prints sequence tokens/s and the FLOP rate of the tokens the decoder actually runs (6 x
parameters x tokens, the usual estimate, which leaves out attention; a group's prompt runs once,
logprobs.share_prompts) next to the matmul rate this CPU reaches in the run's dtype at SmolLM2's shapes, measured
in the same run just before each timed step (median of the four). --distinct-prompts gives each
sequence a prompt of its own (nothing to share). grpo.py's flags apply (--compile,
--micro-batch-size, ...); with --compile the warm-up step pays for the compile (in the full-step
mode a timed step that trains a single group compiles once more: a batch of one row).
"""

import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cli import parse_config  # noqa: E402
from grpo import Config, main  # noqa: E402
from hardware import DTYPES, hardware_line  # noqa: E402

BENCH = Config(prompts_per_step=8, num_generations=4, max_new_tokens=64, steps=5, eval_every=0,
               log_samples_every=0, temperature=1.0, micro_batch_size=32)

def matmul_gflops(dtype=torch.bfloat16, m=1600, k=576, n=1536, seconds=1.0) -> float:
    """(m, k) @ (k, n) in `dtype` at SmolLM2's MLP shape: what this machine can do."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    calls, t0 = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - t0 < seconds:
        a @ b
        calls += 1
    return 2 * m * k * n * calls / (time.perf_counter() - t0) / 1e9


def print_machine():
    """What every figure below was measured on, and both dtypes' matmul rates there."""
    print(f"machine: {hardware_line()}; matmul 1600x576 @ 576x1536: fp32 "
          f"{matmul_gflops(torch.float32):,.0f} GFLOP/s, bf16 "
          f"{matmul_gflops(torch.bfloat16, seconds=0.3):,.0f} GFLOP/s", flush=True)


def train_all(argv: list[str], distinct_prompts: bool = False):
    """train_on_rollout alone, every sequence trained: forward+backward against the matmul rate."""
    from grpo import train_on_rollout
    from rl import TrainBatch, loss_denominator
    from trainer import setup_trainer
    cfg = replace(parse_config(Config, argv), beta=0.0)
    cfg = replace(cfg, micro_batch_size=cfg.micro_batch_size if "--micro-batch-size" in argv
                  else BENCH.micro_batch_size)
    trainer = setup_trainer(cfg)
    params = sum(p.numel() for p in trainer.model.parameters())
    B, P, T, G = 32, 40, 64, 4  # the benchmark's 8 prompts x 4 samples, <= 64 new tokens
    G = 1 if distinct_prompts else G
    g = torch.Generator().manual_seed(0)
    lens = torch.full((B,), T)
    V = trainer.model.config.vocab_size
    ids = torch.cat([torch.randint(0, V, (B // G, P), generator=g).repeat_interleave(G, 0),
                     torch.randint(0, V, (B, T), generator=g)], dim=1)
    batch = TrainBatch(ids, torch.full((B,), P), lens, torch.randn(B, generator=g),
                       torch.ones(B, dtype=torch.bool), None, loss_denominator(cfg.loss_agg, lens, T))
    train_on_rollout(trainer, batch)  # warm-up
    times, rates = [], []
    for _ in range(4):  # this machine's speed drifts: the matmul rate is sampled before each step
        rates.append(matmul_gflops(DTYPES[cfg.dtype]))
        t0 = time.perf_counter()
        train_on_rollout(trainer, batch)
        times.append(time.perf_counter() - t0)
    seconds, rate, tokens = statistics.median(times), statistics.median(rates), B * (P + T)
    run = B // G * P + B * T  # the tokens the decoder runs: a group's prompt once (share_prompts)
    flops = 6 * params * run / seconds / 1e9
    print(f"{cfg.model}: {params / 1e6:.0f} M parameters; {B // G} prompts x {G} samples, "
          f"{B} sequences x ({P} + {T}) tokens, micro-batch {cfg.micro_batch_size}, "
          f"dtype {cfg.dtype}, {torch.get_num_threads()} threads")
    print(f"train_on_rollout: {seconds:.2f} s (median of {', '.join(f'{t:.2f}' for t in times)}), "
          f"{tokens / seconds:,.0f} sequence tokens/s ({run:,} decoder tokens)")
    print(f"forward+backward: {flops:,.0f} GFLOP/s (6 x params x decoder tokens) = "
          f"{100 * flops / rate:.0f} % of the {cfg.dtype} matmul rate measured between the steps "
          f"({rate:,.0f} GFLOP/s at 1600x576 @ 576x1536, median of "
          f"{', '.join(f'{r:,.0f}' for r in rates)})")


def full_steps(argv: list[str]):
    cfg = parse_config(Config, argv)
    # Flags given on the command line win; everything else is the fixed benchmark config.
    given = {a.lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    cfg = replace(BENCH, **{k: getattr(cfg, k) for k in given if hasattr(cfg, k)})
    with tempfile.TemporaryDirectory() as tmp:
        cfg = replace(cfg, out=tmp)
        main(cfg)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]  # the first step pays one-off costs (kernel selection, allocator warm-up)
    cols = ["step_seconds", "gen_seconds", "reward_seconds", "train_seconds", "gen_tokens_per_s",
            "train_tokens_per_s", "completion_len", "trained_frac"]
    print(f"\nconfig: {cfg.model}, {cfg.prompts_per_step} prompts x {cfg.num_generations} samples, "
          f"max_new_tokens {cfg.max_new_tokens}, dtype {cfg.dtype}, beta={cfg.beta}")
    print("step " + "".join(c.rjust(20) for c in cols))
    for r in timed:
        print(f"{r['step']:4d} " + "".join(f"{r.get(c, 0):20.2f}" for c in cols))
    print("med  " + "".join(f"{statistics.median(r.get(c, 0) for r in timed):20.2f}" for c in cols))


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not {"-h", "--help"} & set(argv):  # (timing the machine's matmuls takes seconds)
        print_machine()
    if "--train-all" in argv:
        train_all([a for a in argv if a not in ("--train-all", "--distinct-prompts")],
                  distinct_prompts="--distinct-prompts" in argv)
    else:
        full_steps(argv)

"""Where one GRPO update's time goes: a train_on_rollout under torch.profiler, by operator and by
operator and shape, with the matmuls' own FLOP rate against this CPU's.

    python benchmarks/update_profile.py            # arith's batch: 8 groups of 8, 55 + 5-24 tokens
    python benchmarks/update_profile.py --bench    # grpo_step.py --train-all's: 8 x 4, 40 + 64

The profiler costs time of its own at every operator (the profiled step takes ~2x the plain one,
printed beside it): read the shares, not the milliseconds. The offline default model, in the
dtype `auto` picks here, a random batch, every sequence trained (beta 0).
"""

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cli import parse_config
    from grpo import Config, train_on_rollout
    from grpo_step import matmul_gflops
    from hardware import DTYPES, hardware_line
    from rl import TrainBatch, loss_denominator
    from trainer import setup_trainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench", action="store_true", help="grpo_step.py --train-all's batch")
    parser.add_argument("--rows", type=int, default=6, help="shapes printed per operator")
    args = parser.parse_args()
    B, P, T, G = (32, 40, 64, 4) if args.bench else (64, 55, 24, 8)
    cfg = replace(parse_config(Config, []), beta=0.0, micro_batch_size=B)
    trainer = setup_trainer(cfg)
    g = torch.Generator().manual_seed(0)
    V = trainer.model.config.vocab_size
    ids = torch.cat([torch.randint(0, V, (B // G, P), generator=g).repeat_interleave(G, 0),
                     torch.randint(0, V, (B, T), generator=g)], dim=1)
    lens = torch.full((B,), T) if args.bench else torch.randint(5, T + 1, (B,), generator=g)
    batch = TrainBatch(ids, torch.full((B,), P), lens, torch.randn(B, generator=g),
                       torch.ones(B, dtype=torch.bool), None,
                       loss_denominator(cfg.loss_agg, lens, T))
    train_on_rollout(trainer, batch)  # (warm-up)
    t0 = time.perf_counter()
    train_on_rollout(trainer, batch)
    plain = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True) as prof:
        train_on_rollout(trainer, batch)
    rate = matmul_gflops(DTYPES[cfg.dtype])
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    matmuls = [e for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
    mm_time = sum(e.self_cpu_time_total for e in matmuls)
    mm_flops = sum(e.flops for e in matmuls)
    print(f"machine: {hardware_line()}, {cfg.dtype}")
    print(f"batch: {B // G} groups of {G}, {P} + {'' if args.bench else '5-'}{T} tokens; one "
          f"update {plain:.2f} s, {total / 1e6:.2f} s profiled")
    print(f"matmuls (mm, addmm, bmm): {100 * mm_time / total:.0f} % of the profiled time, "
          f"{mm_flops / 1e9:,.0f} GFLOP at {mm_flops / mm_time / 1e3:,.0f} GFLOP/s; this CPU's "
          f"matmul at 1600x576 @ 576x1536: {rate:,.0f} GFLOP/s")
    print(ops.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=36))
    shaped = prof.key_averages(group_by_input_shape=True)
    for name in ("aten::mul", "aten::copy_", "aten::mm", "aten::bmm"):
        for e in sorted((e for e in shaped if e.key == name),
                        key=lambda e: -e.self_cpu_time_total)[:args.rows]:
            print(f"{name:12s} {100 * e.self_cpu_time_total / total:5.1f} %  {e.count:5d} calls  "
                  f"{str(e.input_shapes)[:120]}")

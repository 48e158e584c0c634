"""Where one GRPO update's time goes: a train_on_rollout under torch.profiler, by operator and by
operator and shape, with the matmuls' own FLOP rate against this CPU's.

    python benchmarks/update_profile.py            # arith's batch: 8 groups of 8, 55 + 5-24 tokens
    python benchmarks/update_profile.py --bench    # grpo_step.py --train-all's: 8 x 4, 40 + 64
    python benchmarks/update_profile.py --by-op    # each operator timed alone, no profiler

The profiler costs time of its own at every operator (the profiled step takes ~2x the plain one,
printed beside it): read the shares, not the milliseconds. `--by-op` times each operator's own
seconds instead (a dispatch mode around the update: on a CPU an operator has finished when it
returns), so small operators are not inflated: their sum against the plain update says how much
of it is the operators themselves, the matmuls' rate is theirs, and the optimizer step (clipping,
AdamW, the bf16 copy's refresh: a cost per step, whatever its tokens) is timed apart. The offline
default model, in the dtype `auto` picks here, a random batch, every sequence trained (beta 0).
"""

import argparse
import math
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

MATMULS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1)}  # (a, b) operands


def by_op(trainer, batch, plain: float, rate: float, described: str):
    """One update with each operator's own seconds recorded (OpTimes), printed by share."""
    import grpo
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpTimes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds, self.calls = defaultdict(float), defaultdict(int)  # (name, shape) ->
            self.mm_seconds = self.mm_flops = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            seconds = time.perf_counter() - t0
            name = func.name()
            shape = tuple(args[0].shape) if args and hasattr(args[0], "shape") else ()
            self.seconds[name, shape] += seconds
            self.calls[name, shape] += 1
            if func.name() in MATMULS:  # 2 m k n (times the batch, bmm)
                a, b = (args[i] for i in MATMULS[func.name()])
                self.mm_seconds += seconds
                self.mm_flops += 2 * math.prod(a.shape) * b.shape[-1]
            return out

    step = grpo.optimizer_step
    optimizer_seconds = []

    def timed_step(*a):
        t0 = time.perf_counter()
        out = step(*a)
        optimizer_seconds.append(time.perf_counter() - t0)
        return out

    grpo.optimizer_step = timed_step
    times = OpTimes()
    with times:
        grpo.train_on_rollout(trainer, batch)
    grpo.optimizer_step = step
    total = sum(times.seconds.values())
    print(f"machine: {hardware_line()}, {trainer.cfg.dtype}")
    print(f"batch: {described}; one update {plain:.2f} s; its operators' own time {total:.2f} s "
          f"({sum(times.calls.values()):,} calls)")
    print(f"matmuls (mm, addmm, bmm): {times.mm_seconds:.2f} s, {100 * times.mm_seconds / total:.0f}"
          f" % of the operators' time, {times.mm_flops / 1e9:,.0f} GFLOP at "
          f"{times.mm_flops / times.mm_seconds / 1e9:,.0f} GFLOP/s; this CPU's matmul at 1600x576 @ "
          f"576x1536: {rate:,.0f} GFLOP/s")
    print(f"the optimizer step (clipping, AdamW, the bf16 copy's refresh): "
          f"{sum(optimizer_seconds):.3f} s, under the timer")
    print(f"{'ms':>8s} {'calls':>6s}  operator, first input's shape")
    for (name, shape), seconds in sorted(times.seconds.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{1e3 * seconds:8.1f} {times.calls[name, shape]:6d}  {name} {list(shape)}")

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
    parser.add_argument("--by-op", action="store_true", help="each operator's own time, no profiler")
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
    described = f"{B // G} groups of {G}, {P} + {'' if args.bench else '5-'}{T} tokens"
    if args.by_op:
        by_op(trainer, batch, plain, matmul_gflops(DTYPES[cfg.dtype]), described)
        raise SystemExit
    with profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True) as prof:
        train_on_rollout(trainer, batch)
    rate = matmul_gflops(DTYPES[cfg.dtype])
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    matmuls = [e for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
    mm_time = sum(e.self_cpu_time_total for e in matmuls)
    mm_flops = sum(e.flops for e in matmuls)
    print(f"machine: {hardware_line()}, {cfg.dtype}")
    print(f"batch: {described}; one update {plain:.2f} s, {total / 1e6:.2f} s profiled")
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

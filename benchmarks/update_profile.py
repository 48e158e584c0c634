"""Where one GRPO update's time goes, operator by operator, with the matmuls' FLOP rate.

    python benchmarks/update_profile.py            # arith's batch: 8 groups of 8, 55 + 5-24 tokens
    python benchmarks/update_profile.py --bench    # grpo_step.py --train-all's: 8 x 4, 40 + 64
    python benchmarks/update_profile.py --by-op    # each operator timed alone, no profiler

A train_on_rollout under torch.profiler, by operator and by operator and shape. The profiler
costs time of its own at every operator (the profiled step takes ~2x the plain one, printed
beside it): read the shares, not the milliseconds. `--by-op` (a CPU's: an operator there has
finished when it returns) times each operator's own seconds instead, in a dispatch mode around the
update, so small operators are not inflated: their sum -- each with the Python call into it, so a
bound from above -- against the plain update (the median of three) says how much of it is the
operators themselves; the matmuls' rate is theirs; the optimizer step (clipping, AdamW, the bf16
copy's refresh: a cost per step, whatever its tokens) is timed apart. The offline default model,
in the dtype `auto` picks here, a random batch, every sequence trained (beta 0).
"""

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

MATMULS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1),
           "aten::baddbmm": (1, 2)}  # op (every overload) -> its two multiplied operands


def by_op(trainer, batch, plains: list[float], rate: float, described: str):
    """One update with each operator's own seconds recorded, printed by share (see the module's
    docstring): an operator is its name and its tensor arguments' shapes. Returns the record
    (its seconds and calls by operator, the matmuls' seconds and FLOPs)."""
    import grpo
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hardware import hardware_line

    # (a GPU's operator returns when it is launched, not when it is done)
    if torch.device(trainer.device).type != "cpu":
        raise SystemExit("error: --by-op times operators on a CPU only; on a GPU use the profiler")

    class OpTimes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds, self.calls = defaultdict(float), defaultdict(int)  # (name, shapes) ->
            self.mm_seconds = self.mm_flops = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            seconds = time.perf_counter() - t0
            name = func._schema.name  # (aten::mm for mm and mm.out alike)
            key = name, tuple(_shape(a) for a in args if _shape(a) is not None)
            self.seconds[key] += seconds
            self.calls[key] += 1
            if name in MATMULS:  # 2 m k n (times the batch, bmm)
                a, b = (args[i] for i in MATMULS[name])
                self.mm_seconds += seconds
                self.mm_flops += 2 * math.prod(a.shape) * b.shape[-1]
            return out

    optimizer_seconds = []
    step = grpo.optimizer_step

    def timed_step(*args, **kwargs):
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        optimizer_seconds.append(time.perf_counter() - t0)
        return out

    times = OpTimes()
    grpo.optimizer_step = timed_step  # (train_on_rollout calls it by its name in grpo)
    try:
        t0 = time.perf_counter()
        with times:
            grpo.train_on_rollout(trainer, batch)
        timed = time.perf_counter() - t0
    finally:
        grpo.optimizer_step = step
    total = sum(times.seconds.values())
    print(f"machine: {hardware_line()}, {trainer.cfg.dtype}")
    print(f"batch: {described}; one update {statistics.median(plains):.2f} s (median of "
          f"{len(plains)}: {', '.join(f'{t:.2f}' for t in plains)}); timed op by op {timed:.2f} s, "
          f"of which the operators' own {total:.2f} s ({sum(times.calls.values()):,} calls; each "
          f"with the Python call into it: an upper bound on what they cost)")
    print(f"matmuls (mm, addmm, bmm, baddbmm): {times.mm_seconds:.2f} s, "
          f"{100 * times.mm_seconds / total:.0f} % of the operators' own time, "
          f"{times.mm_flops / 1e9:,.0f} GFLOP at {times.mm_flops / times.mm_seconds / 1e9:,.0f} "
          f"GFLOP/s; this CPU's matmul at 1600x576 @ 576x1536: {rate:,.0f} GFLOP/s. (SDPA's "
          f"kernels, which long rows take, are listed below, not counted here)")
    print(f"the optimizer step (clipping, AdamW, the bf16 copy's refresh): "
          f"{sum(optimizer_seconds):.3f} s of the op-by-op update (its operators are in the list "
          f"too)")
    print(f"{'ms':>8s} {'calls':>6s}  operator: its tensor arguments' shapes ([...] a list)")
    for (name, shapes), seconds in sorted(times.seconds.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{1e3 * seconds:8.1f} {times.calls[name, shapes]:6d}  {name}: "
              f"{', '.join(map(str, shapes))}")
    return times


def _shape(arg) -> str | None:
    """A tensor argument's shape (2x3), a list of tensors' ([272 tensors]); None for the rest."""
    if hasattr(arg, "shape"):
        return "x".join(map(str, arg.shape)) or "scalar"
    if isinstance(arg, (list, tuple)) and arg and all(hasattr(t, "shape") for t in arg):
        return f"[{len(arg)} tensors]"
    return None


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
    parser.add_argument("--by-op", action="store_true", help="operators timed alone, no profiler")
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
    plains = []
    for _ in range(3 if args.by_op else 1):  # (one update's time swings by a tenth on a VM)
        t0 = time.perf_counter()
        train_on_rollout(trainer, batch)
        plains.append(time.perf_counter() - t0)
    plain = plains[0]
    described = f"{B // G} groups of {G}, {P} + {'' if args.bench else '5-'}{T} tokens"
    if args.by_op:
        by_op(trainer, batch, plains, matmul_gflops(DTYPES[cfg.dtype]), described)
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

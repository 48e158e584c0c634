"""Where a GRPO step's time goes, phase by phase, beside the bound the machine holds each phase to.

    python benchmarks/phases.py --run                 # the default task: grpo.py --steps 6
                                                      # --eval-every 3, then the table
    python benchmarks/phases.py --run -- --dtype bf16 # grpo.py flags after --
    python benchmarks/phases.py out/grpo              # the table of a run already made

Per phase, the median seconds a step (an evaluation for `evaluation`), the seconds the phase would
take at the machine's limit, and their ratio (hardware.py):

    generation   the longer of two floors: its model FLOPs (each prompt's prefill, each fed-back
                 token's forward and attention) over the matmul peak, and its bytes (weights
                 once a step, each token's context of keys and values) over the memory
                 bandwidth                                                  gen_roofline_frac
    update       the model FLOPs of the policy's forward and backward and the KL reference's
                 forward (beta > 0) over the matmul peak                    mfu
    sync         the weights read in fp32 and written in the engine's dtype over the bandwidth
                 (none where the HF engine decodes from the trainer's own tensors)
    evaluation   as generation, for the greedy held-out pass                eval_roofline_frac
    rewards      grading on the CPU: no bound is claimed
    rollout log  the log-probs of its detail rows after the update, a no-grad pass: none claimed

The bandwidth and peak are a GPU's datasheet figures, or on a CPU measured once by the run (a
256 MB copy, a 512x2048x2048 matmul on all threads, a 128x512x512 one where the dtype is
emulated); both are printed. Then the update's seconds against its trained tokens (update_line):
what each step pays whatever its size -- the optimizer step, passes over the weights -- which
holds a run of small updates below the mfu its tokens reach. The last line names the phase with
the most seconds above its bound: where the next speed-up is.
"""

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def table(folder: Path, rows: list[dict]) -> list[tuple]:
    """(phase, seconds, bound seconds or None, what bounds it) from a run's metrics.jsonl rows and
    its folder's config."""
    import torch
    from hardware import DTYPES, memory_bandwidth
    from model import load_model
    config = json.loads(next(folder.glob("*_config.json")).read_text())  # (grpo_config.json)
    steps = [r for r in rows if "gen_seconds" in r]
    evals = [r for r in rows if "eval_seconds" in r]
    med = lambda rs, key: statistics.median(r.get(key, 0.0) for r in rs)  # noqa: E731
    gen, sync = med(steps, "gen_seconds"), med(steps, "sync_seconds")
    # (the update as mfu counts it: the steps that trained, without the rollout log's pass)
    trained = [r for r in steps if r.get("trained_tokens")] or steps
    train = statistics.median(r["train_seconds"] - r.get("detail_seconds", 0.0) for r in trained)
    model, _ = load_model(config["model"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[config["dtype"]] if config["dtype"] in DTYPES else torch.float32
    bandwidth = memory_bandwidth(device)[0]
    params = sum(p.numel() for p in model.parameters())
    sync_bytes = params * (4 + torch.empty((), dtype=dtype).element_size())
    peak = med(trained, "peak_flops")
    update_bound = med(trained, "model_flops") / peak if peak else None
    reference = " and the KL reference's forward" if config.get("beta", 0) > 0 else ""
    out = [("generation", gen, gen * med(steps, "gen_roofline_frac"), binding(steps, "gen")),
           ("update", train, update_bound,
            f"policy forward + backward{reference} over {peak / 1e9:.0f} GFLOP/s matmul peak"),
           ("sync", sync, sync_bytes / bandwidth, f"{params / 1e6:.0f}M weights read and written")
           if sync else ("sync", 0.0, None, "none: the HF engine decodes from the trainer's own"),
           ("rewards", med(steps, "reward_seconds"), None, "grading (no bound claimed)"),
           ("rollout log", med(steps, "detail_seconds"), None,
            "its pass over the trained rows after the update (no bound claimed)"
            if any("detail_seconds" in r for r in steps) else "not recorded by this run")]
    if evals:
        ev = med(evals, "eval_seconds")
        out.insert(3, ("evaluation", ev, ev * med(evals, "eval_roofline_frac") or None,
                       binding(evals, "eval") + ", greedy held-out"))
    return out


class UpdateLine(NamedTuple):
    """A line through a run's updates: seconds = fixed + per_token x trained tokens."""
    fixed: float  # seconds a step, whatever its tokens
    per_token: float  # seconds a trained token
    mfu_without: float  # the steps' median mfu with `fixed` taken out of each


WIDEST = 1.5  # the steps' most trained tokens at least this many times their fewest


def update_line(steps: list[dict]) -> UpdateLine | None:
    """The update's seconds (less the rollout log's pass, as mfu counts them) against its trained
    tokens, over the steps that trained after the first (which carries the process's warm-ups).
    Theil-Sen's line -- the median of the slopes between every two steps, then the median
    intercept -- so that one slow step (a compile, a resumed process's first, a busy neighbour)
    does not tilt it, as it tilts least squares. None where no line says anything: fewer than
    three token counts, or too alike (WIDEST), or a line that is no cost model (a slope or a fixed
    part at or below 0, a fixed part above a step's own seconds)."""
    points = [(r["trained_tokens"], r["train_seconds"] - r.get("detail_seconds", 0.0), r)
              for r in steps[1:] if r.get("trained_tokens") and r.get("model_flops")
              and r.get("peak_flops") and math.isfinite(r["train_seconds"])]
    counts = {tokens for tokens, _, _ in points}
    if len(counts) < 3 or max(counts) < WIDEST * min(counts):
        return None
    per_token = statistics.median((s2 - s1) / (t2 - t1) for (t1, s1, _), (t2, s2, _)
                                  in itertools.combinations(points, 2) if t2 != t1)
    fixed = statistics.median(s - per_token * t for t, s, _ in points)
    if per_token <= 0 or not 0 < fixed < min(s for _, s, _ in points):
        return None
    without = statistics.median(r["model_flops"] / ((s - fixed) * r["peak_flops"])
                                for _, s, r in points)
    return UpdateLine(fixed, per_token, without)


def binding(rows: list[dict], phase: str) -> str:
    """Which of a phase's two floors binds (the larger, in the median record), in words."""
    compute = statistics.median(r.get(f"{phase}_compute_frac", 0.0) for r in rows)
    memory = statistics.median(r.get(f"{phase}_memory_frac", 0.0) for r in rows)
    return ("compute-bound: model FLOPs over the matmul peak" if compute >= memory else
            "memory-bound: weights + KV bytes over the bandwidth")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", help="a grpo.py run's --out, instead of --run")
    parser.add_argument("--run", action="store_true", help="run the default task first")
    args, extra = parser.parse_known_args()  # (with --run: more grpo.py flags)
    if args.run:
        tmp = tempfile.mkdtemp()
        subprocess.run([sys.executable, "grpo.py", "--steps", "6", "--eval-every", "3",
                        "--out", tmp, *[flag for flag in extra if flag != "--"]], cwd=ROOT,
                       check=True)
        folder = Path(tmp)
    elif args.folder and not extra:
        folder = Path(args.folder)
    else:
        parser.error("give a run folder, or --run")
    from hardware import hardware_line
    print(f"machine: {hardware_line()}; run: {folder}")
    print(f"{'phase':>11} {'seconds':>8} {'bound s':>8} {'ratio':>6}  bound")
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    rows = table(folder, metrics)
    for phase, seconds, bound, what in rows:
        ratio = f"{bound / seconds:6.1%}" if bound and seconds else f"{'-':>6}"
        print(f"{phase:>11} {seconds:8.2f} {bound or 0:8.2f} {ratio}  {what}")
    line = update_line([r for r in metrics if "gen_seconds" in r])
    print(f"update: {line.fixed:.2f} s a step + {1e3 * line.per_token:.3f} ms a trained token "
          f"(Theil-Sen's line through the steps after the first); without the fixed part the "
          f"steps' median mfu would be {line.mfu_without:.1%}" if line else
          "update: no line through its seconds against its tokens (too few steps, too alike, or "
          "none with a fixed part and a slope above 0)")
    slack = max(rows, key=lambda r: r[1] - (r[2] or 0))
    each = "an evaluation" if slack[0] == "evaluation" else "a step"
    print(f"most seconds above its bound: {slack[0]} ({slack[1] - (slack[2] or 0):.1f} s {each})")


if __name__ == "__main__":
    main()

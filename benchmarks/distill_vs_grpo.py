"""Held-out accuracy per step of GRPO and of on-policy distillation from the same untrained model,
as a table and a plot (docs/distill.md). Run the three commands first (same machine, same seed, so
the same prompts every step):

    python grpo.py --eval-every 1 --out out/cmp/grpo                      # also the teacher
    python distill.py --teacher out/cmp/grpo/model --eval-every 1 --out out/cmp/distill
    python distill.py --teacher out/cmp/grpo/model --eval-every 1 --lr 3e-5 --steps 8 \\
        --out out/cmp/distill-3e-5
    python benchmarks/distill_vs_grpo.py out/cmp/grpo out/cmp/distill out/cmp/distill-3e-5

It prints, for each run, the first step whose held-out accuracy reaches 90 % of the teacher's
final accuracy (the GRPO run's last evaluation), and writes docs/distill_vs_grpo.png.
"""

import argparse
import json
from pathlib import Path


def accuracy_by_step(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("grpo", type=Path, help="the GRPO run (its model is the teacher)")
    parser.add_argument("distill", type=Path, nargs="+", help="distill.py runs")
    parser.add_argument("--plot", type=Path, default=Path("docs/distill_vs_grpo.png"))
    args = parser.parse_args()
    runs = {"GRPO": accuracy_by_step(args.grpo)}
    for run in args.distill:
        config = json.loads((run / "distill_config.json").read_text())
        runs[f"distillation, lr {config['lr']:g}"] = accuracy_by_step(run)
    teacher = runs["GRPO"][max(runs["GRPO"])]
    target = 0.9 * teacher
    print(f"teacher (GRPO's final model): {100 * teacher:.1f} %; 90 % of it: {100 * target:.1f} %")
    steps = sorted(set().union(*runs.values()))
    print("| step | " + " | ".join(runs) + " |")
    print("|---:|" + "---:|" * len(runs))
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{100 * r[s]:.1f}" if s in r else "" for r in
                                         runs.values()) + " |")
    for name, r in runs.items():
        reached = [s for s in sorted(r) if r[s] >= target]
        print(f"{name}: 90 % of the teacher at step {reached[0] if reached else 'never'}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, r in runs.items():
        ax.plot(sorted(r), [100 * r[s] for s in sorted(r)], "o-", markersize=3, label=name)
    ax.axhline(100 * target, color="gray", ls="--", lw=1, label="90 % of the teacher")
    ax.set_xlabel("step (8 prompts x 8 samples each)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("SmolLM2-135M on arith: GRPO vs on-policy distillation from GRPO's model",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

"""What RL does to a learned reward: GRPO against a reward model beside GRPO against the verifiable
reward, same model, steps and seeds -- the proxy reward the policy climbs, and the true held-out
accuracy, step by step (docs/reward-models.md).

    python rm.py --out out/rm                                     # the reward model
    python grpo.py --eval-every 2 --out out/rl-true               # the verifiable reward
    python grpo.py --reward "" --reward-model out/rm --eval-every 2 --out out/rl-proxy
    python benchmarks/proxy_vs_gold.py out/rl-true out/rl-proxy [more runs...] --out plot.png

Each run folder is drawn with its --out as its label: held-out greedy accuracy (the truth) against
the step, and, for runs whose reward came from a reward model, the mean proxy reward of the step's
samples (right axis). A table of both per evaluation step is printed.
"""

import argparse
import json
from pathlib import Path


def read(folder: str) -> list[dict]:
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def proxy_key(rows: list[dict]) -> str | None:
    """The metric of a run's reward model: reward_rm:<name>."""
    keys = {k for r in rows for k in r if k.startswith("reward_rm:")}
    return sorted(keys)[0] if keys else None


def main(folders: list[str], out: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, truth = plt.subplots(figsize=(8, 4.5))
    proxy = truth.twinx()
    for k, folder in enumerate(folders):
        rows, color = read(folder), f"C{k}"
        held = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
        truth.plot(*zip(*held), "o-", color=color, label=f"{folder}: held-out accuracy")
        key = proxy_key(rows)
        if key:
            steps = [(r["step"], r[key]) for r in rows if key in r]
            proxy.plot(*zip(*steps), "--", color=color, alpha=0.7,
                       label=f"{folder}: proxy reward ({key[len('reward_'):]})")
        print(f"\n{folder}" + (f" (proxy: {key})" if key else ""))
        by_step = {r["step"]: r for r in rows}
        for step, accuracy in held:
            reward = by_step.get(step, {}).get(key) if key else None
            print(f"  step {step:3d}  held-out {accuracy:6.1%}" +
                  (f"  proxy reward {reward:+.3f}" if reward is not None else ""))
    truth.set_xlabel("step")
    truth.set_ylabel("held-out greedy accuracy (the truth)")
    proxy.set_ylabel("mean reward-model score of the step's samples (the proxy)")
    lines = truth.get_legend_handles_labels()[0] + proxy.get_legend_handles_labels()[0]
    labels = truth.get_legend_handles_labels()[1] + proxy.get_legend_handles_labels()[1]
    truth.legend(lines, labels, fontsize=7, loc="lower right")
    truth.set_title("GRPO against a learned reward vs the verifiable one")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", help="grpo.py output folders")
    parser.add_argument("--out", default="reward_models.png")
    args = parser.parse_args()
    main(args.folders, args.out)

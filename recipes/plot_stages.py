"""One curves.png for a staged run: each stage's metrics.jsonl, steps laid end to end.

    python recipes/plot_stages.py out/stage1 out/stage2 out/stage3 --out curves.png
    python recipes/plot_stages.py out/sft-guess out/grpo-guess --loss-keys eval_loss \
        --eval-keys eval_accuracy,eval_tool_call_rate --out guess.png      # SFT, then GRPO
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from charts import plot_curves  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stages", nargs="+", help="output folders of the stages, in order")
    parser.add_argument("--out", default="curves.png")
    parser.add_argument("--train-keys", default="reward,accuracy", help="per-step metrics")
    parser.add_argument("--eval-keys", default="eval_accuracy", help="held-out metrics")
    parser.add_argument("--loss-keys", default="", help="losses, on an axis of their own")
    args = parser.parse_args()
    history, offset, bounds = [], 0, []
    for folder in args.stages:
        rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        history += [{**r, "step": r["step"] + offset} for r in rows]
        offset += max(r["step"] for r in rows)
        bounds.append(offset)
    keys = {name: tuple(k for k in getattr(args, name).split(",") if k)
            for name in ("train_keys", "eval_keys", "loss_keys")}
    plot_curves(history, args.out, title=" | ".join(Path(s).name for s in args.stages),
                stage_bounds=bounds[:-1], **keys)
    print(f"wrote {args.out}")

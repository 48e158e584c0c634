"""One curves.png for a staged run: each stage's metrics.jsonl, steps laid end to end.

    python recipes/plot_stages.py out/stage1 out/stage2 out/stage3 --out curves.png
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evaluate import plot_curves  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stages", nargs="+", help="output folders of the stages, in order")
    parser.add_argument("--out", default="curves.png")
    args = parser.parse_args()
    history, offset, bounds = [], 0, []
    for folder in args.stages:
        rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        history += [{**r, "step": r["step"] + offset} for r in rows]
        offset += max(r["step"] for r in rows)
        bounds.append(offset)
    plot_curves(history, args.out, title=" | ".join(Path(s).name for s in args.stages),
                stage_bounds=bounds[:-1])
    print(f"wrote {args.out}")

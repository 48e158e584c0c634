"""Rerun findings of the atlas and check each effect against the one recorded in docs/findings/:
the same sign, and within the recorded spread across seeds. A benchmark, not a test: each finding
takes its arms x seeds x steps of real runs (tens of minutes on a 2-core CPU).

    python experiments/run_all.py length_bias              # one finding
    python experiments/run_all.py                          # every finding recorded
    python experiments/run_all.py length_bias --tiny       # the machinery, in seconds

A rerun goes to a folder of its own (--runs, default out/experiments/rerun), so the recorded runs
are never overwritten. The table: finding, the recorded effect and spread, the rerun's, the
verdict (same sign and |rerun - recorded| <= the recorded spread, at least TOLERANCE), seconds.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "findings"
TOLERANCE = 1e-3  # (an effect recorded with no spread -- one seed -- still allows rounding)


def rerun(name: str, runs: Path, tiny: bool) -> tuple[dict, float]:
    """The finding run again into `runs`: its numbers, and its seconds."""
    out = Path(tempfile.mkdtemp(prefix=f"rerun-{name}-"))
    t0 = time.time()
    subprocess.run([sys.executable, str(ROOT / "experiments" / f"{name}.py"), "--fresh",
                    "--runs", str(runs), "--out", str(out)] + (["--tiny"] if tiny else []),
                   check=True)
    return json.loads((out / f"{name}.json").read_text()), time.time() - t0


def verdict(recorded: dict, again: dict) -> str:
    was, spread, now = recorded["effect"], recorded["effect_spread"] or 0.0, again["effect"]
    if was is None or now is None:
        return "no effect measured"
    same_sign = (was > 0) == (now > 0) or abs(was) <= TOLERANCE
    close = abs(now - was) <= max(spread, TOLERANCE)
    return "held" if same_sign and close else ("same sign, outside the spread" if same_sign
                                               else "sign changed")


def number(x) -> str:
    return "–" if x is None else f"{x:+.3g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="findings (default: every one recorded)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model: the machinery only")
    parser.add_argument("--runs", default=str(ROOT / "out" / "experiments" / "rerun"))
    args = parser.parse_args()
    names = args.names or sorted(p.stem for p in RECORDED.glob("*.json"))
    rows = ["| finding | recorded effect ± spread | rerun ± spread | verdict | seconds |",
            "|---|---|---|---|---|"]
    for name in names:
        path = RECORDED / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"error: {name}: nothing recorded in {path}; run python "
                             f"experiments/{name}.py first")
        recorded = json.loads(path.read_text())
        again, seconds = rerun(name, Path(args.runs), args.tiny)
        rows.append(f"| {name} | {number(recorded['effect'])} ± "
                    f"{number(recorded['effect_spread'])} | {number(again['effect'])} ± "
                    f"{number(again['effect_spread'])} | {verdict(recorded, again)} | "
                    f"{seconds:.0f} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

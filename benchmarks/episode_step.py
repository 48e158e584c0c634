"""GRPO steps on agentic episodes from an SFT warm start: this tree beside an earlier commit, in one
run, with each run's seconds per phase and peak resident memory.

    python sft.py --data guess --out out/sft-guess             # the warm start (once)
    python benchmarks/episode_step.py out/sft-guess            # guess, 8 x 8 episodes: this tree
                                                               # beside 792edfd (the issue's base)
    python sft.py --out out/sft                                # multiply's warm start
    python benchmarks/episode_step.py out/sft --data multiply --base ""   # this tree alone
    python benchmarks/episode_step.py out/sft --data multiply --base "" --micro-batch-size 64
                                                               # (other flags go to grpo.py)

Each tree runs `grpo.py --data D --init-from WARM --steps S --eval-every 0` with the task's own
defaults (guess: 8 prompts x 8 episodes, 5 turns of <= 48 tokens) in a process of its own -- the
earlier commit from a `git worktree` made for the run and removed after it -- under the same seed,
so both start from the same weights and the same games. Printed per tree: the median over the
timed steps (all but the first when S > 1: the first pays for start-up caches) of the step's
generation and update seconds, the tokens the update trained per second, the prompt tokens served
from a cache and gen_roofline_frac / mfu where the tree logs them, and the process's peak resident
memory (the kernel's high-water mark, start-up and the step-0-free loop included) and the highest
seen in each phase (rollout, update, the rest). The last line is the speed-up of a whole step
(generation + scoring + update + sync).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def child(script: str, argv: list[str]):
    """In the run's process (`--child`): run `script` as __main__ from the tree in the working
    directory, and print, as it exits, the process's peak resident memory (the kernel's
    high-water mark) and the highest resident memory seen in each phase -- a thread reads it
    every 5 ms, labelled by grpo.py's functions as they run: `rollout` (sampling and episodes),
    `update` (train_on_rollout), `rest` (loading, scoring, the loop's own work)."""
    import atexit
    import resource
    import runpy
    import threading
    sys.path.insert(0, ".")
    import grpo
    phase, peaks = ["rest"], {}

    def watch():
        page = resource.getpagesize()
        while True:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * page / 2**30
            peaks[phase[0]] = max(peaks.get(phase[0], 0.0), rss)
            time.sleep(0.005)

    def labelled(name, fn):
        def run(*args, **kwargs):
            phase[0] = name
            try:
                return fn(*args, **kwargs)
            finally:
                phase[0] = "rest"
        return run

    for name, fn in (("rollout", "start_rollout"), ("update", "train_on_rollout")):
        if hasattr(grpo, fn):  # (an earlier tree may name them otherwise)
            setattr(grpo, fn, labelled(name, getattr(grpo, fn)))
    threading.Thread(target=watch, daemon=True).start()
    peak_kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # noqa: E731
    atexit.register(lambda: print("peak_rss_kib", peak_kib(), "phases", json.dumps(peaks),
                                  flush=True))
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def run_tree(tree: Path, args, out: Path) -> dict:
    """One tree's run: its metrics per step and its peak RSS."""
    command = [sys.executable, __file__, "--child", "grpo.py", "--data", args.data, "--init-from",
               str(Path(args.warm_start).resolve()), "--steps", str(args.steps),
               "--eval-every", "0", "--out", str(out), "--seed", str(args.seed), *args.extra]
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"error: the run in {tree} failed:\n{done.stderr[-3000:]}")
    peak = [line for line in done.stdout.splitlines() if line.startswith("peak_rss_kib")]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", 0) > 0 and "gen_seconds" in r]
    words = peak[-1].split(maxsplit=3)
    return {"steps": steps, "peak_gb": int(words[1]) / 2**20, "phases": json.loads(words[3]),
            "wall": wall}


def summary(result: dict) -> dict:
    timed = result["steps"][1:] or result["steps"]
    median = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
    step = lambda r: sum(r.get(k, 0.0) for k in ("gen_seconds", "reward_seconds",  # noqa: E731
                                                  "train_seconds", "sync_seconds"))
    return {"step_s": statistics.median(step(r) for r in timed), "gen_s": median("gen_seconds"),
            "train_s": median("train_seconds"), "train_tok_s": median("train_tokens_per_s"),
            "turns": median("turns"), "cache_hit": median("prompt_cache_hit"),
            "gen_roofline_frac": median("gen_roofline_frac"), "mfu": median("mfu"),
            "peak_gb": result["peak_gb"], "wall_s": result["wall"],
            **{f"{phase}_gb": gb for phase, gb in result["phases"].items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("warm_start", help="the SFT warm start (sft.py's --out)")
    parser.add_argument("--data", default="guess", help="the agentic task (guess, multiply)")
    parser.add_argument("--base", default="792edfd", help="the earlier commit; '' for none")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args, extra = parser.parse_known_args()  # more grpo.py flags, e.g. --micro-batch-size 64
    args.extra = [flag for flag in extra if flag != "--"]
    from hardware import hardware_line
    print(f"machine: {hardware_line()}; {args.data} from {args.warm_start}, {args.steps} steps a "
          f"tree", flush=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = [(f"this tree ({head})", ROOT)]
        if args.base:
            base = Path(tmp) / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT,
                           check=True, capture_output=True)
            trees.insert(0, (args.base, base))
        try:
            for name, tree in trees:
                results[name] = summary(run_tree(tree, args, Path(tmp) / f"out-{len(results)}"))
                print(name, json.dumps({k: round(v, 3) for k, v in results[name].items()}),
                      flush=True)
        finally:
            if args.base:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    print(f"\n{'tree':>22} {'step s':>8} {'gen s':>7} {'train s':>8} {'train tok/s':>11} "
          f"{'turns':>6} {'cached':>7} {'bw':>6} {'mfu':>6} {'peak GB':>8}  peak GB in each phase")
    for name, r in results.items():
        phases = ", ".join(f"{p} {r.get(p + '_gb', 0):.2f}" for p in ("rollout", "update", "rest"))
        print(f"{name:>22} {r['step_s']:8.1f} {r['gen_s']:7.1f} {r['train_s']:8.1f} "
              f"{r['train_tok_s']:11.0f} {r['turns']:6.2f} {r['cache_hit']:7.1%} "
              f"{r['gen_roofline_frac']:6.1%} {r['mfu']:6.1%} {r['peak_gb']:8.2f}  {phases}")
    if len(results) == 2:
        before, after = results.values()
        print(f"\nstep speed-up: {before['step_s'] / after['step_s']:.2f}x "
              f"(generation {before['gen_s'] / after['gen_s']:.2f}x, "
              f"update {before['train_s'] / max(after['train_s'], 1e-9):.2f}x)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # one tree's run (run_tree), in that tree
        child(sys.argv[2], sys.argv[3:])
    else:
        sys.path.insert(0, str(ROOT))
        main()

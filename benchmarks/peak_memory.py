"""Peak resident memory of the CPU commands the README prints for the default model: one table,
against the budgets a 16 GB laptop leaves (6 GB a command; 8 GB for ppo.py, which trains two).

    python benchmarks/peak_memory.py                  # every command, each cut to --steps 3
    python benchmarks/peak_memory.py --steps 16       # the commands as printed (much longer)
    python benchmarks/peak_memory.py --only sft,dpo   # these rows (names: --list)

Each command runs in its own process, in order (sft before the GRPO run that starts from it, rm
before the one it scores, grpo before distill and evaluate), into a temporary folder. Two figures
a command: the driver's own peak (the kernel's high-water mark, exact) and the peak of its whole
process tree -- Ray's workers and engines, the grader's pool -- summed, sampled every 0.2 s (a
short spike between samples can be missed). The sum is of proportional set sizes (PSS): a page n
processes share counts 1/n in each, so libraries and Ray's shared-memory object store count once,
as they occupy the machine. Three steps with an evaluation at the start and the end
hold the optimizer's state (made at step 1) and both evaluations, but not a longer run's larger
updates: GRPO trains only the groups whose samples differ in reward, few at the start (2 of 8 at
step 1 of the default run) and all of them later (step 8). The default run peaks at 3.6 GB in
3 steps and at 5.2 GB over its 16 (`--steps 16` measures the commands as printed).
"""

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
BUDGET_GB, TWO_MODELS_GB = 6.0, 8.0

# (name, the command as the README prints it): run here as printed (arguments), its out/ folders
# under the temporary one, where it writes <name>/.
COMMANDS = [
    ("grpo", "python grpo.py"),
    ("grpo-eval256", "python grpo.py --steps 30 --eval-every 10 --eval-size 256"),
    ("grpo-ray", "python grpo.py --num-trainers 2 --num-engines 1 --colocate"),
    ("grpo-multiply", "python grpo.py --data multiply"),
    ("grpo-guess", "python grpo.py --data guess"),
    ("sft", "python sft.py"),
    ("grpo-from-sft", "python grpo.py --data multiply --init-from out/sft"),
    ("dpo", "python dpo.py"),
    ("distill", "python distill.py --teacher out/grpo/model"),
    ("rm", "python rm.py"),
    ("grpo-reward-model", 'python grpo.py --reward "" --reward-model out/rm'),
    ("ppo", "python ppo.py"),
    ("evaluate", "python evaluate.py --model out/grpo"),
]
NEEDS = {"grpo-from-sft": "sft", "distill": "grpo", "grpo-reward-model": "rm", "evaluate": "grpo"}
TRAINS = {"grpo.py", "sft.py", "dpo.py", "distill.py", "rm.py", "ppo.py"}  # (take --steps)


def arguments(name: str, printed: str, out: str) -> list[str]:
    """A printed command's arguments (the script first) as this table runs it: each out/ folder
    under `out` (out/sft is <out>/sft, where the row named sft writes), and --out <out>/<name>."""
    args = [f"{out}/{a[4:]}" if a.startswith("out/") else a for a in shlex.split(printed)[1:]]
    return args + ["--out", f"{out}/{name}"]


def tree_pss(process: psutil.Process) -> dict[str, int]:
    """Resident bytes of a process and every process under it, now, shared pages split: by
    process name (Ray names its actors' processes ray::<Actor>), summed over the same name."""
    parts = {}
    for p in [process] + process.children(recursive=True):
        try:
            name = "driver" if p.pid == process.pid else p.name()
            parts[name] = parts.get(name, 0) + p.memory_full_info().pss
        except psutil.Error:  # (ended between the listing and the reading)
            pass
    return parts


def measure(argv: list[str]) -> tuple[float, float, float, int, dict]:
    """(the driver's peak GB, its process tree's sampled peak GB, seconds, exit status, the
    tree's processes at that peak in GB by name)."""
    t0 = time.time()
    child = subprocess.Popen([sys.executable] + argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    process, peak, at_peak, done = psutil.Process(child.pid), [0], {}, threading.Event()

    def sample():
        while not done.is_set():
            try:
                parts = tree_pss(process)
                total = sum(parts.values())
                if total > peak[0]:
                    peak[0] = total
                    at_peak.clear()
                    at_peak.update({name: b / 2**30 for name, b in parts.items()})
            except psutil.Error:
                pass
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)  # the child's own rusage: ru_maxrss in KiB
    child.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if child.returncode:
        print(stderr[-2000:], file=sys.stderr)
    return usage.ru_maxrss / 2**20, peak[0] / 2**30, time.time() - t0, child.returncode, at_peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of each training "
                        "command (evaluated at the start and the end)")
    parser.add_argument("--only", default="", help="comma-separated row names (see --list), "
                        "with the rows whose output they start from (grpo-from-sft: sft)")
    parser.add_argument("--list", action="store_true", help="print the rows' names and commands")
    args = parser.parse_args()
    names = [name for name, _ in COMMANDS]
    if args.list:
        print("\n".join(f"{name:18} {printed}" for name, printed in COMMANDS))
        return
    keep = [p for p in args.only.split(",") if p]
    unknown = [p for p in keep if p not in names]
    if unknown:
        raise SystemExit(f"error: --only: no row named {', '.join(unknown)} "
                         f"(rows: {', '.join(names)})")
    keep += [NEEDS[p] for p in keep if p in NEEDS]
    sys.path.insert(0, str(ROOT))
    from hardware import hardware_line
    print(f"machine: {hardware_line()}; each training command cut to --steps {args.steps}")
    rows = ["| command | driver peak GB | process tree peak GB (PSS, sampled) | budget | seconds |",
            "|---|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="peak-memory-") as out:
        for name, printed in COMMANDS:
            if keep and name not in keep:
                continue
            argv = arguments(name, printed, out)
            if argv[0] in TRAINS:  # (after the printed ones: the last of a flag wins)
                argv += ["--steps", str(args.steps), "--eval-every", str(args.steps)]
            driver, tree, seconds, status, at_peak = measure(argv)
            budget = TWO_MODELS_GB if name == "ppo" else BUDGET_GB
            flag = "" if max(driver, tree) <= budget else " **over**"
            failed = f" (exit {status})" if status else ""
            rows.append(f"| `{printed}`{failed} | {driver:.2f} | {tree:.2f} | {budget:.0f}{flag} "
                        f"| {seconds:.0f} |")
            print(rows[-1], flush=True)
            if len(at_peak) > 1:  # (a tree of processes: who held what at its peak)
                print("    the tree at its peak: " + ", ".join(
                    f"{name} {gb:.2f}" for name, gb in sorted(at_peak.items(),
                                                              key=lambda x: -x[1])), flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

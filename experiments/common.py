"""What every finding of the atlas shares (docs/findings.md): its arms -- one command line of an
algorithm each --, run one after another in this process over the seeds; the series each run
leaves in its folder (metrics.jsonl, rollouts.jsonl); the picture and the numbers written for it;
and --tiny, the same experiment on the tests' tiny model in seconds.

A finding's file is a short story over these:

    args = arguments(__doc__, seeds=3, steps=12)               # --tiny, --seeds, --steps, ...
    ARMS = {"token-mean": ["--loss-agg", "token-mean"], "seq-mean": ["--loss-agg", "seq-mean"]}
    runs = run_arms("length_bias", ARMS, args)                 # {arm: {seed: run folder}}
    lengths = {arm: [metric(f, "completion_len") for f in seeds.values()]
               for arm, seeds in runs.items()}                 # a series a seed
    write_finding("length_bias", {"length": lengths}, args, claim=..., effect=...)

A run's folder is out/experiments/<finding>/<arm>-s<seed>/ (--runs: another place). A finished
one is kept: rerunning a finding redraws it (--fresh reruns it). The runs are deterministic for a
machine and dtype; their seconds are printed for the reader, never held to a target.
"""

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TQDM_DISABLE", "1")  # (a line a run, not progress bars)

FINDINGS = ROOT / "docs" / "findings"  # the pictures and numbers docs/findings.md shows
# A finding's runs sample 4 prompts x 8 a step (the default run: 8 x 8), so that 3 seeds of each
# arm fit a 2-core CPU's hour; --prompts-per-step 8 runs them at the default run's size.
PROMPTS_PER_STEP = 4
# The tiny runs' sizes: a few seconds each (the suite runs every finding so, tests/test_experiments)
TINY = ["--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "6",
        "--eval-size", "4", "--log-samples-every", "0"]


def arguments(doc: str, seeds: int, steps: int) -> argparse.Namespace:
    """A finding's command line: --tiny, the seeds and steps (its own defaults), --fresh, --out."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model, 1 step, one "
                        "seed: that it runs and writes its files, not its effect")
    parser.add_argument("--seeds", type=int, default=seeds, help=f"seeds per arm ({seeds})")
    parser.add_argument("--steps", type=int, default=steps, help=f"steps per run ({steps})")
    parser.add_argument("--prompts-per-step", type=int, default=PROMPTS_PER_STEP,
                        help=f"prompts a step, each sampled --num-generations 8 times "
                             f"({PROMPTS_PER_STEP}: half the default run's, to fit a finding's "
                             f"arms x seeds into a 2-core CPU's hour)")
    parser.add_argument("--fresh", action="store_true", help="rerun finished runs too")
    parser.add_argument("--out", default="", help="where the picture and numbers go (default: "
                        "docs/findings; --tiny: <runs>/tiny)")
    parser.add_argument("--runs", default=str(ROOT / "out" / "experiments"),
                        help="where the runs' folders go (out/experiments)")
    args = parser.parse_args()
    if args.tiny:
        args.seeds, args.steps = 1, 1
    args.runs = Path(args.runs)
    args.out = Path(args.out or (args.runs / "tiny" if args.tiny else FINDINGS))
    return args


def tiny_model(runs: Path) -> str:
    """The tests' tiny model (a 2-layer random Llama with the default model's tokenizer), written
    once to <runs>/tiny-model."""
    folder = runs / "tiny-model"
    if not (folder / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from model import DEFAULT_MODEL, load_tokenizer
        tokenizer = load_tokenizer(DEFAULT_MODEL)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=512, tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return str(folder)


def run_arms(name: str, arms: dict[str, list[str]], args, script: str = "grpo",
             common: list[str] = ()) -> dict[str, dict[int, Path]]:
    """Each arm's command line (after `common`) for each seed, one run after another in this
    process: {arm: {seed: its run folder}}. A folder whose run finished is kept (--fresh: run it
    again). --tiny: on the tiny model, at TINY's sizes."""
    import importlib
    from data import parse_config
    module = importlib.import_module(script)
    runs = {}
    for arm, argv in arms.items():
        runs[arm] = {}
        for seed in range(args.seeds):
            slug = re.sub(r"[^a-z0-9.]+", "-", arm.lower()).strip("-")
            out = args.runs / ("tiny-" + name if args.tiny else name) / f"{slug}-s{seed}"
            runs[arm][seed] = out
            line = [*common, *argv, "--seed", str(seed), "--steps", str(args.steps),
                    "--prompts-per-step", str(args.prompts_per_step), "--out", str(out)]
            if args.tiny:
                line = [*line, "--model", tiny_model(args.runs), *TINY]
            cfg = parse_config(module.Config, line)
            done = None if args.fresh else finished_run(args.runs, cfg)
            if done:
                runs[arm][seed] = done
                print(f"{name}: {arm}, seed {seed}: done before ({done})")
                continue
            t0, printed = time.time(), io.StringIO()
            with contextlib.redirect_stdout(printed):
                module.main(cfg)
            print(f"{name}: {arm}, seed {seed}: {time.time() - t0:.0f} s ({out})", flush=True)
    return runs


def finished_run(runs: Path, cfg) -> Path | None:
    """A finished run of this very config (its --out aside) under `runs`, any finding's: an arm
    two findings share (clip_higher's eps_high 0.2 is surrogates' clip) runs once; a run of other
    steps or sizes is run again (the run itself moves the old one aside)."""
    def same(config: dict) -> dict:
        return {k: v for k, v in json.loads(json.dumps(config, default=str)).items() if k != "out"}
    want = same(asdict(cfg))
    for saved in sorted(runs.glob(f"*/*/{cfg.CONFIG_FILE}")):
        if (saved.parent / "model" / "config.json").exists() and \
                same(json.loads(saved.read_text())) == want:
            return saved.parent
    return None


# ---------------------------------------------------------------------------------------------
# What a run left: its metrics by step, and its samples.


def metric(folder: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of each record of <folder>/metrics.jsonl that has `key`."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], float(r[key])) for r in rows if key in r and r[key] is not None]


def samples(folder: Path, kind: str = "train") -> list[dict]:
    """The records of <folder>/rollouts.jsonl of one kind (train: every sample of every step)."""
    from rollout_log import records
    return [r for _, _, r in records(folder / "rollouts.jsonl") if r["kind"] == kind]


def per_step(records: list[dict], value, keep=lambda r: True) -> list[tuple[int, float]]:
    """(step, mean of value(r)) over the records of each step that `keep` keeps."""
    steps: dict[int, list[float]] = {}
    for r in records:
        if keep(r):
            steps.setdefault(r["step"], []).append(value(r))
    return [(s, sum(v) / len(v)) for s, v in sorted(steps.items())]


def correct_counts(model: str, rows: list[dict], n: int, temperature: float,
                   max_new_tokens: int = 24, seed: int = 0) -> list[int]:
    """How many of n samples of each row a model (a folder, or a run folder's model) gets right,
    sampled at `temperature` with the HF engine and graded as grpo.py grades arith (answer-is)."""
    import torch
    from model import DTYPES, choose_dtype, load_model, pick_device
    from evaluate import evaluate_rows
    from reward import Grader
    from rollout import HFRollout, Sampling
    dtype = DTYPES[choose_dtype("auto", pick_device()).name]
    policy, tokenizer = load_model(model, pick_device(), dtype)
    engine = HFRollout(policy, tokenizer, device=pick_device(), dtype=dtype, shares_weights=True)
    grader = Grader()
    with torch.no_grad():
        _, graded = evaluate_rows(engine, tokenizer, rows, template="answer-is", chat=True,
                                  sampling=Sampling(max_new_tokens, temperature, seed=seed), n=n,
                                  grader=grader, progress=False)
    grader.close()
    counts = {r["id"]: 0 for r in rows}
    for g in graded:
        counts[g["id"]] += g["correct"]
    return [counts[r["id"]] for r in rows]


def held_out(model: str, tiny: bool) -> float:
    """Greedy accuracy of a model (a folder, or a run's model/) on arith's held-out problems
    (128; --tiny: 8), as grpo.py's evaluation grades them: after a run, so that arms whose runs
    evaluate nothing share their runs with other findings."""
    from data import arith_heldout
    rows = arith_heldout(8 if tiny else 128)
    return sum(correct_counts(model, rows, 1, 0.0)) / len(rows)


def held_out_gains(runs: dict[str, dict[int, Path]], args, title: str) -> tuple[dict, dict]:
    """Each arm's runs graded on the held-out set at the start and the end: the picture's panels
    (that, and the training accuracy over steps) and each arm's gains, one a seed."""
    from model import DEFAULT_MODEL
    start = held_out(tiny_model(args.runs) if args.tiny else DEFAULT_MODEL, args.tiny)
    ends = {arm: [held_out(str(f / "model"), args.tiny) for f in seeds.values()]
            for arm, seeds in runs.items()}
    panels = {title: {arm: [[(0, start), (args.steps, end)] for end in ends[arm]] for arm in runs},
              "training accuracy": {arm: [metric(f, "accuracy") for f in seeds.values()]
                                    for arm, seeds in runs.items()}}
    return panels, {arm: [end - start for end in ends[arm]] for arm in runs}


# ---------------------------------------------------------------------------------------------
# The picture and the numbers.


def mean_spread(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard deviation across seeds (0 for one seed; None for none)."""
    if not values:
        return None, None
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) \
        if len(values) > 1 else 0.0


def final(series: list[list[tuple[int, float]]], last: int = 3) -> list[float]:
    """Each seed's mean over its last `last` points: one number a seed."""
    return [sum(v for _, v in s[-last:]) / len(s[-last:]) for s in series if s]


def by_seed(a: list[float], b: list[float]) -> list[float]:
    """a - b seed by seed (the arms' runs of one seed share its problems and its start)."""
    return [x - y for x, y in zip(a, b)]


def write_finding(name: str, panels: dict[str, dict[str, list]], args, effect_by_seed: list,
                  effect_name: str, xlabel: str = "step", **record) -> dict:
    """docs/findings/<name>.png -- one panel a quantity, the arms side by side over steps, each
    seed a thin line and the arms' means bold -- and <name>.json: the series, the effect (its
    mean over the seeds, their spread, each seed's: what run_all.py checks a rerun against), and
    `record` (the claim, the paper, the numbers). panels: {title: {arm: [a seed's [(step,
    value)], ...]}}."""
    effect, spread = mean_spread(effect_by_seed)
    record.update(effect=effect, effect_spread=spread, effect_by_seed=effect_by_seed,
                  effect_name=effect_name)
    print(f"{name}: {effect_name}: {effect} (spread {spread}, by seed {effect_by_seed})")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args.out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, arms) in zip(axes[0], panels.items()):
        for color, (arm, seeds) in zip(colors, arms.items()):
            for s in seeds:
                ax.plot([x for x, _ in s], [y for _, y in s], color=color, alpha=0.3, lw=0.8)
            steps = sorted({x for s in seeds for x, _ in s})
            means = [sum(y for s in seeds for x, y in s if x == step) /
                     max(1, sum(1 for s in seeds for x, _ in s if x == step)) for step in steps]
            ax.plot(steps, means, color=color, lw=2, label=f"{arm} ({len(seeds)} seeds)")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=8)
    fig.suptitle(record.get("claim", name), fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out / f"{name}.png", dpi=110)
    plt.close(fig)
    numbers = {"finding": name, "tiny": args.tiny, "seeds": args.seeds, "steps": args.steps,
               **record, "series": panels}
    from hardware import machine
    numbers["machine"] = machine()
    (args.out / f"{name}.json").write_text(json.dumps(numbers, indent=1))
    print(f"{name}: wrote {args.out / (name + '.png')} and {name}.json")
    return numbers

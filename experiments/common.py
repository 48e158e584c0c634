"""What every finding of the atlas shares (docs/findings.md): its arms -- one command line of an
algorithm each --, run one after another in this process over the seeds; the series each run
leaves in its folder (metrics.jsonl, rollouts.jsonl); the statistics of an effect over the seeds
and the verdict they give; the picture and the numbers written for it; and --tiny, the same
experiment on the tests' tiny model in seconds.

A finding's file is a short story over these:

    args = arguments(__doc__, seeds=5, steps=12)               # --tiny, --seeds, --steps, ...
    ARMS = {"seq-mean": ["--loss-agg", "seq-mean"], "seq-sum-norm": ["--loss-agg", "seq-sum-norm"]}
    runs = run_arms("length_bias", ARMS, args)                 # {arm: {seed: run folder}}
    lengths = {arm: [metric(f, "completion_len") for f in seeds.values()]
               for arm, seeds in runs.items()}                 # a series a seed
    longer = by_seed(final(lengths["seq-mean"], args.steps), final(lengths["seq-sum-norm"], ...))
    write_finding("length_bias", {"length": lengths}, args, claim=..., paper=...,
                  terms={"longer": term(longer, "positive", "tokens, seq-mean minus ...", 1.0)})

A run's folder is out/experiments/<finding>/<arm>-s<seed>/ (--runs: another place). A finished
one is kept: rerunning a finding redraws it (--fresh reruns it), and a run of the same config is
run once for every finding that needs it. The runs are deterministic for a machine and dtype;
their seconds are printed for the reader, never held to a target.

The verdict of a term is mechanical (`verdict`): the Student-t 95 % interval of its effect over the
seeds against the sign the paper expects -- reproduced or contradicted only where the interval
excludes 0, "not at this scale" where it lies within the margin (no effect of the size that would
count), inconclusive otherwise.
"""

import argparse
import contextlib
import glob
import hashlib
import io
import json
import math
import os
import re
import sys
import textwrap
import time
from dataclasses import MISSING, asdict, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TQDM_DISABLE", "1")  # (a line a run, not progress bars)

FINDINGS = ROOT / "docs" / "findings"  # the pictures and numbers docs/findings.md shows
# A finding's runs sample 4 prompts x 8 a step (the default run: 8 x 8), so that a finding's arms
# x seeds fit a 2-core CPU's hour; --prompts-per-step 8 runs them at the default run's size.
PROMPTS_PER_STEP = 4
# The findings whose arms differ only off-policy (clip_higher, surrogates, spurious_rewards): each
# rollout batch trained on 4 times, so that the ratio leaves 1 and the clip acts (DAPO, too,
# trains a rollout batch in several mini-batch steps), at a learning rate at which the clipped
# baseline still learns (5e-5 did not: 0.07 accuracy after 12 steps; one update at 2e-5 reached
# 0.35). Their runs of one config serve all three.
OFF_POLICY = ["--data", "arith", "--updates-per-rollout", "4", "--lr", "1e-5", "--eval-every", "0"]
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


def start_model(args) -> str:
    """The model every arm starts from: the default model, or --tiny's."""
    from model import DEFAULT_MODEL
    return tiny_model(args.runs) if args.tiny else DEFAULT_MODEL


def run_arms(name: str, arms: dict[str, list[str]], args, script: str = "grpo",
             common: list[str] = (), every_step=None, seeds=None) -> dict[str, dict[int, Path]]:
    """Each arm's command line (after `common`) for each seed, one run after another in this
    process: {arm: {seed: its run folder}}. A folder whose run finished is kept (--fresh: run it
    again). --tiny: on the tiny model, at TINY's sizes. every_step: a Measure taken of the policy
    at the end of every step, logged with the step's metrics (a finished run without it is run
    again). seeds: which (default: range(args.seeds))."""
    runs = {}
    for arm, argv in arms.items():
        runs[arm] = {}
        for seed in range(args.seeds) if seeds is None else seeds:
            slug = re.sub(r"[^a-z0-9.]+", "-", arm.lower()).strip("-")
            out = args.runs / ("tiny-" + name if args.tiny else name) / f"{slug}-s{seed}"
            line = [*common, *argv, "--seed", str(seed), "--steps", str(args.steps),
                    "--prompts-per-step", str(args.prompts_per_step), "--out", str(out)]
            if args.tiny:
                line = [*line, "--model", tiny_model(args.runs), *TINY]
            runs[arm][seed] = run_once(f"{name}: {arm}, seed {seed}", script, line, args,
                                       every_step)
    return runs


def run_once(title: str, script: str, line: list[str], args, every_step=None) -> Path:
    """One run of `script`'s main with this command line (its --out: the folder), or the folder
    of a finished run of the very same config (any finding's). A run stopped in that folder or a
    <folder>.N (the same config, checkpointed) goes on from its checkpoint; a folder holding any
    other run (finished, another config's, --fresh) is left as it is -- nothing there is moved or
    lost: a run into it would move its run aside -- and the run goes to the next free <folder>.N."""
    import importlib
    from cli import parse_config
    module = importlib.import_module(script)
    cfg = parse_config(module.Config, line)
    done = None if args.fresh else finished_run(args.runs, cfg, every_step)
    if done:
        print(f"{title}: done before ({done})")
        return done
    folder, resume = where_to_run(cfg, args.fresh)
    if resume:  # (a stopped atlas goes on)
        cfg = parse_config(module.Config, [*line, "--out", str(folder), "--resume", "auto"])
        print(f"{title}: resuming the run stopped in {folder}", flush=True)
    elif folder != Path(cfg.out):
        print(f"{title}: {cfg.out} holds a run this one cannot take up (finished, another "
              f"config's, --fresh, or running now), left as it is: it goes to {folder}",
              flush=True)
        cfg = parse_config(module.Config, [*line, "--out", str(folder)])
    t0, printed = time.time(), io.StringIO()
    with contextlib.redirect_stdout(printed), measured(module, every_step):
        module.main(cfg)
    print(f"{title}: {time.time() - t0:.0f} s ({cfg.out})", flush=True)
    return Path(cfg.out)


# Options that change nothing a run computes: a run is the same run whatever they say.
NOT_THE_RUN = ("out", "resume", "stop_grace", "keep_superseded", "keep_last", "save_every",
               "report_to")


def same_run(saved: dict, cfg) -> bool:
    """Whether a run folder's saved config describes cfg's run: equal in every option that changes
    what a run computes. An option added since the run was made (not in its file) counts as the
    run's where cfg leaves it at its default: an option's default keeps the behaviour from before
    it (a run made before --stop-grace existed is still this run)."""
    plain = lambda config: json.loads(json.dumps(config, default=str))  # noqa: E731
    saved, now = plain(saved), plain(asdict(cfg))
    defaults = plain({f.name: f.default for f in fields(cfg) if f.default is not MISSING})
    return all(saved.get(k, defaults.get(k, MISSING)) == v
               for k, v in now.items() if k not in NOT_THE_RUN)


def finished_run(runs: Path, cfg, every_step=None) -> Path | None:
    """A finished run of this very config (same_run) under `runs`, any finding's: an arm two
    findings share (clip_higher's eps_high 0.2 is surrogates' clip) runs once; a run of other
    steps or sizes is run again (in a folder of its own: run_once), and so is one whose metrics
    lack every_step's key. Of several, the newest (a --fresh rerun's, in a <folder>.N), by its
    model's time, then N (a tree copied without its files' times: the highest)."""
    found = [saved.parent for saved in runs.glob(f"*/*/{cfg.CONFIG_FILE}")
             if (saved.parent / "model" / "config.json").exists() and
             same_run(json.loads(saved.read_text()), cfg) and
             (every_step is None or metric(saved.parent, every_step.key))]
    return max(found, key=lambda f: ((f / "model" / "config.json").stat().st_mtime, number(f)),
               default=None)


def where_to_run(cfg, fresh: bool) -> tuple[Path, bool]:
    """(the folder, whether to resume there): the first of cfg.out and its <out>.N holding a run
    of this config that stopped (unless fresh), else the first holding no run at all."""
    candidates = folders(cfg.out)
    stopped = [f for f in candidates if not fresh and stopped_run(cfg, f)]
    if stopped:
        return stopped[0], True
    free = next((f for f in candidates if not holds_a_run(f)), None)
    if free is None:  # (a folder that cannot be listed: its <out>.N unseen)
        raise SystemExit(f"error: no free folder for {cfg.out} among "
                         f"{', '.join(map(str, candidates))}")
    return free, False


def number(folder: Path) -> int:
    """N of a <folder>.N (1 for the folder itself): run.10 comes after run.9."""
    suffix = folder.suffix[1:]
    return int(suffix) if re.fullmatch("[0-9]+", suffix) else 1


def folders(out: str) -> list[Path]:
    """The folders a run of --out `out` may go to: `out`, then each <out>.N that exists, by N
    (past any gap: a stopped run in run.3 is found with run.2 gone), then the next number."""
    out = Path(out)  # (a trailing slash would put <out>.N inside it)
    numbered = sorted((p for p in out.parent.glob(f"{glob.escape(out.name)}.*")
                       if re.fullmatch("[0-9]+", p.suffix[1:])), key=number)
    return [out, *numbered, Path(f"{out}.{max(map(number, numbered), default=1) + 1}")]


def holds_a_run(folder: Path) -> bool:
    """Whether anything is in `folder` but a lock nobody holds -- a run starting there would move
    it aside -- or it is not a folder, or a run holds it now."""
    from run_folder import LOCK, running
    if not folder.exists() and not folder.is_symlink():
        return False
    return not folder.is_dir() or bool(running(folder)) or \
        any(p.name != LOCK for p in folder.iterdir())


def stopped_run(cfg, folder: Path) -> bool:
    """Whether `folder` holds checkpoints of a run of this very config (same_run) that did not
    finish (stopped by a signal: stopping.py checkpoints the step it ends): no final model, and no
    process running it now. (A finished one that finished_run passed over -- it lacks a measure
    -- is run again whole.)"""
    from checkpoint import newest_checkpoint
    from run_folder import running
    saved = folder / cfg.CONFIG_FILE
    return saved.is_file() and newest_checkpoint(folder) is not None and \
        not (folder / "model" / "config.json").exists() and not running(folder) and \
        same_run(json.loads(saved.read_text()), cfg)


@contextlib.contextmanager
def measured(module, every_step):
    """The algorithm's loop as it is, its end of a step (rl.end_step, as `module` imported it)
    preceded by every_step.measure(session, cfg), logged under every_step.key: the policy as the
    step's update and weight sync left it. A measure samples with seeds of its own, so the run's
    own steps are those of a run without it."""
    if every_step is None:
        yield
        return
    end_step = module.end_step

    def end_step_measured(session, cfg, step, record, *rest, **kw):
        record[every_step.key] = every_step.measure(session, cfg)
        return end_step(session, cfg, step, record, *rest, **kw)
    module.end_step = end_step_measured
    try:
        yield
    finally:
        module.end_step = end_step


class ProbeEntropy:
    """A Measure: the policy's entropy on a fixed probe set -- its mean over every token it
    generates for `rows` (n samples each at T = 1.0, a seed of its own), of the entropy of the
    distribution the token was drawn from: DAPO's "generation entropy", on the same prompts at
    every step and in every arm, so that no step lacks it and no arm is measured on other
    problems."""
    key = "probe_entropy"

    def __init__(self, rows: list[dict], n: int = 4, max_new_tokens: int = 24):
        self.rows, self.n, self.max_new_tokens = rows, n, max_new_tokens

    def measure(self, session, cfg) -> float:
        import torch
        from data import encode_prompts
        from logprobs import completion_logprobs, pack
        from sampling import Sampling
        engine, tokenizer = session.run.rollout, session.run.tokenizer  # (in-process: the policy)
        prompts = encode_prompts(tokenizer, self.rows, cfg.template, cfg.chat)
        comps = engine.generate(prompts, self.n, Sampling(self.max_new_tokens, 1.0, seed=12345))
        batch = pack(comps.prompt_ids, comps.completion_ids, tokenizer.pad_token_id,
                     next(engine.model.parameters()).device)
        with torch.no_grad():
            _, entropy = completion_logprobs(engine.model, batch.input_ids, batch.prompt_lens,
                                             batch.completion_lens)  # (B, T), 0 past each end
        return float(entropy.sum() / batch.completion_lens.sum().clamp(min=1))


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
                   max_new_tokens: int = 24, seed: int = 0, cache: Path | None = None
                   ) -> list[int]:
    """How many of n samples of each row a model (a folder, or a run folder's model) gets right,
    sampled at `temperature` with the HF engine and graded as grpo.py grades arith (answer-is).
    cache: a folder where the counts are kept (counts-<key>.json), so that two findings reading
    the same model on the same problems sample it once."""
    key = hashlib.sha256(json.dumps([str(model), [r["id"] for r in rows], n, temperature,
                                     max_new_tokens, seed]).encode()).hexdigest()[:16]
    kept = cache / f"counts-{key}.json" if cache else None
    if kept and kept.exists():
        return json.loads(kept.read_text())["counts"]
    import torch
    from hardware import DTYPES, choose_dtype, pick_device
    from model import load_model
    from evaluate import evaluate_rows
    from reward import Grader
    from rollout import HFRollout
    from sampling import Sampling
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
    counts = [counts[r["id"]] for r in rows]
    if kept:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps({"model": str(model), "ids": [r["id"] for r in rows], "n": n,
                                    "temperature": temperature, "counts": counts}))
    return counts


def pass_counts(args, folder: Path | None, rows: list[dict], n: int) -> list[int]:
    """correct_counts at T = 0.7 of a run's model (folder) or of the start model (None), kept in
    the run's folder (or <runs>/start-counts): sharpening.py and pos_neg.py read the same ones."""
    model = str(folder / "model") if folder else start_model(args)
    cache = folder or args.runs / ("tiny-start-counts" if args.tiny else "start-counts")
    return correct_counts(model, rows, n, 0.7, cache=cache)


def pass_curve(counts: list[int], n: int) -> list[tuple[int, float]]:
    """(k, mean pass@k over the problems) for k = 1, 2, 4, ... n (the unbiased estimator)."""
    from evaluate import pass_at_k
    ks = [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]
    return [(k, sum(pass_at_k(n, c, k) for c in counts) / len(counts)) for k in ks]


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
    start = held_out(start_model(args), args.tiny)
    ends = {arm: [held_out(str(f / "model"), args.tiny) for f in seeds.values()]
            for arm, seeds in runs.items()}
    panels = {title: {arm: [[(0, start), (args.steps, end)] for end in ends[arm]] for arm in runs},
              "training accuracy": {arm: [metric(f, "accuracy") for f in seeds.values()]
                                    for arm, seeds in runs.items()}}
    return panels, {arm: [end - start for end in ends[arm]] for arm in runs}


# ---------------------------------------------------------------------------------------------
# The statistics: one number a seed, its interval over the seeds, and the verdict it gives.

# Student's t, the 0.975 quantile, for 1 to 30 degrees of freedom (a 95 % interval of a mean):
# 12.71 with 2 seeds, 4.30 with 3, 2.78 with 5. (Past 30, 30's: a little wider than the exact.)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
VERDICTS = ("reproduced", "contradicted", "not at this scale", "inconclusive")


def present(values: list) -> list[float]:
    """The values a seed has (None: the seed had none to give -- missing, never a 0)."""
    return [v for v in values if v is not None]


def mean_spread(values: list) -> tuple[float | None, float | None]:
    """Mean and standard deviation across the seeds that have a value (0 for one; None for none)."""
    values = present(values)
    if not values:
        return None, None
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) \
        if len(values) > 1 else 0.0


def ci95(values: list) -> list[float] | None:
    """The Student-t 95 % interval [low, high] of the mean of the seeds' values (None: fewer than
    two values, no interval)."""
    values = present(values)
    if len(values) < 2:
        return None
    m, sd = mean_spread(values)
    half = T975[min(len(values) - 1, len(T975)) - 1] * sd / math.sqrt(len(values))
    return [m - half, m + half]


EXPECT = ("positive", "negative", "none", "not positive", "not negative")


def verdict(ci: list[float] | None, expect: str, margin: float | None = None) -> str:
    """The verdict an interval gives a claim. expect: "positive" or "negative" (the sign the paper
    predicts for the effect), "none" (no difference: the effect within +-margin), "not positive"
    (no gain: the effect at most +margin) or "not negative" (no loss: the effect at least -margin).

    positive / negative: reproduced where the interval excludes 0 on the predicted side,
    contradicted where it excludes 0 on the other; where it includes 0, "not at this scale" if it
    lies within +-margin (the experiment could have seen an effect of that size, and there was
    none), else inconclusive. none: reproduced where the interval lies within +-margin,
    contradicted where it lies wholly outside, inconclusive otherwise. not positive: reproduced
    where the interval lies below +margin, contradicted where it lies above; not negative, its
    mirror: reproduced where the interval lies above -margin, contradicted where it lies below. No
    interval (under two seeds): inconclusive."""
    if expect not in EXPECT:
        raise ValueError(f"expect must be one of {', '.join(EXPECT)}, not {expect!r}")
    if expect in ("none", "not positive", "not negative") and margin is None:
        kind = {"none": "no difference", "not positive": "no gain", "not negative": "no loss"}
        raise ValueError(f"a claim of {kind[expect]} needs its margin")
    if ci is None:
        return "inconclusive"
    low, high = ci
    within = margin is not None and -margin <= low and high <= margin
    if expect == "none":
        outside = low > margin or high < -margin
        return "reproduced" if within else "contradicted" if outside else "inconclusive"
    if expect == "not positive":
        return "reproduced" if high <= margin else "contradicted" if low > margin \
            else "inconclusive"
    if expect == "not negative":
        return "reproduced" if low >= -margin else "contradicted" if high < -margin \
            else "inconclusive"
    sign = 1 if expect == "positive" else -1
    if sign * low > 0 and sign * high > 0:
        return "reproduced"
    if sign * low < 0 and sign * high < 0:
        return "contradicted"
    return "not at this scale" if within else "inconclusive"


def term(effect_by_seed: list, expect: str, name: str, margin: float | None = None) -> dict:
    """One compared quantity of a finding: each seed's effect (None where the seed had none), their
    mean, spread and 95 % interval over the seeds that have one, how many those are, the sign the
    paper predicts (or "none", within margin) and the verdict."""
    effect, spread = mean_spread(effect_by_seed)
    ci = ci95(effect_by_seed)
    return {"effect_name": name, "effect": effect, "effect_spread": spread,
            "effect_by_seed": list(effect_by_seed), "seeds_with_effect":
            len(present(effect_by_seed)), "ci95": ci, "expect": expect, "margin": margin,
            "verdict": verdict(ci, expect, margin)}


def final(series: list[list[tuple[int, float]]], steps: int, last: int = 3) -> list:
    """Each seed's mean over the steps (steps - last, steps] of its series -- by step number, not
    by point: a seed with no value in that window (a step that trained nothing has no entropy) is
    None, never given the value of an earlier step."""
    out = []
    for s in series:
        window = [v for x, v in s if steps - last < x <= steps]
        out.append(sum(window) / len(window) if window else None)
    return out


def by_seed(a: list, b: list) -> list:
    """a - b seed by seed (the arms' runs of one seed share its problems and its start); None
    where either has none."""
    return [None if x is None or y is None else x - y for x, y in zip(a, b)]


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """The correlation of two lists (None: fewer than 3 pairs, or either constant)."""
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    if sx == 0 or sy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sx * sy)


def steps_to(series: list[tuple[int, float]], target: float, last: int = 3) -> int | None:
    """The first step whose running mean over the steps (step - last, step] reaches `target`
    (None: never)."""
    for step, _ in series:
        window = [v for x, v in series if step - last < x <= step]
        if sum(window) / len(window) >= target:
            return step
    return None


# ---------------------------------------------------------------------------------------------
# The picture and the numbers.


def write_finding(name: str, panels: dict[str, dict[str, list]], args, terms: dict[str, dict],
                  xlabel: str = "step", axes_of: dict[str, str] | None = None, **record) -> dict:
    """docs/findings/<name>.png -- one panel a quantity, the arms side by side over steps, each
    seed a thin line and the arms' means bold (a mean of fewer seeds than the arm has is marked
    with their number) -- and <name>.json: the series, each term's effect by seed, interval and
    verdict (the first term's also at the top level: the finding's headline, which run_all.py
    holds to that term), and `record` (the claim, the paper, the numbers). panels: {title: {arm:
    [a seed's [(x, value)], ...]}}. axes_of: {title: its x axis} for panels whose x is no step
    (e.g. the KL): each seed's points joined in order, no mean drawn."""
    for label, t in terms.items():
        low_high = "none" if t["ci95"] is None else f"[{t['ci95'][0]:+.3g}, {t['ci95'][1]:+.3g}]"
        print(f"{name}: {label}: {t['effect_name']}: {t['effect']} (95 % {low_high} over "
              f"{t['seeds_with_effect']} seeds; by seed {t['effect_by_seed']}): {t['verdict']}")
    headline = next(iter(terms.values()))
    record = {**record, **{k: headline[k] for k in ("effect", "effect_spread", "effect_by_seed",
                                                    "effect_name", "seeds_with_effect", "ci95",
                                                    "expect", "margin", "verdict")},
              "terms": terms}
    draw(name, panels, args, record.get("claim", name), xlabel, axes_of or {})
    numbers = {"finding": name, "tiny": args.tiny, "seeds": args.seeds, "steps": args.steps,
               **record, "series": panels}
    from hardware import machine
    numbers["machine"] = machine()
    (args.out / f"{name}.json").write_text(json.dumps(numbers, indent=1))
    print(f"{name}: wrote {args.out / (name + '.png')} and {name}.json")
    return numbers


def seeds_said(n: int) -> str:
    return f"{n} seed" + ("s" if n != 1 else "")


def draw(name: str, panels: dict, args, title: str, xlabel: str, axes_of: dict):
    """write_finding's picture."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args.out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (panel, arms) in zip(axes[0], panels.items()):
        for color, (arm, seeds) in zip(colors, arms.items()):
            alone = panel in axes_of and all(len(s) == 1 for s in seeds)  # (a point a seed)
            for s in seeds:
                ax.plot([x for x, _ in s], [y for _, y in s], color=color, alpha=0.8 if alone
                        else 0.3, lw=0.8, marker="o" if panel in axes_of else None,
                        markersize=7 if alone else 3)
            if panel in axes_of:  # (no step on the x axis: nothing to average seeds at)
                ax.plot([], [], color=color, lw=2, label=f"{arm} ({seeds_said(len(seeds))})")
                continue
            steps = sorted({x for s in seeds for x, _ in s})
            at = {step: [y for s in seeds for x, y in s if x == step] for step in steps}
            means = [sum(at[step]) / len(at[step]) for step in steps]
            ax.plot(steps, means, color=color, lw=2, label=f"{arm} ({seeds_said(len(seeds))})")
            for step, m in zip(steps, means):
                if len(at[step]) < len(seeds):  # a mean of fewer seeds: say how many
                    ax.annotate(str(len(at[step])), (step, m), fontsize=6, color=color,
                                xytext=(0, 3), textcoords="offset points", ha="center")
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel(axes_of.get(panel, xlabel))
        if ax.get_xlabel() == "k":  # pass@k: k doubles, as the papers draw it
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    # (wrapped to the figure: about 11 characters an inch at this size)
    fig.suptitle(textwrap.fill(title + " (a bold mean of fewer seeds is marked with their number)",
                               11 * 5 * len(panels)), fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out / f"{name}.png", dpi=110)
    plt.close(fig)

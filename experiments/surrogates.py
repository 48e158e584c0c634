"""The policy terms the large libraries added in 2025: CISPO (MiniMax-M1, Chen et al. 2025) and
SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization), against PPO's clip.

The claims: the clip drops the gradient of every token past its bound -- often the rare tokens a
reasoning chain turns on; CISPO clips the importance weight instead and keeps every token's
gradient (MiniMax-M1: DAPO's accuracy in half the steps); SAPO's soft gate damps off-policy tokens
without cutting them, and trains more stably than a hard clip.

    python experiments/surrogates.py             # a sweep, then 3 terms x 3 seeds x 12 steps
    python experiments/surrogates.py --tiny

The terms differ only off-policy, so each rollout batch is trained on 4 times (common.OFF_POLICY);
CISPO with MiniMax-M1's choice of no floor (--eps-low 1) and eps_high 0.28; SAPO with its paper's
temperatures (1.0, 1.05). A term's best learning rate differs from the clip's, so each is first run
at 1e-5 and 3e-5 (seed 0) and kept at the one whose training accuracy over the steps is higher;
then the terms are compared as MiniMax-M1 compares them, by the steps each takes to a target
accuracy (0.3, a running mean over 3 steps) -- each term against the clip, seed by seed. A seed
whose arm never gets there counts as steps + 1 where the other did (a bound: the difference is at
least that), and has no difference where neither did. Cost: 6 sweep runs and 6 more of ~5 min,
~55 min on a 2-core CPU (the clip's runs at 1e-5 are clip_higher.py's; 4 seeds: ~70).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OFF_POLICY, arguments, final, mean_spread, metric  # noqa: E402
from common import run_arms, steps_to, term, write_finding  # noqa: E402

TERMS = {"clip": ["--surrogate", "clip"],
         "cispo": ["--surrogate", "cispo", "--eps-low", "1", "--eps-high", "0.28"],
         "sapo": ["--surrogate", "sapo"]}
RATES = ("1e-5", "3e-5")  # the sweep
TARGET = 0.3  # training accuracy the terms race to
MINUTES = 55
TITLE = "CISPO and SAPO"  # (its heading in docs/findings.md)


def sweep(args) -> dict[str, dict[str, float | None]]:
    """Each term's mean training accuracy over the steps at each learning rate of RATES, seed 0
    (OFF_POLICY's own rate replaced): {term: {lr: accuracy}}, None for a run that logged none."""
    arms = {f"{name} lr {lr}": [*argv, "--lr", lr] for name, argv in TERMS.items()
            for lr in RATES}
    runs = run_arms("surrogates", arms, args, common=OFF_POLICY, seeds=[0])
    return {name: {lr: mean_spread([v for _, v in metric(runs[f"{name} lr {lr}"][0],
                                                         "accuracy")])[0] for lr in RATES}
            for name in TERMS}


def best(accuracy: dict[str, float | None]) -> str:
    """The learning rate of the highest accuracy (the first of a tie); a rate without one is never
    chosen, and a term with none at any rate stops the finding."""
    measured = {lr: a for lr, a in accuracy.items() if a is not None}
    if not measured:
        raise SystemExit(f"error: surrogates: no sweep run logged an accuracy ({accuracy})")
    return max(measured, key=measured.get)


def race(against: list, control: list, steps: int) -> list:
    """control's steps to the target minus the term's, seed by seed (positive: the term is
    faster); steps + 1 for an arm that never got there, None where neither did."""
    never = steps + 1
    return [None if a is None and c is None else
            (never if c is None else c) - (never if a is None else a)
            for a, c in zip(against, control)]


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    swept = sweep(args)
    rates = {name: best(accuracy) for name, accuracy in swept.items()}
    arms = {f"{name} (lr {rates[name]})": [*argv, "--lr", rates[name]]
            for name, argv in TERMS.items()}
    runs = run_arms("surrogates", arms, args, common=OFF_POLICY)
    panels = {title: {arm: [metric(f, key) for f in seeds.values()] for arm, seeds in runs.items()}
              for title, key in (("accuracy", "accuracy"),
                                 ("entropy of the trained tokens", "entropy_trained"),
                                 ("share clipped at the top", "clip_high"))}
    reached = {arm.split()[0]: [steps_to(s, TARGET) for s in series]
               for arm, series in panels["accuracy"].items()}
    write_finding("surrogates", panels, args,
                  claim="CISPO and SAPO, which cut no token's gradient, train faster than the clip",
                  paper="Chen et al. 2025 (MiniMax-M1, CISPO); Gao et al. 2025 (SAPO)",
                  learning_rates=rates, sweep=swept, steps_to_target=reached, target=TARGET,
                  measured={arm: {"accuracy_last3": mean_spread(final(s, args.steps)),
                                  "entropy_trained_last3": mean_spread(final(
                                      panels["entropy of the trained tokens"][arm], args.steps))}
                            for arm, s in panels["accuracy"].items()},
                  title=TITLE, estimated_minutes=MINUTES,
                  terms={f"{name} vs clip": term(race(reached[name], reached["clip"], args.steps),
                                                 "positive", f"steps to accuracy {TARGET}, clip "
                                                 f"minus {name} (each at its best lr)", margin=1)
                         for name in ("cispo", "sapo")})


if __name__ == "__main__":
    main()

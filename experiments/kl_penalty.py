"""The KL penalty (Shao et al. 2024, DeepSeekMath's beta 0.04; dropped by DAPO and Dr. GRPO, 2025):
how far a penalty towards the starting policy holds the policy back, and what it costs.

The claim: a KL penalty keeps the policy near its start (a smaller KL) at the price of a slower
rise in reward; recent recipes drop it (beta 0) for verifiable rewards. Read together, the arms
trace the frontier: accuracy against the KL it took.

    python experiments/kl_penalty.py             # 3 arms x 3 seeds x 12 steps, the default model
    python experiments/kl_penalty.py --tiny      # seconds, on the tests' tiny model

Arms: beta 0, 0.1 and 1. At 0.1 (the larger of the literature's two, DeepSeekMath's 0.04 the
other) and 12 steps the KL stays small (0.3-0.5) and beta x KL small beside advantages of +-1: the
penalty has barely begun to pull. beta 1 is past any recipe, there to show the pull at all on this
budget. Every arm keeps a reference so that its KL to the start is measured (smolrl skips the
reference at beta 0, so the no-penalty arm uses beta 1e-6, whose pull is nil). Measured: the k3
KL to the start (per token) and the accuracy, step by step; the frontier is each run's last 3
steps. Cost: every sequence is trained (beta > 0) and the reference runs a forward: ~7 min a run
(the earlier design's took 8.7 beside other work), 9 runs, ~70 min on a 2-core CPU -- over the
hour, so 3 seeds, not 5.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, final, mean_spread, metric, run_arms, term  # noqa: E402
from common import write_finding  # noqa: E402

ARMS = {"beta 0": ["--beta", "1e-6"], "beta 0.1": ["--beta", "0.1"], "beta 1": ["--beta", "1"]}
COMMON = ["--data", "arith", "--lr", "3e-5", "--eval-every", "0"]
MINUTES = 70
TITLE = "KL penalty"  # (its heading in docs/findings.md)
KL, ACCURACY = "KL to the start (k3, per token)", "accuracy"
FRONTIER = "the frontier: accuracy against KL (last 3 steps, a run a point)"


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    runs = run_arms("kl_penalty", ARMS, args, common=COMMON)
    panels = {title: {arm: [metric(f, key) for f in seeds.values()] for arm, seeds in runs.items()}
              for title, key in ((KL, "kl"), (ACCURACY, "accuracy"))}
    kl = {arm: final(s, args.steps) for arm, s in panels[KL].items()}
    accuracy = {arm: final(s, args.steps) for arm, s in panels[ACCURACY].items()}
    panels[FRONTIER] = {arm: [[(k, a)] for k, a in zip(kl[arm], accuracy[arm])
                              if k is not None and a is not None] for arm in ARMS}
    write_finding("kl_penalty", panels, args, axes_of={FRONTIER: KL},
                  claim="a KL penalty holds the policy near its start, and slows the reward",
                  paper="Shao et al. 2024 (DeepSeekMath); Yu et al. 2025 (DAPO) drop it",
                  measured={arm: {"kl_last3": mean_spread(kl[arm]),
                                  "accuracy_last3": mean_spread(accuracy[arm])} for arm in ARMS},
                  title=TITLE, estimated_minutes=MINUTES,
                  terms={"beta 1 holds": term(by_seed(kl["beta 0"], kl["beta 1"]), "positive",
                                              "KL to the start, beta 0 minus beta 1 (last 3 "
                                              "steps)"),
                         "beta 0.1 holds": term(by_seed(kl["beta 0"], kl["beta 0.1"]), "positive",
                                                "KL to the start, beta 0 minus beta 0.1 (last 3 "
                                                "steps)"),
                         "beta 1 slows": term(by_seed(accuracy["beta 0"], accuracy["beta 1"]),
                                              "positive", "accuracy, beta 0 minus beta 1 (last 3 "
                                              "steps)", margin=0.05)})


if __name__ == "__main__":
    main()

"""The KL penalty (Shao et al. 2024, DeepSeekMath's beta 0.04; dropped by DAPO and Dr. GRPO, 2025):
how far a penalty towards the starting policy holds the policy back.

The claim: a KL penalty keeps the policy near its start (a smaller KL) at the price of a slower
rise in reward; recent recipes drop it (beta 0) for verifiable rewards.

    python experiments/kl_penalty.py             # 2 arms x 3 seeds x 12 steps, the default model
    python experiments/kl_penalty.py --tiny      # seconds, on the tests' tiny model

Arms: beta 0 and 0.1 -- the larger pull of the two used in the literature (DeepSeekMath's 0.04
is the other), the one with the better chance to show in 12 steps; a third arm at 0.04 did not
fit a 2-core CPU's hour beside the other findings. Every arm keeps a reference so that its KL to the start
is measured (beta 0 computes it and multiplies it by 0 -- smolrl skips the reference at beta 0,
so the no-penalty arm here uses beta 1e-6, whose pull is nil). Measured: the k3 KL to the start,
and the accuracy.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, final, mean_spread, metric, run_arms  # noqa: E402
from common import write_finding  # noqa: E402

ARMS = {"beta 0": ["--beta", "1e-6"], "beta 0.1": ["--beta", "0.1"]}
COMMON = ["--data", "arith", "--lr", "3e-5", "--eval-every", "0"]


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    runs = run_arms("kl_penalty", ARMS, args, common=COMMON)
    panels = {title: {arm: [metric(f, key) for f in seeds.values()] for arm, seeds in runs.items()}
              for title, key in (("KL to the start (k3)", "kl"), ("accuracy", "accuracy"))}
    kl = {arm: mean_spread(final(s)) for arm, s in panels["KL to the start (k3)"].items()}
    accuracy = {arm: mean_spread(final(s)) for arm, s in panels["accuracy"].items()}
    write_finding("kl_penalty", panels, args,
                  claim="a KL penalty holds the policy near its start, and slows the reward",
                  paper="Shao et al. 2024 (DeepSeekMath); Yu et al. 2025 (DAPO) drop it",
                  measured={arm: {"kl_last3": kl[arm][0], "kl_spread": kl[arm][1],
                                  "accuracy_last3": accuracy[arm][0],
                                  "accuracy_spread": accuracy[arm][1]} for arm in ARMS},
                  effect_by_seed=by_seed(final(panels["KL to the start (k3)"]["beta 0"]),
                                         final(panels["KL to the start (k3)"]["beta 0.1"])),
                  effect_name="KL to the start, beta 0 minus beta 0.1 (mean of the last 3 steps)")


if __name__ == "__main__":
    main()

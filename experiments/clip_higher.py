"""Clip-higher against entropy collapse (Yu et al. 2025, DAPO).

The claim: PPO's symmetric clip (eps 0.2) caps how far an unlikely token's probability can rise in
one update, so exploration dies -- the policy's entropy collapses; raising the upper bound alone
(eps_high 0.28, "clip-higher") keeps the entropy up.

    python experiments/clip_higher.py            # 2 arms x 3 seeds x 12 steps, the default model
    python experiments/clip_higher.py --tiny     # seconds, on the tests' tiny model

The clip only acts when the policy moves between sampling and the update: with one update per
rollout (smolrl's default) the ratio is 1 and no arm differs. So each rollout batch is trained on
4 times (--updates-per-rollout 4: DAPO, too, trains each rollout batch in several mini-batch
steps), at a learning rate that moves the ratio past 1.2 within those updates (--lr 5e-5).
Measured: the entropy of the trained tokens, the share clipped at the top, and the accuracy.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, final, mean_spread, metric, run_arms  # noqa: E402
from common import write_finding  # noqa: E402

ARMS = {"eps_high 0.2": ["--eps-high", "0.2"], "eps_high 0.28 (clip-higher)": ["--eps-high",
                                                                              "0.28"]}
COMMON = ["--data", "arith", "--updates-per-rollout", "4", "--lr", "5e-5",
          "--eval-every", "0"]


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    runs = run_arms("clip_higher", ARMS, args, common=COMMON)
    panels = {title: {arm: [metric(f, key) for f in seeds.values()] for arm, seeds in runs.items()}
              for title, key in (("entropy of the trained tokens", "entropy_trained"),
                                 ("share of tokens clipped at the top", "clip_high"),
                                 ("accuracy", "accuracy"))}
    entropy = panels["entropy of the trained tokens"]
    low, high = (final(entropy[arm]) for arm in ARMS)
    write_finding("clip_higher", panels, args,
                  claim="clip-higher (eps_high 0.28) keeps the policy's entropy up (DAPO)",
                  paper="Yu et al. 2025, DAPO",
                  measured={arm: dict(zip(("entropy_last3", "spread"), mean_spread(final(s))))
                            for arm, s in entropy.items()},
                  effect_by_seed=by_seed(high, low),
                  effect_name="entropy, eps_high 0.28 minus 0.2 (nats, mean of the last 3 steps)")


if __name__ == "__main__":
    main()

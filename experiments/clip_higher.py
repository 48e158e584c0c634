"""Clip-higher against entropy collapse (Yu et al. 2025, DAPO).

The claim: PPO's symmetric clip (eps 0.2) caps how far an unlikely token's probability can rise in
one update, so exploration dies -- the policy's entropy collapses; raising the upper bound alone
(eps_high 0.28, "clip-higher") keeps the entropy up.

    python experiments/clip_higher.py            # 3 arms x 4 seeds x 12 steps, the default model
    python experiments/clip_higher.py --tiny     # seconds, on the tests' tiny model

The clip only acts when the policy moves between sampling and the update: with one update per
rollout (smolrl's default) the ratio is 1 and no arm differs. So each rollout batch is trained on
4 times at --lr 1e-5 (common.OFF_POLICY: a rate at which the clipped baseline learns -- checked,
the term "the baseline learned"). Arms: eps_high 0.2, 0.28 and no upper clip at all (1e9), the
floor 0.2 in each. Measured: the entropy as DAPO plots it -- of every generated token, not only
the trained ones -- on a fixed probe set at every step (8 held-out problems x 4 samples at T 1.0,
common.ProbeEntropy), so that no step lacks it and the arms are measured on the same prompts;
the share of tokens clipped at the top; the accuracy. Cost: ~5 min a run with the probe, 12 runs,
~60 min on a 2-core CPU (the 0.2 arm's runs serve surrogates.py's clip and spurious_rewards.py's
correctness arm).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OFF_POLICY, ProbeEntropy, arguments, by_seed, final, mean_spread  # noqa: E402
from common import metric, run_arms, term, write_finding  # noqa: E402

ARMS = {"eps_high 0.2": ["--eps-high", "0.2"],
        "eps_high 0.28 (clip-higher)": ["--eps-high", "0.28"],
        "no upper clip": ["--eps-high", "1e9"]}
PROBE = 8  # held-out problems in the probe set, 4 samples each
MINUTES = 60
TITLE = "Clip-higher"  # (its heading in docs/findings.md)


def main():
    args = arguments(__doc__, seeds=4, steps=12)
    from data import arith_heldout
    probe = ProbeEntropy(arith_heldout(2 if args.tiny else PROBE), n=2 if args.tiny else 4,
                         max_new_tokens=6 if args.tiny else 24)
    runs = run_arms("clip_higher", ARMS, args, common=OFF_POLICY, every_step=probe)
    panels = {title: {arm: [metric(f, key) for f in seeds.values()] for arm, seeds in runs.items()}
              for title, key in (("entropy on the probe set (every generated token)",
                                  "probe_entropy"),
                                 ("share of tokens clipped at the top", "clip_high"),
                                 ("accuracy", "accuracy"))}
    entropy = {arm: final(s, args.steps) for arm, s in panels["entropy on the probe set "
                                                              "(every generated token)"].items()}
    low = entropy["eps_high 0.2"]
    learned = by_seed(final(panels["accuracy"]["eps_high 0.2"], args.steps),
                      final(panels["accuracy"]["eps_high 0.2"], 3))  # last 3 steps - first 3
    write_finding("clip_higher", panels, args,
                  claim="clip-higher (eps_high 0.28) keeps the policy's entropy up (DAPO)",
                  paper="Yu et al. 2025, DAPO",
                  measured={arm: {"probe_entropy_last3": mean_spread(e)}
                            for arm, e in entropy.items()},
                  title=TITLE, estimated_minutes=MINUTES,
                  terms={"0.28 vs 0.2": term(by_seed(entropy["eps_high 0.28 (clip-higher)"], low),
                                             "positive", "probe entropy, eps_high 0.28 minus 0.2 "
                                             "(nats, last 3 steps)", margin=0.05),
                         "no upper clip vs 0.2": term(by_seed(entropy["no upper clip"], low),
                                                      "positive", "probe entropy, no upper clip "
                                                      "minus 0.2 (nats, last 3 steps)",
                                                      margin=0.05),
                         "the baseline learned": term(learned, "positive", "accuracy of the 0.2 "
                                                      "arm, last 3 steps minus first 3")})


if __name__ == "__main__":
    main()

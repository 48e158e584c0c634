"""Spurious rewards (Shao et al. 2025, "Spurious Rewards: Rethinking Training Signals in RLVR"):
a reward that says nothing of correctness, as a control for the real one.

The claim: RL with a random reward raises the accuracy of Qwen2.5-Math -- and not of other
families (Llama, OLMo: little or a loss). Its mechanism, the paper argues, is the clip: with a
reward of mean 0, the clipped update still favours the tokens the model already prefers, which
for Qwen2.5-Math is its code-like reasoning; without the clip the gain vanishes. SmolLM2 is one of
the other families: the claim here is no gain, and the clip's part is measured beside it.

    python experiments/spurious_rewards.py       # 3 arms x 4 seeds x 12 steps, the default model
    python experiments/spurious_rewards.py --tiny

Arms, each trained 4 times a rollout batch (common.OFF_POLICY: the ratio leaves 1, the clip can
act; with one update the ratio is exactly 1 and no clip does anything): the correctness reward;
the random reward, Bernoulli(0.5) a sample, with the clip (eps 0.2); the same without the clip
(bounds 0.999 and 1e9). The random reward is drawn from torch's generator after the step's
sampling (the HF engine seeds it at every step from --seed and the step): a fresh draw for every
sample, reproducible, whatever the sample says (a hash of the text would give the same text the
same reward -- learnable, not random). The format-only arm of the earlier design
did not fit the hour beside these. Measured: held-out greedy accuracy (128 arith problems) at the
start and the end, graded after the runs, and the training accuracy. Cost: 8 runs of ~5 min (the
correctness arm's are clip_higher.py's 0.2 arm) and 12 greedy evaluations, ~45 min.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OFF_POLICY, arguments, by_seed, held_out_gains, mean_spread  # noqa: E402
from common import run_arms, term, write_finding  # noqa: E402

RANDOM = ["--reward", "experiments.spurious_rewards:random_reward"]
ARMS = {"correctness": [],
        "random, clipped": RANDOM,
        "random, no clip": [*RANDOM, "--eps-low", "0.999", "--eps-high", "1e9"]}
MINUTES = 45
TITLE = "Spurious rewards"  # (its heading in docs/findings.md)


def random_reward(completions, **_):
    """0 or 1 with probability 1/2 for each sample, blind to its text: drawn from torch's
    generator, which the HF engine seeds at every step from the run's --seed and the step, so a
    run draws the same rewards again and no two steps draw the same."""
    import torch
    return [float(x) for x in torch.randint(0, 2, (len(completions),))]


def main():
    args = arguments(__doc__, seeds=4, steps=12)
    runs = run_arms("spurious_rewards", ARMS, args, common=OFF_POLICY)
    panels, gains = held_out_gains(runs, args, "held-out accuracy (greedy, start and end)")
    write_finding("spurious_rewards", panels, args,
                  claim="a random reward raises accuracy for Qwen2.5-Math, not for other families",
                  paper="Shao et al. 2025, Spurious Rewards",
                  measured={arm: {"held_out_gain": mean_spread(g)} for arm, g in gains.items()},
                  title=TITLE, estimated_minutes=MINUTES,
                  terms={"no gain outside Qwen": term(gains["random, clipped"], "not positive",
                                                      "held-out accuracy gained by the random "
                                                      "reward, clipped (points of 1)",
                                                      margin=0.05),
                         "the clip's part": term(by_seed(gains["random, clipped"],
                                                         gains["random, no clip"]), "positive",
                                                 "held-out gain, random clipped minus unclipped",
                                                 margin=0.05)})


if __name__ == "__main__":
    main()

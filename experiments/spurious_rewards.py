"""Spurious rewards (Shao et al. 2025, "Spurious Rewards: Rethinking Training Signals in RLVR"):
a reward that says nothing of correctness, as a control for the real one.

The claim (for Qwen2.5-Math): RL with a random or format-only reward still raises accuracy, since
it only brings out what the model already does well. Its authors found it for Qwen2.5-Math, not
for other families: a control worth running on any model before crediting the reward.

    python experiments/spurious_rewards.py       # 3 arms x 3 seeds x 12 steps, the default model
    python experiments/spurious_rewards.py --tiny

Arms: the correctness reward; a random one (0 or 1 from a hash of the completion: the same text
always gets the same reward, with no relation to the answer); format only ("The answer is N",
whatever N). Measured: held-out greedy accuracy at the start and the end (128 arith problems,
graded after the runs: the correctness arm is lenient_verifier.py's lenient arm, run once for
both), and the training accuracy.
"""

import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, held_out_gains, mean_spread, run_arms  # noqa: E402
from common import write_finding  # noqa: E402

ARMS = {"correctness": ["--reward", "correctness"],
        "random": ["--reward", "experiments.spurious_rewards:random_reward"],
        "format only": ["--reward", "format"]}
COMMON = ["--data", "arith", "--lr", "2e-5", "--eval-every", "0"]


def random_reward(prompts, completions, **_):
    """0 or 1 by a hash of the completion's text: blind to the answer, the same for the same
    text (reproducible across processes, unlike Python's salted hash)."""
    return [float(zlib.crc32(str(c).encode()) % 2) for c in completions]


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    runs = run_arms("spurious_rewards", ARMS, args, common=COMMON)
    panels, gains = held_out_gains(runs, args, "held-out accuracy (greedy, start and end)")
    gain = {arm: mean_spread(g) for arm, g in gains.items()}
    write_finding("spurious_rewards", panels, args,
                  claim="a random or format-only reward raises accuracy too (Qwen2.5-Math)",
                  paper="Shao et al. 2025, Spurious Rewards",
                  measured={arm: {"held_out_gain": m, "spread": s} for arm, (m, s) in
                            gain.items()},
                  effect_by_seed=gains["random"],
                  effect_name="held-out accuracy gained by the random reward (points of 1)")


if __name__ == "__main__":
    main()

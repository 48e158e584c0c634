"""Length bias of per-sequence loss normalisation (Liu et al. 2025, "Understanding R1-Zero-Like
Training: A Critical Perspective", Dr. GRPO).

The claim: GRPO's loss divides each sequence's token terms by its own length (seq-mean), so a long
wrong answer is pushed down less per token than a short one -- and wrong answers grow longer as
training goes on; summing tokens over a fixed denominator (Dr. GRPO's seq-sum-norm, with no std
scaling of the advantage) removes the bias, and DAPO's token-mean mostly does.

    python experiments/length_bias.py            # 2 arms x 3 seeds x 12 steps, the default model
    python experiments/length_bias.py --tiny     # seconds, on the tests' tiny model

The arms differ in the loss's aggregation alone (and Dr. GRPO's advantage scale; DAPO's
token-mean, between the two, is a third arm that did not fit a 2-core CPU's hour); the task is
arith with a 48-token budget, so that a wrong answer has room to grow (24 tokens is the task's
default: too short to tell), at the task's T = 0.7 (at the paper's T = 1.0 the 135M model is right
in under 3 % of its samples at first: most groups all wrong, no gradient). 12 steps of 4 prompts x 8. Measured: the
mean length of the completions graded wrong, step by step, from rollouts.jsonl; and the accuracy,
so that a longer answer is never mistaken for a better one.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, final, mean_spread, per_step, run_arms, samples  # noqa: E402
from common import write_finding  # noqa: E402

ARMS = {"seq-mean (GRPO)": ["--loss-agg", "seq-mean"],
        "seq-sum-norm (Dr. GRPO)": ["--loss-agg", "seq-sum-norm", "--adv-scale", "none"]}
COMMON = ["--data", "arith", "--max-new-tokens", "48", "--lr", "2e-5", "--eval-every", "0"]


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    runs = run_arms("length_bias", ARMS, args, common=COMMON)
    wrong, accuracy = {}, {}
    for arm, seeds in runs.items():
        logs = [samples(folder) for folder in seeds.values()]
        wrong[arm] = [per_step(log, lambda r: len(r["completion_ids"]),
                               keep=lambda r: r["correct"] == 0) for log in logs]
        accuracy[arm] = [per_step(log, lambda r: float(r["correct"] or 0)) for log in logs]
    lengths = {arm: mean_spread(final(s)) for arm, s in wrong.items()}
    write_finding(
        "length_bias", {"length of wrong completions (tokens)": wrong, "accuracy": accuracy},
        args, claim="per-sequence normalisation lets wrong answers grow longer (Dr. GRPO)",
        paper="Liu et al. 2025, Understanding R1-Zero-Like Training",
        measured={arm: {"wrong_length_last3": m, "spread": s} for arm, (m, s) in lengths.items()},
        effect_by_seed=by_seed(final(wrong["seq-mean (GRPO)"]),
                               final(wrong["seq-sum-norm (Dr. GRPO)"])),
        effect_name="wrong-answer length, seq-mean minus seq-sum-norm "
                                          "(tokens, mean of the last 3 steps)")


if __name__ == "__main__":
    main()

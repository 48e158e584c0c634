"""Dynamic sampling (Yu et al. 2025, DAPO): groups whose samples are all right or all wrong carry no
gradient; DAPO drops them and samples more prompts until the batch is full of groups that do.

The claim: with dynamic sampling the policy reaches a given accuracy in fewer steps, though each
step samples more.

    python experiments/dynamic_sampling.py       # 2 arms x 4 seeds x 12 steps, the default model
    python experiments/dynamic_sampling.py --tiny

Where it can matter: at T = 1.0 (DAPO's sampling temperature) the default model is right in about
3 % of its samples on arith at first, so most groups of 8 are all wrong -- no gradient -- and a
step of 4 prompts trains on one group or none. Arms: GRPO, and GRPO with --dynamic-sampling (at
most 3 more rounds of 4 prompts a step: DAPO's refill, capped), both at T = 1.0, --lr 2e-5, one
update a rollout. Measured: the training accuracy step by step (of every sample drawn), the share
of groups with no reward spread, and the samples each step drew. Cost: ~3 min a GRPO run, up to
~8 min a dynamic-sampling run while most groups are empty, ~45 min on a 2-core CPU.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, final, mean_spread, metric, run_arms, term  # noqa: E402
from common import write_finding  # noqa: E402

ARMS = {"GRPO": [], "dynamic sampling": ["--dynamic-sampling"]}
COMMON = ["--data", "arith", "--temperature", "1.0", "--lr", "2e-5", "--eval-every", "0"]
MINUTES = 45
TITLE = "Dynamic sampling"  # (its heading in docs/findings.md)


def main():
    args = arguments(__doc__, seeds=4, steps=12)
    runs = run_arms("dynamic_sampling", ARMS, args, common=COMMON)
    panels = {title: {arm: [metric(f, key) for f in seeds.values()] for arm, seeds in runs.items()}
              for title, key in (("accuracy (T 1.0, every sample drawn)", "accuracy"),
                                 ("share of groups with no gradient", "zero_std_frac"),
                                 ("refill rounds", "fill_rounds"))}
    accuracy = {arm: final(s, args.steps) for arm, s in
                panels["accuracy (T 1.0, every sample drawn)"].items()}
    empty = [mean_spread([v for step, v in s if step <= 3])[0]
             for s in panels["share of groups with no gradient"]["GRPO"]]
    write_finding("dynamic_sampling", panels, args,
                  claim="dropping groups without a gradient and refilling trains in fewer steps",
                  paper="Yu et al. 2025, DAPO",
                  measured={"empty_groups_first_3_steps": mean_spread(empty),
                            **{arm: {"accuracy_last3": mean_spread(a)}
                               for arm, a in accuracy.items()}},
                  title=TITLE, estimated_minutes=MINUTES,
                  terms={"faster": term(by_seed(accuracy["dynamic sampling"], accuracy["GRPO"]),
                                        "positive", "accuracy, dynamic sampling minus GRPO (last "
                                        "3 steps)", margin=0.05)})


if __name__ == "__main__":
    main()

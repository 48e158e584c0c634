"""Positive and negative sample reinforcement (Zhu et al. 2025, "The Surprising Effectiveness of
Negative Reinforcement in LLM Reasoning").

The claim: training only on the wrong samples, pushed down (NSR), keeps -- and raises -- pass@k
across k, up to the largest; training only on the right ones, pulled up (PSR), raises pass@1 but
narrows what the model samples, and its pass@k at large k falls behind. GRPO does both.

    python experiments/pos_neg.py                # 2 new arms x 3 seeds, pass@1..128
    python experiments/pos_neg.py --tiny

Arms, 12 steps of arith at --lr 2e-5: GRPO (lenient_verifier.py's lenient arm, the runs
sharpening.py reads too), PSR (grpo.py --adv-scale unit --reinforce positive) and NSR (--adv-scale
unit --reinforce negative): as the paper decomposes RLVR, each sample weighs +1 if right, -1 if
wrong, with no baseline, and the other sign's are set to 0 -- so NSR pushes down every wrong
sample, those of a group with no right answer too: at the base's ~3 % accuracy, nearly all. (The
first full run kept GRPO's group-relative weights instead: its NSR trained on 3 steps of 12, the
only ones with a right answer in some group.) Then each model samples 128 answers to each of
the 32 held-out problems sharpening.py reads, at T = 0.7, and pass@k is read for k = 1 ... 128
(the base model's and GRPO's counts are sharpening.py's, kept in their runs' folders). The terms,
at k = 128: NSR keeps pass@k, a claim of no loss (NSR at most 0.03 below GRPO), and PSR narrows
it (PSR below GRPO). Cost: 6
runs of ~1-3 min and ~3 min of sampling for each of their 6 models: ~30 min on the 2-core AMX
Xeon in bf16 (~90 estimated on an AVX2 one; --seeds 2 is two thirds of it, with an interval 3
times as wide).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, mean_spread, pass_counts, pass_curve, run_arms  # noqa: E402
from common import term, write_finding  # noqa: E402

GRPO = ["--data", "arith", "--lr", "2e-5", "--eval-every", "0", "--reward", "correctness"]
UNIT = [*GRPO, "--adv-scale", "unit"]  # (+-1 a sample, as the paper weighs them)
ARMS = {"GRPO": GRPO, "PSR (positive only)": [*UNIT, "--reinforce", "positive"],
        "NSR (negative only)": [*UNIT, "--reinforce", "negative"]}
SAMPLES, PROBLEMS = 128, 32  # (sharpening.py's)
MINUTES = 90  # (an AVX2 CPU's estimate; ~30 on the AMX Xeon)
TITLE = "Positive and negative samples"  # (its heading in docs/findings.md)


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    from data import arith_heldout
    runs = run_arms("pos_neg", ARMS, args)
    n = 4 if args.tiny else SAMPLES
    problems = arith_heldout(8 if args.tiny else PROBLEMS)
    base = pass_curve(pass_counts(args, None, problems, n), n)
    curves = {arm: [pass_curve(pass_counts(args, f, problems, n), n) for f in seeds.values()]
              for arm, seeds in runs.items()}
    at = lambda arm, k: [dict(c)[k] for c in curves[arm]]  # noqa: E731
    write_finding(
        "pos_neg", {f"pass@k on {len(problems)} held-out problems ({n} samples, T 0.7)":
                    {"base": [base], **curves}}, args, xlabel="k",
        claim="training only on wrong samples (NSR) keeps pass@k at large k; only on right (PSR) "
              "narrows it",
        paper="Zhu et al. 2025, The Surprising Effectiveness of Negative Reinforcement",
        measured={arm: {k: mean_spread(at(arm, k)) for k, _ in base} for arm in ARMS},
        title=TITLE, estimated_minutes=MINUTES,
        terms={"NSR at large k": term(by_seed(at("NSR (negative only)", n), at("GRPO", n)),
                                      "not negative", f"pass@{n}, NSR minus GRPO (points of 1)",
                                      margin=0.03),  # (keeps: at most 0.03 below GRPO)
               "PSR at large k": term(by_seed(at("PSR (positive only)", n), at("GRPO", n)),
                                      "negative", f"pass@{n}, PSR minus GRPO (points of 1)",
                                      margin=0.03)})


if __name__ == "__main__":
    main()

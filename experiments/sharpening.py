"""RL sharpens rather than extends (Yue et al. 2025, "Does Reinforcement Learning Really
Incentivize Reasoning Capacity in LLMs Beyond the Base Model?").

The claim: RL with verifiable rewards raises pass@1, but at large k the base model's pass@k
catches up with the trained model's and passes it (Yue et al. see the crossing at k = 64-256):
RL makes the model sample the answers it could already reach more often; it does not reach new
ones. Their evidence is coverage, problem by problem: what the base model solves at all.

    python experiments/sharpening.py             # 3 trained seeds, pass@1..128, the default model
    python experiments/sharpening.py --tiny

GRPO trains the default model on arith for 12 steps (3 seeds, --lr 2e-5: lenient_verifier.py's
lenient arm, whose runs serve here); then the base model and each trained one sample 128 answers
to each of 32 held-out problems at T = 0.7, and pass@k (the unbiased estimator,
evaluate.pass_at_k) is read for k = 1, 2, 4, ..., 128. Every problem's count of right answers is
kept (counts), and so are the problems each trained model solves that the base model never does
in 128 samples. The terms: pass@1, GRPO minus base (positive: RL raises it), and at k = 128
"catches up", a claim of no gain -- GRPO at most 0.05 ahead of the base model (the paper's
crossing would put GRPO behind, which reproduces it too). Cost: ~12 min of sampling a model, ~50
min for the base and three (the GRPO runs shared; ~10 min more without them).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, mean_spread, pass_counts, pass_curve, run_arms  # noqa: E402
from common import term, write_finding  # noqa: E402

SAMPLES, PROBLEMS = 128, 32  # samples of each held-out problem, problems
GRPO = ["--data", "arith", "--lr", "2e-5", "--eval-every", "0", "--reward", "correctness"]
MINUTES = 50
TITLE = "Sharpening"  # (its heading in docs/findings.md)


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    from data import arith_heldout
    runs = run_arms("sharpening", {"GRPO": GRPO}, args)  # (lenient_verifier's lenient arm)
    n = 4 if args.tiny else SAMPLES
    problems = arith_heldout(8 if args.tiny else PROBLEMS)
    base_counts = pass_counts(args, None, problems, n)
    counts = [pass_counts(args, folder, problems, n) for folder in runs["GRPO"].values()]
    base, trained = pass_curve(base_counts, n), [pass_curve(c, n) for c in counts]
    at = {k: mean_spread([dict(t)[k] for t in trained]) for k, _ in base}
    new = [[p["id"] for p, b, c in zip(problems, base_counts, seed) if b == 0 and c > 0]
           for seed in counts]  # solved by RL, never by the base model in n samples
    lost = [[p["id"] for p, b, c in zip(problems, base_counts, seed) if b > 0 and c == 0]
            for seed in counts]
    at_k = lambda k: [dict(t)[k] for t in trained]  # noqa: E731
    write_finding(
        "sharpening", {f"pass@k on {len(problems)} held-out problems ({n} samples, T 0.7)":
                       {"base": [base], "GRPO": trained}}, args, xlabel="k",
        claim="RL raises pass@1; at large k the base model catches up",
        paper="Yue et al. 2025, Does RL Really Incentivize Reasoning Capacity...",
        measured={"base": dict(base), "GRPO": {k: {"mean": m, "spread": s}
                                               for k, (m, s) in at.items()},
                  "gap_by_k": {k: at[k][0] - b for k, b in base},
                  "base_catches_up_at_k": next((k for k, b in base if b >= at[k][0]), None),
                  "solved_by_grpo_never_by_base": new, "solved_by_base_never_by_grpo": lost},
        counts={"problems": [p["id"] for p in problems], "samples": n, "base": base_counts,
                "GRPO": counts},
        title=TITLE, estimated_minutes=MINUTES,
        terms={"catches up": term(by_seed(at_k(n), [dict(base)[n]] * len(trained)),
                                  "not positive", f"pass@{n}, GRPO minus base (points of 1)",
                                  margin=0.05),  # (caught up: GRPO at most 0.05 ahead)
               "pass@1": term(by_seed(at_k(1), [dict(base)[1]] * len(trained)), "positive",
                              "pass@1, GRPO minus base (points of 1)")})


if __name__ == "__main__":
    main()

"""RL sharpens rather than extends (Yue et al. 2025, "Does Reinforcement Learning Really
Incentivize Reasoning Capacity in LLMs Beyond the Base Model?").

The claim: RL with verifiable rewards raises pass@1, but at large k the base model's pass@k
catches up with the trained model's and passes it: RL makes the model sample the answers it could
already reach more often; it does not reach new ones.

    python experiments/sharpening.py             # 3 trained seeds, pass@1..32, the default model
    python experiments/sharpening.py --tiny

GRPO trains the default model on arith for 12 steps (3 seeds, --lr 2e-5); then the base model and
each trained one sample 32 answers to each of 32 held-out problems at T = 0.7, and pass@k (the
unbiased estimator, evaluate.pass_at_k) is read for k = 1, 2, 4, ..., 32. Measured: the curves,
and where (if anywhere) the base model's pass@k meets the trained one's.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, correct_counts, mean_spread, run_arms, tiny_model  # noqa: E402
from common import write_finding  # noqa: E402

SAMPLES, PROBLEMS = 32, 32  # samples of each held-out problem, problems


def pass_curve(counts: list[int], n: int) -> list[tuple[int, float]]:
    """(k, mean pass@k over the problems) for k = 1, 2, 4, ... n."""
    from evaluate import pass_at_k
    ks = [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]
    return [(k, sum(pass_at_k(n, c, k) for c in counts) / len(counts)) for k in ks]


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    from data import arith_heldout
    from model import DEFAULT_MODEL
    # (lenient_verifier.py's lenient arm, the same config: its runs serve here too)
    runs = run_arms("sharpening", {"GRPO": ["--data", "arith", "--lr", "2e-5", "--eval-every",
                                            "0", "--reward", "correctness"]}, args)
    n = 4 if args.tiny else SAMPLES
    problems = arith_heldout(8 if args.tiny else PROBLEMS)
    start = tiny_model(args.runs) if args.tiny else DEFAULT_MODEL
    base = pass_curve(correct_counts(start, problems, n, 0.7), n)
    trained = [pass_curve(correct_counts(str(folder / "model"), problems, n, 0.7), n)
               for folder in runs["GRPO"].values()]
    at = {k: mean_spread([dict(t)[k] for t in trained]) for k, _ in base}
    crossing = next((k for k, b in base if at[k][0] is not None and b >= at[k][0]), None)
    write_finding("sharpening", {f"pass@k on {len(problems)} held-out problems ({n} samples, "
                                 f"T 0.7)": {"base": [base], "GRPO": trained}}, args,
                  xlabel="k", claim="RL raises pass@1; at large k the base model catches up",
                  paper="Yue et al. 2025, Does RL Really Incentivize Reasoning Capacity...",
                  measured={"base": dict(base), "GRPO": {k: {"mean": m, "spread": s}
                                                         for k, (m, s) in at.items()},
                            "base_catches_up_at_k": crossing},
                  effect_by_seed=[dict(t)[1] - dict(base)[1] for t in trained],
                  effect_name="pass@1, GRPO minus base (points of 1)")


if __name__ == "__main__":
    main()

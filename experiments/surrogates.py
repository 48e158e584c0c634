"""The policy terms the large libraries added in 2025: CISPO (MiniMax-M1, Chen et al. 2025) and
SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization), against PPO's clip.

The claims: the clip drops the gradient of every token past its bound -- often the rare tokens a
reasoning chain turns on; CISPO clips the importance weight instead and keeps every token's
gradient (MiniMax-M1: DAPO's accuracy in half the steps); SAPO's soft gate damps off-policy tokens
without cutting them, and trains more stably than a hard clip.

    python experiments/surrogates.py             # 3 arms x 3 seeds x 12 steps, the default model
    python experiments/surrogates.py --tiny

The terms differ only off-policy, so each rollout batch is trained on 4 times (--updates-per-rollout
4) at --lr 5e-5, as in clip_higher.py; CISPO with MiniMax-M1's choice of no floor (--eps-low 1) and
eps_high 0.28; SAPO with its paper's temperatures (1.0, 1.05). Measured: the accuracy, the entropy
of the trained tokens, and the share of tokens whose gradient the clip cuts (or, for CISPO, whose
weight is clipped).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, final, mean_spread, metric, run_arms, write_finding  # noqa: E402

ARMS = {"clip": ["--surrogate", "clip"],
        "cispo": ["--surrogate", "cispo", "--eps-low", "1", "--eps-high", "0.28"],
        "sapo": ["--surrogate", "sapo"]}
COMMON = ["--data", "arith", "--updates-per-rollout", "4", "--lr", "5e-5",
          "--eval-every", "0"]


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    runs = run_arms("surrogates", ARMS, args, common=COMMON)
    panels = {title: {arm: [metric(f, key) for f in seeds.values()] for arm, seeds in runs.items()}
              for title, key in (("accuracy", "accuracy"),
                                 ("entropy of the trained tokens", "entropy_trained"),
                                 ("share clipped at the top", "clip_high"))}
    accuracy = {arm: mean_spread(final(s)) for arm, s in panels["accuracy"].items()}
    write_finding("surrogates", panels, args,
                  claim="CISPO and SAPO, which cut no token's gradient, train faster than the clip",
                  paper="Chen et al. 2025 (MiniMax-M1, CISPO); Gao et al. 2025 (SAPO)",
                  measured={arm: {"accuracy_last3": m, "spread": s}
                            for arm, (m, s) in accuracy.items()},
                  effect_by_seed=[max(c, s) - k for c, s, k in zip(
                      *(final(panels["accuracy"][arm]) for arm in ("cispo", "sapo", "clip")))],
                  effect_name="accuracy, the better of cispo and sapo minus clip (last 3 steps)")


if __name__ == "__main__":
    main()

"""A lenient verifier is hacked (reward hacking of rule-based rewards; Gao et al. 2023 on proxy
rewards, and the answer-is fallback smolrl's report page shows at work).

The claim: a verifier that accepts more than the task asks for is optimised towards what it
accepts. smolrl's answer-is reward reads the number after the last "answer is", else the last
number of the text -- so a completion cut off mid-sum ("47 + 38 = 85 and") is scored right without
ever stating its answer. Trained on that reward, does the policy learn to skip the sentence?

    python experiments/lenient_verifier.py       # 2 arms x 3 seeds x 12 steps, the default model
    python experiments/lenient_verifier.py --tiny

Arms: the lenient correctness reward (smolrl's default) against a strict one (right only with the
"The answer is N" sentence: format and number). Measured from every training sample: the share
right only by the fallback (the number is right, the sentence missing) and the share right by the
strict rule, step by step.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, final, mean_spread, per_step, run_arms, samples  # noqa: E402
from common import write_finding  # noqa: E402

ARMS = {"lenient (last number)": ["--reward", "correctness"],
        "strict (the sentence)": ["--reward", "experiments.lenient_verifier:strict_correctness"]}
COMMON = ["--data", "arith", "--lr", "2e-5", "--eval-every", "0"]


def stated(text: str) -> bool:
    """The completion says "answer is N" (reward.format_reward's rule)."""
    from reward import format_reward
    return bool(format_reward([None], [text], answer_format="answer-is")[0])


def strict_correctness(prompts, completions, answer, **_):
    """1 only where the answer is stated in the template's sentence and right."""
    from reward import correctness_reward
    right = correctness_reward(prompts, completions, answer, answer_format="answer-is")
    return [float(ok and stated(str(c))) for ok, c in zip(right, completions)]


def right(r: dict) -> bool:
    from reward import extract_answer, fast_match
    return bool(fast_match(extract_answer(r["completion"], "answer-is") or "", r["row"]["answer"]))


def main():
    args = arguments(__doc__, seeds=3, steps=12)
    runs = run_arms("lenient_verifier", ARMS, args, common=COMMON)
    logs = {arm: [samples(f) for f in seeds.values()] for arm, seeds in runs.items()}
    panels = {"right only by the fallback (no sentence)": {
        arm: [per_step(log, lambda r: float(right(r) and not stated(r["completion"])))
              for log in seeds] for arm, seeds in logs.items()},
        "right by the strict rule": {
        arm: [per_step(log, lambda r: float(right(r) and stated(r["completion"])))
              for log in seeds] for arm, seeds in logs.items()}}
    hacked = {arm: mean_spread(final(s)) for arm, s in
              panels["right only by the fallback (no sentence)"].items()}
    lenient, strict = (final(panels["right only by the fallback (no sentence)"][arm])
                       for arm in ARMS)
    write_finding("lenient_verifier", panels, args,
                  claim="a verifier that accepts more than the task asks for is optimised to it",
                  paper="Gao et al. 2023 (reward over-optimisation); smolrl's answer-is fallback",
                  measured={arm: {"fallback_only_last3": m, "spread": s}
                            for arm, (m, s) in hacked.items()},
                  effect_by_seed=by_seed(lenient, strict),
                  effect_name="share right only by the fallback, "
                                                           "lenient minus strict (last 3 steps)")


if __name__ == "__main__":
    main()

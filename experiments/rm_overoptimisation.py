"""Reward-model over-optimisation (Gao et al. 2023, "Scaling Laws for Reward Model
Overoptimization").

The claim: a policy optimised against a learned reward model (the proxy) climbs the proxy without
end, while the true objective (the gold score) rises, peaks and falls as the policy moves away from
where it started -- both read against sqrt(KL) to the starting policy. A KL penalty does not change
that curve; it stops the policy earlier on it.

    python experiments/rm_overoptimisation.py    # rm.py, then 2 arms x 3 seeds x 20 steps
    python experiments/rm_overoptimisation.py --tiny

rm.py trains a reward model on the default model's own arith answers (its default pairs: a right
answer preferred to a wrong one), once; then grpo.py optimises it alone (--reward "" --reward-model)
at beta 0 and 0.1 (beta 0 as 1e-6, so that its KL is measured: kl_penalty.py says why). The gold
score is the grader's: the share of the step's samples that are right (`accuracy`, which grpo.py
logs whatever the reward); the proxy is the reward model's mean score of them (`reward_rm:model`);
the KL is the k3 estimate per token (Gao et al. read the sequence's). docs/reward-models.md saw
the rise and fall once, at 8 x 8 samples a step: here over seeds. Measured, in each run: the
proxy and the gold over the last third of the steps against the middle third. Cost: rm.py ~2 min,
6 runs of ~11 min (every sequence trained, a reference and the reward model's forward), ~70 min
on a 2-core CPU: over the hour, and the fewest seeds (3) and steps (20) that show the shape.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, final, metric, run_arms, run_once, term  # noqa: E402
from common import tiny_model, write_finding  # noqa: E402

ARMS = {"beta 0": ["--beta", "1e-6"], "beta 0.1": ["--beta", "0.1"]}
COMMON = ["--data", "arith", "--reward", "", "--lr", "2e-5", "--eval-every", "0"]
TINY_RM = ["--builtin-problems", "4", "--builtin-samples", "2", "--steps", "1", "--batch-size",
           "4", "--eval-every", "0"]
MINUTES = 70
TITLE = "Reward-model over-optimisation"  # (its heading in docs/findings.md)


def reward_model(args) -> Path:
    """rm.py's default reward model, trained once (seed 0) into <runs>/rm_overoptimisation/rm."""
    out = args.runs / f"{'tiny-' if args.tiny else ''}rm_overoptimisation" / "rm"
    line = ["--seed", "0", "--out", str(out)]
    if args.tiny:
        line = [*line, "--model", tiny_model(args.runs), *TINY_RM]
    return run_once("rm_overoptimisation: the reward model", "rm", line, args)


def thirds(series: list, steps: int) -> tuple[list, list]:
    """Each seed's mean over the middle third of the steps, and over the last third."""
    third = max(steps // 3, 1)
    return final(series, steps - third, third), final(series, steps, third)


def main():
    args = arguments(__doc__, seeds=3, steps=20)
    rm = reward_model(args)
    runs = run_arms("rm_overoptimisation", ARMS, args,
                    common=[*COMMON, "--reward-model", str(rm)])
    last = json.loads((runs["beta 0"][0] / "metrics.jsonl").read_text().splitlines()[-1])
    proxy_key = next(k for k in last if k.startswith("reward_rm:"))  # (reward_rm:model)
    series = {name: {arm: [metric(f, key) for f in seeds.values()] for arm, seeds in runs.items()}
              for name, key in (("gold", "accuracy"), ("proxy", proxy_key), ("kl", "kl"))}
    root_kl = "sqrt(KL to the start) (k3, per token)"
    panels = {f"{name} against sqrt(KL)": {arm: [against_root_kl(s, k) for s, k in zip(
                  series[name][arm], series["kl"][arm])] for arm in ARMS}
              for name in ("gold", "proxy")}
    panels.update({"gold: the share right (grader)": series["gold"],
                   f"proxy: the reward model's score ({proxy_key})": series["proxy"]})
    (gold_mid, gold_late), (proxy_mid, proxy_late) = (thirds(series[name]["beta 0"], args.steps)
                                                      for name in ("gold", "proxy"))
    write_finding("rm_overoptimisation", panels, args,
                  axes_of={title: root_kl for title in panels if "against" in title},
                  claim="optimising a learned reward raises it without end while the true score "
                        "rises and falls",
                  paper="Gao et al. 2023, Scaling Laws for Reward Model Overoptimization",
                  reward_model=str(rm), title=TITLE, estimated_minutes=MINUTES,
                  terms={"the gold falls": term(by_seed(gold_late, gold_mid), "negative",
                                                "gold, last third minus middle third of the "
                                                "steps (beta 0)"),
                         "the proxy rises": term(by_seed(proxy_late, proxy_mid), "positive",
                                                 "proxy, last third minus middle third of the "
                                                 "steps (beta 0)"),
                         "the penalty holds the gold": term(by_seed(
                             thirds(series["gold"]["beta 0.1"], args.steps)[1], gold_late),
                             "positive", "gold over the last third, beta 0.1 minus beta 0")})


def against_root_kl(values: list, kl: list) -> list:
    """(sqrt(KL), value) at each step that has both."""
    kl = dict(kl)
    return [(kl[step] ** 0.5, v) for step, v in values if step in kl and kl[step] >= 0]


if __name__ == "__main__":
    main()

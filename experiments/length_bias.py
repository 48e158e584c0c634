"""Length bias of per-sequence loss normalisation (Liu et al. 2025, "Understanding R1-Zero-Like
Training: A Critical Perspective", Dr. GRPO).

The claim: GRPO's loss divides each sequence's token terms by its own length (seq-mean), so a long
wrong answer is pushed down less per token than a short one -- and wrong answers grow longer as
training goes on; summing tokens over a fixed denominator (Dr. GRPO's seq-sum-norm) removes the
bias.

    python experiments/length_bias.py            # 2 arms x 4 seeds x 12 steps, the default model
    python experiments/length_bias.py --tiny     # seconds, on the tests' tiny model

The arms differ in the loss's aggregation alone: both scale the advantage by the group's std
(Dr. GRPO also drops that scaling; here it would be a second difference between the arms). The
task is arith with a 48-token budget, so that a wrong answer has room to grow (48: twice the
task's default), at the task's T = 0.7 (at T = 1.0 the 135M model is right in under 3 % of its
samples at first: most groups all wrong, no gradient). Measured over training: the mean length of
the completions graded wrong, step by step, from rollouts.jsonl; and the accuracy, so that a
longer answer is never mistaken for a better one. And the mechanism itself, on one shared batch a
seed (the samples of the seq-mean run's first 3 steps): the starting model updated once by each
loss (plain SGD, so that Adam's per-weight normalisation does not blur the losses' weighting),
and, over the wrong answers that carry a gradient, the correlation between an answer's length and
the change in its tokens' mean log-probability -- positive where a long wrong answer is pushed
down less. Cost: 8 runs of ~6 min (48 tokens: the earlier design's took 8-15 beside other work)
and the mechanism's 2 updates a seed, ~55 min on a 2-core CPU.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, by_seed, final, mean_spread, pearson, per_step, run_arms  # noqa: E402
from common import samples, start_model, term, write_finding  # noqa: E402

ARMS = {"seq-mean (GRPO)": ["--loss-agg", "seq-mean"],
        "seq-sum-norm (Dr. GRPO)": ["--loss-agg", "seq-sum-norm"]}
COMMON = ["--data", "arith", "--max-new-tokens", "48", "--lr", "2e-5", "--eval-every", "0"]
MECHANISM_LR = 1e-3  # one SGD step: small enough that the change is first order in it
MINUTES = 55
TITLE = "Length bias"  # (its heading in docs/findings.md)


def mechanism(folder: Path, start: str) -> dict[str, float | None]:
    """Each aggregation's correlation, over the wrong answers with a non-zero advantage of the
    run's first 3 steps, between an answer's length and the change of its tokens' mean log-prob
    after one SGD update of the starting model by that loss on those samples (None: fewer than
    3 such answers)."""
    import torch
    from grpo import group_advantages
    cfg = json.loads((folder / "grpo_config.json").read_text())
    batch = sorted((r for r in samples(folder) if r["step"] <= 3),
                   key=lambda r: (r["step"], r["index"]))
    advantages = group_advantages(torch.tensor([r["reward"] for r in batch]),
                                  cfg["num_generations"])
    wrong = [i for i, r in enumerate(batch) if r["correct"] == 0 and advantages[i] != 0]
    lengths = [len(batch[i]["completion_ids"]) for i in wrong]
    out = {}
    for agg in ("seq-mean", "seq-sum-norm"):
        shift = one_update_shift(start, [r["prompt_ids"] for r in batch],
                                 [r["completion_ids"] for r in batch], advantages, agg,
                                 cfg["temperature"], cfg["max_new_tokens"])
        out[agg] = pearson(lengths, [float(shift[i]) for i in wrong])
    return out


def one_update_shift(start: str, prompts: list, completions: list, advantages, loss_agg: str,
                     temperature: float, max_new_tokens: int, micro_batch: int = 8):
    """(B,) the change of each sample's mean log-prob per token after one SGD step of the
    starting model on grpo_loss with this aggregation (on-policy: the ratio 1), the batch's
    gradient summed over micro-batches against the whole batch's denominator."""
    import torch
    from grpo import grpo_loss
    from logprobs import completion_logprobs, length_mask, pack
    from model import load_model
    from rl import loss_denominator
    model, tokenizer = load_model(start, "cpu", torch.float32)
    batch = pack(prompts, completions, tokenizer.pad_token_id)
    lens = batch.completion_lens
    denominator = loss_denominator(loss_agg, lens, max_new_tokens)
    shift = torch.zeros(len(lens))  # (B,)
    for after in (False, True):  # the gradient and the mean log-probs before; then after
        for i in range(0, len(lens), micro_batch):
            rows = slice(i, i + micro_batch)
            with torch.set_grad_enabled(not after):
                lp, _ = completion_logprobs(model, batch.input_ids[rows], batch.prompt_lens[rows],
                                            lens[rows], temperature=temperature)  # (b, T)
            mask = length_mask(lens[rows], lp.shape[1])  # (b, T)
            if not after:
                loss, _ = grpo_loss(lp, lp.detach(), None, advantages[rows], mask,
                                    loss_agg=loss_agg, num_tokens=denominator)
                loss.backward()  # (the micro-batches' gradients add up to the batch's)
            shift[rows] += (1 if after else -1) * (lp.detach() * mask).sum(1) / lens[rows]
        if not after:
            torch.optim.SGD(model.parameters(), lr=MECHANISM_LR).step()
    return shift


def main():
    args = arguments(__doc__, seeds=4, steps=12)
    runs = run_arms("length_bias", ARMS, args, common=COMMON)
    wrong, accuracy = {}, {}
    for arm, seeds in runs.items():
        logs = [samples(folder) for folder in seeds.values()]
        wrong[arm] = [per_step(log, lambda r: len(r["completion_ids"]),
                               keep=lambda r: r["correct"] == 0) for log in logs]
        accuracy[arm] = [per_step(log, lambda r: float(r["correct"] or 0)) for log in logs]
    shared = [mechanism(f, start_model(args)) for f in runs["seq-mean (GRPO)"].values()]
    write_finding(
        "length_bias", {"length of wrong completions (tokens)": wrong, "accuracy": accuracy},
        args, claim="per-sequence normalisation lets wrong answers grow longer (Dr. GRPO)",
        paper="Liu et al. 2025, Understanding R1-Zero-Like Training",
        measured={arm: {"wrong_length_last3": mean_spread(final(s, args.steps))}
                  for arm, s in wrong.items()},
        mechanism={"correlation_of_length_and_logprob_change_by_seed": shared,
                   "sgd_lr": MECHANISM_LR},
        title=TITLE, estimated_minutes=MINUTES,
        terms={"longer": term(by_seed(final(wrong["seq-mean (GRPO)"], args.steps),
                                      final(wrong["seq-sum-norm (Dr. GRPO)"], args.steps)),
                              "positive", "wrong-answer length, seq-mean minus seq-sum-norm "
                              "(tokens, last 3 steps)", margin=1.0),
               "mechanism": term(by_seed([m["seq-mean"] for m in shared],
                                         [m["seq-sum-norm"] for m in shared]), "positive",
                                 "correlation of a wrong answer's length and its log-prob change "
                                 "after one update, seq-mean minus seq-sum-norm")})


if __name__ == "__main__":
    main()

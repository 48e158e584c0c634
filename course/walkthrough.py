"""One GRPO step on a tiny fixed batch, with every number a student can check by hand:
rewards -> group advantages -> ratios -> clipped terms -> KL -> loss -> gradient.

    python course/walkthrough.py                 # print the step
    python course/walkthrough.py --update-doc    # rewrite the numbers in docs/walkthrough.md

One prompt, G = 4 sampled completions of up to 3 tokens. The log-probs are given as numbers, as
completion_logprobs would return them: the policy now (pi_theta), when it sampled (pi_old, one
update ago, so the ratios are not all 1) and the frozen reference (pi_ref). The step uses the
library's own group_advantages and grpo_loss, and checks them against the hand formulas printed
here. In a real run the gradient printed at the end flows on from the log-probs into the weights.
"""

import argparse
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from grpo import group_advantages, grpo_loss  # noqa: E402

DOC = ROOT / "docs" / "walkthrough.md"
G, EPS, BETA = 4, 0.2, 0.04
REWARDS = [1.0, 0.0, 1.0, 0.0]  # completions 0 and 2 got the answer right
LENGTHS = [3, 2, 3, 1]
LOGPROBS = [[-0.50, -1.20, -0.30], [-0.90, -2.00, 0.0], [-0.10, -0.70, -1.00], [-1.50, 0.0, 0.0]]
# log pi_theta - log pi_old per token: chosen so that some ratios leave [0.8, 1.2]
DRIFT = [[0.00, 0.30, -0.10], [-0.40, 0.10, 0.0], [0.05, -0.05, 0.20], [0.25, 0.0, 0.0]]
# log pi_ref - log pi_theta per token
REF_GAP = [[0.10, -0.20, 0.00], [0.30, -0.10, 0.0], [0.00, 0.20, -0.30], [0.10, 0.0, 0.0]]


def table(rows: list[list[float]], lengths: list[int], fmt: str = "{:8.4f}") -> str:
    """One line per completion, its valid tokens only (padding shown as dots)."""
    return "\n".join(f"  completion {i}: " + " ".join(fmt.format(v) if t < n else "       ."
                                                      for t, v in enumerate(row))
                     for i, (row, n) in enumerate(zip(rows, lengths)))


def walkthrough() -> list[tuple[str, str]]:
    """The step, as (title, text) sections."""
    sections = []
    rewards = torch.tensor(REWARDS)
    lp = torch.tensor(LOGPROBS, requires_grad=True)  # (B, T) pi_theta's log-probs
    old = lp.detach() - torch.tensor(DRIFT)  # (B, T)
    ref = lp.detach() + torch.tensor(REF_GAP)  # (B, T)
    lens = torch.tensor(LENGTHS)
    mask = torch.arange(3)[None] < lens[:, None]  # (B, T) from lengths, never from pad tokens
    n_tokens = int(mask.sum())

    mean, std = rewards.mean(), rewards.std()  # std unbiased (divides by G - 1), as in GRPO
    sections.append(("1. Rewards", f"  r = {REWARDS}\n  group mean = {mean:.4f}, group std "
                                   f"(unbiased, / (G-1)) = {std:.4f}"))

    adv = group_advantages(rewards, G)
    by_hand = (rewards - mean) / (std + 1e-6)
    assert torch.allclose(adv, by_hand)
    sections.append(("2. Group advantages", "  A_i = (r_i - mean) / (std + 1e-6)\n  A = ["
                     + ", ".join(f"{a:.4f}" for a in adv.tolist()) + "]"))

    ratio = torch.exp(lp.detach() - old)  # (B, T)
    sections.append(("3. Ratios r_t = exp(log pi_theta - log pi_old)",
                     table(ratio.tolist(), LENGTHS)))

    A = adv[:, None]  # (B, 1)
    unclipped, clipped = ratio * A, ratio.clamp(1 - EPS, 1 + EPS) * A
    surrogate = torch.min(unclipped, clipped)  # (B, T)
    cut = (surrogate != unclipped) & mask  # the min chose the clipped term: no gradient there
    sections.append(("4. Clipped surrogate min(r A, clip(r, 0.8, 1.2) A)",
                     table(surrogate.tolist(), LENGTHS) + "\n  clipped (no gradient): "
                     + ", ".join(f"completion {b} token {t}" for b, t in cut.nonzero().tolist())))

    log_r = ref - lp.detach()  # (B, T)
    k3 = torch.exp(log_r) - log_r - 1  # (B, T), >= 0
    sections.append(("5. KL to the reference, k3 = exp(ref - lp) - (ref - lp) - 1",
                     table(k3.tolist(), LENGTHS)))

    per_token = (-surrogate + BETA * k3) * mask  # (B, T)
    loss_by_hand = per_token.sum() / n_tokens
    loss, metrics = grpo_loss(lp, old, ref, adv, mask, eps_low=EPS, eps_high=EPS, beta=BETA)
    assert abs(float(loss.detach()) - float(loss_by_hand)) < 1e-6
    sections.append(("6. Loss (token-mean)",
                     f"  per token: -surrogate + {BETA} * k3\n" + table(per_token.tolist(), LENGTHS)
                     + f"\n  loss = sum over the {n_tokens} valid tokens / {n_tokens} = "
                     f"{float(loss.detach()):.4f}\n  grpo_loss metrics: clip_low {metrics['clip_low']:.4f}, "
                     f"clip_high {metrics['clip_high']:.4f}, ratio {metrics['ratio']:.4f}, "
                     f"kl {metrics['kl']:.4f}"))

    loss.backward()
    # d/dlp of -r A is -r A where the unclipped term is chosen, 0 where the clipped one is;
    # d/dlp of beta * k3 is beta * (1 - exp(ref - lp)). Both divided by the token count.
    grad_by_hand = (torch.where(cut, 0.0, -ratio * A) + BETA * (1 - torch.exp(log_r))) * mask
    grad_by_hand = grad_by_hand / n_tokens
    assert torch.allclose(lp.grad, grad_by_hand, atol=1e-7)
    sections.append(("7. Gradient d loss / d log pi_theta",
                     "  (-r A where not clipped, 0 where clipped) + beta (1 - exp(ref - lp)), "
                     f"all / {n_tokens}\n" + table(lp.grad.tolist(), LENGTHS)
                     + f"\n  gradient norm = {float(lp.grad.norm()):.4f}"))
    return sections


def render(sections: list[tuple[str, str]]) -> str:
    return "\n\n".join(f"## {title}\n{text}" for title, text in sections)


def doc_blocks(markdown: str) -> list[str]:
    """The fenced ```text blocks of the walkthrough doc, in order."""
    return re.findall(r"```text\n(.*?)\n```", markdown, flags=re.S)


def update_doc(sections: list[tuple[str, str]], doc: Path = DOC):
    """Put the numbers into the doc's blocks, in order, keeping the commentary around them."""
    texts = iter(text for _, text in sections)
    markdown = re.sub(r"```text\n(.*?)\n```", lambda m: f"```text\n{next(texts)}\n```",
                      doc.read_text(), flags=re.S)
    doc.write_text(markdown)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--update-doc", action="store_true", help=f"rewrite the numbers in {DOC}")
    args = parser.parse_args()
    sections = walkthrough()
    if args.update_doc:
        blocks = len(doc_blocks(DOC.read_text()))
        if blocks != len(sections):
            raise SystemExit(f"error: {DOC} has {blocks} ```text blocks, the walkthrough "
                             f"{len(sections)} sections: add or remove blocks first")
        update_doc(sections)
        print(f"updated {DOC}")
    else:
        print(render(sections))

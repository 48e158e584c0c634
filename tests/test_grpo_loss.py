"""grpo_loss and group_advantages against hand-computed values."""

import math

import pytest
import torch

from grpo import Config, group_advantages, grpo_loss
from rl import loss_denominator
from reward import overlong_penalty


def _batch():
    # 2 sequences, T = 3; the second has 2 valid tokens.
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]])
    old = torch.tensor([[-1.0, -2.5, -0.5], [-1.0, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0])
    return lp, old, mask, adv


def _per_token(lp, old, adv, eps_low=0.2, eps_high=0.2):
    # Plain-python reference of -min(r A, clip(r) A).
    out = []
    for b in range(lp.shape[0]):
        row = []
        for t in range(lp.shape[1]):
            r = math.exp(lp[b, t] - old[b, t])
            A = float(adv[b])
            row.append(-min(r * A, min(max(r, 1 - eps_low), 1 + eps_high) * A))
        out.append(row)
    return out


def test_token_mean_value():
    lp, old, mask, adv = _batch()
    pt = _per_token(lp, old, adv)
    expected = (pt[0][0] + pt[0][1] + pt[0][2] + pt[1][0] + pt[1][1]) / 5
    loss, m = grpo_loss(lp, old, None, adv, mask)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # r = exp(0.5) = 1.65 > 1.2 with A > 0: clipped high; r = exp(-0.5) = 0.61 < 0.8 with A < 0.
    assert m["clip_high"] == pytest.approx(1 / 5)
    assert m["clip_low"] == pytest.approx(1 / 5)


def test_seq_mean_and_seq_sum_norm_values():
    lp, old, mask, adv = _batch()
    pt = _per_token(lp, old, adv)
    seq_mean = ((pt[0][0] + pt[0][1] + pt[0][2]) / 3 + (pt[1][0] + pt[1][1]) / 2) / 2
    loss, _ = grpo_loss(lp, old, None, adv, mask, loss_agg="seq-mean")
    assert loss.item() == pytest.approx(seq_mean, rel=1e-6)
    total = pt[0][0] + pt[0][1] + pt[0][2] + pt[1][0] + pt[1][1]
    loss, _ = grpo_loss(lp, old, None, adv, mask, loss_agg="seq-sum-norm", num_tokens=2 * 10)
    assert loss.item() == pytest.approx(total / 20, rel=1e-6)


def test_clip_ranges_are_asymmetric():
    lp = torch.log(torch.tensor([[1.25, 0.75]]))
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # A > 0: 1.25 is above 1 + 0.2 but below 1 + 0.28 (DAPO's clip-higher).
    _, m = grpo_loss(lp, old, None, torch.tensor([1.0]), mask, eps_high=0.2)
    assert m["clip_high"] == pytest.approx(0.5)
    _, m = grpo_loss(lp, old, None, torch.tensor([1.0]), mask, eps_high=0.28)
    assert m["clip_high"] == 0.0
    # A < 0: 0.75 is below 1 - 0.2 but above 1 - 0.3.
    _, m = grpo_loss(lp, old, None, torch.tensor([-1.0]), mask, eps_low=0.2)
    assert m["clip_low"] == pytest.approx(0.5)
    _, m = grpo_loss(lp, old, None, torch.tensor([-1.0]), mask, eps_low=0.3)
    assert m["clip_low"] == 0.0


def test_clipped_tokens_have_no_gradient():
    lp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = grpo_loss(lp, torch.zeros(1, 2), None, torch.tensor([1.0]),
                        torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert lp.grad[0, 0] == 0.0 and lp.grad[0, 1] != 0.0


def test_kl_k3_value_and_sign():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([0.0])  # only the KL term remains
    beta = 0.1
    loss, m = grpo_loss(lp, lp.clone(), ref, adv, mask, beta=beta)
    k3 = [math.exp(r - p) - (r - p) - 1 for r, p in [(-1.5, -1.0), (-1.0, -2.0)]]
    assert m["kl"] == pytest.approx(sum(k3) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(beta * sum(k3) / 2, rel=1e-6)
    assert all(k > 0 for k in k3)
    # The KL gradient pulls log-probs towards the reference: d/dlp k3 = 1 - exp(ref - lp).
    lp = lp.clone().requires_grad_()
    loss, _ = grpo_loss(lp, lp.detach(), ref, adv, mask, beta=beta)
    loss.backward()
    assert lp.grad[0, 0] > 0  # lp above ref: gradient descent lowers it
    assert lp.grad[0, 1] < 0  # lp below ref: gradient descent raises it


def test_on_policy_ratio_is_one_but_gradient_is_not_zero():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, m = grpo_loss(lp, lp.detach(), None, torch.tensor([1.0]),
                        torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert m["ratio"] == pytest.approx(1.0)
    assert torch.allclose(lp.grad, torch.tensor([[-0.5, -0.5]]))  # -A / num_tokens


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean", "seq-sum-norm"])
def test_micro_batching_leaves_loss_and_gradient_unchanged(loss_agg):
    torch.manual_seed(0)
    B, T = 6, 7
    lens = torch.tensor([7, 3, 5, 1, 6, 2])
    mask = torch.arange(T)[None] < lens[:, None]
    old = -torch.rand(B, T) * 3
    ref = -torch.rand(B, T) * 3
    adv = torch.randn(B)
    base = (old + 0.3 * torch.randn(B, T)).detach()
    denom = loss_denominator(loss_agg, lens, max_new_tokens=T)

    lp = base.clone().requires_grad_()
    full, _ = grpo_loss(lp, old, ref, adv, mask, beta=0.05, loss_agg=loss_agg, num_tokens=denom)
    full.backward()
    grad_full = lp.grad.clone()

    lp = base.clone().requires_grad_()
    total = 0.0
    for idx in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part, _ = grpo_loss(lp[idx], old[idx], ref[idx], adv[idx], mask[idx], beta=0.05,
                            loss_agg=loss_agg, num_tokens=denom)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-5)
    assert torch.allclose(lp.grad, grad_full, atol=1e-7)


def test_advantages_group_scale():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(r, 4)
    std = math.sqrt(4 * 0.5 ** 2 / 3)  # the group's unbiased std: 0.5774
    expected = [x / (std + 1e-6) for x in (0.5, -0.5, -0.5, 0.5)]  # +-0.8660
    assert adv[:4].tolist() == pytest.approx(expected, rel=1e-5)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # zero-std group: exactly 0


def test_advantages_zero_std_groups_never_nan():
    # In groups of 8, the float32 mean of eight 0.7s (or 0.1s, 1/3s) is an ulp off: r - mean != 0
    for r in (torch.zeros(8), torch.ones(8), torch.full((8,), 0.1), torch.full((8,), 0.7),
              torch.full((8,), 1 / 3)):
        for G in (4, 8):
            for scale in ("group", "batch", "none"):
                for loo in (False, True):
                    adv = group_advantages(r, G, scale=scale, leave_one_out=loo)
                    assert adv.tolist() == [0.0] * 8, (r.tolist(), G, scale, loo)


def test_advantages_leave_one_out_and_batch_scale():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4, scale="none", leave_one_out=True)
    assert adv.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 2.0, -2 / 3, -2 / 3, -2 / 3])
    adv = group_advantages(r, 4, scale="batch")  # group means 0.25 and 1.5, batch std 1.0351
    batch_std = float(r.std())
    expected = [(x - 0.25) / (batch_std + 1e-6) for x in r[:4].tolist()] + \
               [(x - 1.5) / (batch_std + 1e-6) for x in r[4:].tolist()]
    assert adv.tolist() == pytest.approx(expected, rel=1e-5)
    adv = group_advantages(r, 4, scale="none")
    assert adv[:4].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_advantages_refuse_an_unknown_scale():
    with pytest.raises(ValueError):
        group_advantages(torch.ones(4), 2, scale="median")


def test_grpo_loss_refuses_an_unknown_aggregation():
    with pytest.raises(ValueError):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.zeros(1),
                  torch.ones(1, 1), loss_agg="sum")
    with pytest.raises(ValueError, match="surrogate must be clip, cispo or sapo"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.zeros(1),
                  torch.ones(1, 1), surrogate="x")


def test_token_weights_scale_the_surrogate_not_the_kl():
    lp, old, mask, adv = _batch()
    ref = old - 0.3
    base, _ = grpo_loss(lp, old, ref, adv, mask, beta=0.0)
    doubled, _ = grpo_loss(lp, old, ref, adv, mask, beta=0.0, token_weights=torch.full_like(lp, 2.0))
    assert doubled.item() == pytest.approx(2 * base.item(), rel=1e-6)
    kl_only, _ = grpo_loss(lp, old, ref, torch.zeros(2), mask, beta=0.1)
    kl_weighted, _ = grpo_loss(lp, old, ref, torch.zeros(2), mask, beta=0.1,
                               token_weights=torch.full_like(lp, 2.0))
    assert kl_weighted.item() == pytest.approx(kl_only.item(), rel=1e-6)


def test_engine_mismatch_metrics():
    from rollout import engine_mismatch
    trainer = torch.tensor([[-1.0, -2.0, -3.0, -1.2]])
    engine = torch.tensor([[-1.0, -2.5, -9.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # the third token is padding: ignored
    m = engine_mismatch(trainer, engine, mask)
    # sums over valid tokens; exp(|d|) counts the trainer-below-engine token (d = -0.2) as 0.2 too
    assert m["token_mult_prob_error"] == pytest.approx(math.exp(0) + math.exp(0.5) + math.exp(0.2))
    assert m["gen_kl_error"] == pytest.approx((math.exp(0.5) - 0.5 - 1) + (math.exp(-0.2) + 0.2 - 1))
    assert m["logprob_max_abs_diff"] == pytest.approx(0.5)


def test_warmup_schedule_then_constant():
    from model import adamw_with_warmup
    model = torch.nn.Linear(2, 2)
    optimizer, scheduler = adamw_with_warmup(model, lr=1e-3, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("ratio, adv, eps_low, eps_high, clipped", [
    (1.25, 1.0, 0.2, 0.28, False),   # inside clip-higher's range: still pushed up
    (1.25, 1.0, 0.28, 0.2, True),    # above 1 + eps_high: no gradient
    (0.75, -1.0, 0.3, 0.2, False),   # inside the lower range: still pushed down
    (0.75, -1.0, 0.2, 0.3, True),    # below 1 - eps_low: no gradient
])
def test_each_clip_bound_uses_its_own_eps_in_loss_and_gradient(ratio, adv, eps_low, eps_high,
                                                                clipped):
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, _ = grpo_loss(lp, torch.zeros(1, 1), None, torch.tensor([adv]),
                        torch.ones(1, 1, dtype=torch.bool), eps_low=eps_low, eps_high=eps_high)
    loss.backward()
    bound = 1 + eps_high if adv > 0 else 1 - eps_low
    expected = -(bound if clipped else ratio) * adv
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # d/dlp of -r A is -r A; a clipped token has no gradient
    assert lp.grad.item() == pytest.approx(0.0 if clipped else -ratio * adv, rel=1e-6)


def test_overlong_penalty_values():
    assert overlong_penalty([10, 12, 14, 16], max_new_tokens=16, buffer=4) == [0.0, 0.0, -0.5, -1.0]


def test_gspo_sequence_ratio_against_hand_computed():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    old = torch.tensor([[-1.1, -2.2, -2.7], [-0.5, -0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    eps_low, eps_high = 3e-4, 4e-4
    s0 = math.exp(((-1 + 1.1) + (-2 + 2.2) + (-3 + 2.7)) / 3)  # exp(0) = 1.0
    s1 = math.exp(((-0.5 + 0.5) + (-0.5 + 0.3)) / 2)  # exp(-0.1)
    per_seq = [-min(s * a, min(max(s, 1 - eps_low), 1 + eps_high) * a)
               for s, a in ((s0, 1.0), (s1, -1.0))]
    loss, m = grpo_loss(lp, old, None, adv, mask, eps_low=eps_low, eps_high=eps_high,
                        loss_agg="seq-mean", ratio_level="sequence")
    assert loss.item() == pytest.approx(sum(per_seq) / 2, rel=1e-4)  # fp32
    assert m["clip_low"] == pytest.approx(2 / 5)  # sequence 1 (2 tokens) is clipped low
    # GSPO's objective is a mean over sequences: any other aggregation is refused
    for agg in ("token-mean", "seq-sum-norm"):
        with pytest.raises(ValueError, match="seq-mean"):
            grpo_loss(lp, old, None, adv, mask, loss_agg=agg, ratio_level="sequence")


def test_gspo_gradient_is_the_papers():
    """d loss / d log pi(y_i,t) = -(1/G) s_i A_i / |y_i| for every token of an unclipped sequence:
    long answers do not weigh more than short ones."""
    lens = torch.tensor([2, 6])
    mask = torch.arange(6)[None] < lens[:, None]
    old = -torch.rand(2, 6) - 0.5
    lp = (old + 0.01 * torch.randn(2, 6) * mask).requires_grad_()
    adv = torch.tensor([1.5, -0.7])
    cfg = Config(ratio_level="sequence", seq_eps_low=0.5, seq_eps_high=0.5)  # nothing clipped
    assert cfg.loss_agg == "seq-mean"  # what --ratio-level sequence resolves to
    loss, _ = grpo_loss(lp, old, None, adv, mask, eps_low=cfg.seq_eps_low,
                        eps_high=cfg.seq_eps_high, loss_agg=cfg.loss_agg,
                        num_tokens=loss_denominator(cfg.loss_agg, lens, 6),
                        ratio_level="sequence")
    loss.backward()
    for i in range(2):
        n = int(lens[i])
        s_i = math.exp(float((lp[i, :n] - old[i, :n]).mean()))
        expected = -(1 / 2) * s_i * float(adv[i]) / n
        assert torch.allclose(lp.grad[i, :n], torch.full((n,), expected), rtol=1e-5)
        assert lp.grad[i, n:].eq(0).all()


def test_gspo_refuses_a_contradictory_aggregation():
    with pytest.raises(SystemExit, match="--loss-agg token-mean contradicts"):
        Config(ratio_level="sequence", loss_agg="token-mean")
    assert Config().loss_agg == "token-mean"


def test_seq_sum_norm_without_a_global_count_divides_by_all_slots():
    lp, old, mask, adv = _batch()
    pt = _per_token(lp, old, adv)
    total = pt[0][0] + pt[0][1] + pt[0][2] + pt[1][0] + pt[1][1]
    loss, _ = grpo_loss(lp, old, None, adv, mask, loss_agg="seq-sum-norm")  # (B * T) = 6 slots
    assert loss.item() == pytest.approx(total / 6, rel=1e-6)


def test_loss_denominator_counts_only_sequences_in_the_loss():
    lens = torch.tensor([3, 0, 2])  # the middle one was overlong-filtered
    assert loss_denominator("token-mean", lens, 4) == 5.0
    assert loss_denominator("seq-mean", lens, 4) == 2.0
    assert loss_denominator("seq-sum-norm", lens, 4) == 2.0 * 4


def test_token_budget_micro_batches_respect_the_budget():
    from trainer import micro_batches
    cfg = Config(max_tokens_per_microbatch=12)
    seq_lens = torch.tensor([5, 2, 6, 3, 4, 1])
    mbs = micro_batches(torch.arange(6), seq_lens, cfg)
    assert sorted(i for mb in mbs for i in mb.tolist()) == list(range(6))  # each exactly once
    for mb in mbs:
        assert len(mb) * int(seq_lens[mb].max()) <= 12  # padded size within the budget
        assert seq_lens[mb].tolist() == sorted(seq_lens[mb].tolist(), reverse=True)
    assert [mb.tolist() for mb in mbs] == [[2, 0], [4, 3, 1], [5]]  # longest first, packed greedily


def _cispo_sapo_batch():
    """Ratios inside and outside [0.8, 1.2], both signs of advantage; the second row 2 tokens."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.2], [-1.5, -0.3, 0.0, 0.0]])
    lp = old + torch.tensor([[0.5, -0.05, -0.6, 0.1], [0.3, -0.4, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.5, -0.8])
    return lp, old, mask, adv


def test_cispo_is_the_papers_equation_and_keeps_every_tokens_gradient():
    """CISPO (MiniMax-M1, eq. 4): L = -(1/N) sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A
    log pi(y_t), token-mean. Its gradient for log pi(y_t) is -clip(r_t) A / N at every token -- a
    token past the clip keeps its gradient, scaled to the bound, where the clipped loss's is 0."""
    lp, old, mask, adv = _cispo_sapo_batch()
    lp = lp.clone().requires_grad_()
    eps_low, eps_high = 0.2, 0.28
    n = int(mask.sum())
    loss, m = grpo_loss(lp, old, None, adv, mask, eps_low=eps_low, eps_high=eps_high,
                        surrogate="cispo")
    expected, grads = 0.0, torch.zeros_like(lp)
    for b in range(2):
        for t in range(4):
            if mask[b, t]:
                w = min(max(math.exp(float(lp[b, t] - old[b, t])), 1 - eps_low), 1 + eps_high)
                expected += -w * float(adv[b]) * float(lp[b, t]) / n
                grads[b, t] = -w * float(adv[b]) / n
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, grads)
    assert lp.grad[0, 0] != 0  # r = e^0.5 past 1 + eps_high with A > 0: clip would give 0
    clipped, _ = grpo_loss(lp, old, None, adv, mask, eps_low=eps_low, eps_high=eps_high)
    lp.grad = None
    clipped.backward()
    assert lp.grad[0, 0] == 0
    assert m["clip_high"] == pytest.approx(2 / n) and m["clip_low"] == pytest.approx(2 / n)


def test_sapo_is_the_papers_soft_gate_with_a_temperature_per_sign():
    """SAPO (Gao et al. 2025): L = -(1/N) sum_t (4 / tau) sigmoid(tau (r_t - 1)) A, tau = tau_pos
    where A > 0, else tau_neg. Its gradient for log pi(y_t) is -4 s (1 - s) r_t A / N: at
    r = 1 the plain policy gradient -A / N; past the clip damped, never 0."""
    lp, old, mask, adv = _cispo_sapo_batch()
    lp = lp.clone().requires_grad_()
    tau_pos, tau_neg = 1.0, 2.5
    n = int(mask.sum())
    loss, _ = grpo_loss(lp, old, None, adv, mask, surrogate="sapo", tau_pos=tau_pos,
                        tau_neg=tau_neg)
    expected, grads = 0.0, torch.zeros_like(lp)
    for b in range(2):
        tau = tau_pos if adv[b] > 0 else tau_neg
        for t in range(4):
            if mask[b, t]:
                r = math.exp(float(lp[b, t] - old[b, t]))
                s = 1 / (1 + math.exp(-tau * (r - 1)))
                expected += -(4 / tau) * s * float(adv[b]) / n
                grads[b, t] = -4 * s * (1 - s) * r * float(adv[b]) / n
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, grads)
    on_policy = old.clone().requires_grad_()
    loss, _ = grpo_loss(on_policy, old, None, adv, mask, surrogate="sapo", tau_pos=tau_pos,
                        tau_neg=tau_neg)
    loss.backward()
    torch.testing.assert_close(on_policy.grad, -(adv[:, None] * mask) / n)


def test_surrogate_options_are_checked():
    assert Config(surrogate="cispo", eps_low=1.0).eps_low == 1.0  # (MiniMax-M1: no floor)
    with pytest.raises(SystemExit, match="need 0 <= eps-low < 1"):
        Config(eps_low=1.0)
    with pytest.raises(SystemExit, match="--sapo-tau-pos and --sapo-tau-neg must be positive"):
        Config(surrogate="sapo", sapo_tau_neg=0.0)
    with pytest.raises(SystemExit, match="--surrogate sapo weighs each token by its own ratio"):
        Config(surrogate="sapo", ratio_level="sequence")


def test_reinforce_keeps_only_the_advantages_of_one_sign():
    # Zhu et al. 2025: PSR trains on the samples above their group's mean only, NSR on those below.
    # Group (1, 0, 0, 1): advantages (+a, -a, -a, +a), a = 0.5 / std = 0.5 / sqrt(1/3) = 0.866.
    from grpo import keep_sign
    a = 0.5 / math.sqrt(1 / 3)
    adv = torch.tensor([a, -a, -a, a])
    assert keep_sign(adv, "all").tolist() == pytest.approx([a, -a, -a, a], rel=1e-6)
    assert keep_sign(adv, "positive").tolist() == pytest.approx([a, 0, 0, a], rel=1e-6)
    assert keep_sign(adv, "negative").tolist() == pytest.approx([0, -a, -a, 0], rel=1e-6)
    with pytest.raises(ValueError, match="reinforce"):
        keep_sign(adv, "both")
    assert Config(reinforce="negative").reinforce == "negative"


def test_unit_advantages_weigh_every_sample_plus_or_minus_one_as_zhu_et_al_do():
    # Zhu et al. 2025 decompose RLVR with rewards +1 / -1 and no baseline: NSR pushes down every
    # wrong sample -- those of a group with no right answer too, where GRPO's advantage is 0 --
    # and PSR pulls up every right one, an all-right group's included.
    from grpo import keep_sign, unit_advantages
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])  # groups of 4: none right
    # (GRPO's advantages: 0, 0, 0, 0 -- no gradient), then 3 of 4 right
    unit = unit_advantages(rewards)
    assert unit.tolist() == [-1, -1, -1, -1, 1, -1, 1, 1]
    assert keep_sign(unit, "negative").tolist() == [-1, -1, -1, -1, 0, -1, 0, 0]
    assert keep_sign(unit, "positive").tolist() == [0, 0, 0, 0, 1, 0, 1, 1]
    assert unit_advantages(torch.tensor([0.1, -0.5, 2.0])).tolist() == [1, -1, 1]  # by the sign
    assert Config(adv_scale="unit", reinforce="negative").adv_scale == "unit"
    # +1 for a positive reward, -1 for any other: only a verifier's verdict reads that way
    # (helper-26). A baseline, a learned score, a judge's p(yes) (always positive), the overlong
    # penalty (a right answer near the budget would count wrong), several rewards summed (a
    # wrong answer in the right format would count right), and dynamic sampling (it drops the
    # all-wrong groups unit trains) are refused, each named.
    for options, named in [(dict(leave_one_out=True), "--leave-one-out"),
                           (dict(reward_model="out/rm"), "--reward-model"),
                           (dict(judge="some/judge"), "--judge"),
                           (dict(overlong_buffer=4), "--overlong-buffer"),
                           (dict(dynamic_sampling=True), "--dynamic-sampling"),
                           (dict(reward="correctness,format=0.1"), "2 reward sources"),
                           (dict(replay="out/grpo"), "--replay"),
                           (dict(reward="correctness=-1"), "a weight of 0 or less"),
                           (dict(reward="correctness=0e5"), "a weight of 0 or less"),
                           (dict(reward=" , "), "--reward '' .no reward to read."),
                           (dict(reward="runs/lr=1e-5/r.py:verdict=-1"), "a weight of 0")]:
        with pytest.raises(SystemExit, match=f"--adv-scale unit reads .*: not with {named}"):
            Config(adv_scale="unit", **options)
    assert Config(adv_scale="unit", reward="my_rewards:verdict").reward == "my_rewards:verdict"
    assert Config(adv_scale="unit", reward="correctness=2, ").adv_scale == "unit"  # (one source)


def test_the_loss_with_reinforce_trains_only_that_signs_samples():
    # On-policy (ratio 1), token-mean over 4 sequences of 2 tokens: the gradient of a token's
    # log-prob is -A / 8 where the sample is kept, exactly 0 where it is not.
    from grpo import keep_sign
    a = 0.5 / math.sqrt(1 / 3)
    adv = torch.tensor([a, -a, -a, a])
    lp = torch.tensor([[-1.0, -0.5], [-2.0, -0.1], [-0.3, -0.7], [-1.2, -0.4]],
                      requires_grad=True)
    mask = torch.ones(4, 2, dtype=torch.bool)
    for which, kept in (("positive", [a, 0, 0, a]), ("negative", [0, -a, -a, 0])):
        lp.grad = None
        loss, _ = grpo_loss(lp, lp.detach(), None, keep_sign(adv, which), mask)
        loss.backward()
        assert lp.grad.flatten().tolist() == pytest.approx([-k / 8 for k in kept for _ in range(2)],
                                                           rel=1e-5)

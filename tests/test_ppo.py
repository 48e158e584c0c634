"""ppo.py (issue 44): GAE against a plain loop over each row's model tokens (tool results between
them), the value loss and its clip by hand, per-token rewards, each model's gradient its own loss's
alone, a tool token's advantage exactly 0, and a tiny run that resumes exactly."""

import json
import random
from dataclasses import replace

import pytest
import torch

import ppo
from cli import parse_config
from conftest import make_batch, read_metrics


def _plain_gae(rewards, values, mask, gamma, lam):
    """The textbook recursion over one row's model tokens, side by side (tool tokens dropped),
    put back at their places; 0 elsewhere."""
    where = [t for t, m in enumerate(mask) if m]
    r, v = [rewards[t] for t in where], [values[t] for t in where]
    adv, running = [0.0] * len(where), 0.0
    for k in reversed(range(len(where))):
        next_value = v[k + 1] if k + 1 < len(where) else 0.0
        running = r[k] + gamma * next_value - v[k] + gamma * lam * running
        adv[k] = running
    out_a, out_g = [0.0] * len(mask), [0.0] * len(mask)
    for k, t in enumerate(where):
        out_a[t], out_g[t] = adv[k], adv[k] + v[k]
    return out_a, out_g


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_equals_a_plain_loop_over_each_rows_model_tokens(seed):
    rng = random.Random(seed)
    B, T = 5, 12
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):  # a model turn, a tool result (not the model's), another turn; padding
        n = rng.randint(1, T)
        row = [True] * n + [False] * (T - n)
        for t in rng.sample(range(n), k=n // 3):
            row[t] = False  # a tool result's tokens, between the model's
        row[0] = True
        mask[b] = torch.tensor(row)
    rewards = torch.randn(B, T) * mask  # (rewards only where the model acts)
    values = torch.randn(B, T)
    gamma, lam = rng.uniform(0.9, 1.0), rng.uniform(0.5, 1.0)
    advantages, returns = ppo.gae(rewards, values, mask, gamma, lam)
    for b in range(B):
        a, g = _plain_gae(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), gamma, lam)
        assert advantages[b].tolist() == pytest.approx(a, abs=1e-5)
        assert returns[b].tolist() == pytest.approx(g, abs=1e-5)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()  # tool tokens: exactly 0


def test_gae_by_hand_with_gamma_below_one_and_a_tool_result_between_the_models_tokens():
    """Worked on paper: row 0 has the model's tokens at 0, 2 and 3, a tool's result at 1 and a pad
    at 4 (their values are never read), the reward on its last model token; row 1 is one token."""
    mask = torch.tensor([[True, False, True, True, False], [True, False, False, False, False]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0], [-1.0, 0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 9.0, 0.6, 0.8, 7.0], [0.25, 9.0, 9.0, 9.0, 9.0]])
    advantages, returns = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.8)  # gamma lam = 0.72
    # row 0, backwards over the model's tokens:
    #   t = 3, the last (nothing after it): delta = 1 + 0.9 * 0 - 0.8 = 0.2,   A = 0.2
    #   t = 2, next 3:  delta = 0 + 0.9 * 0.8 - 0.6 = 0.12,  A = 0.12 + 0.72 * 0.2   = 0.264
    #   t = 0, next 2 (1 is the tool's, no step): delta = 0 + 0.9 * 0.6 - 0.5 = 0.04,
    #                                                         A = 0.04 + 0.72 * 0.264 = 0.23008
    # row 1: delta = -1 + 0 - 0.25 = -1.25 = A.    G = A + V on the model's tokens, 0 elsewhere.
    assert advantages.tolist()[0] == pytest.approx([0.23008, 0.0, 0.264, 0.2, 0.0], abs=1e-6)
    assert returns.tolist()[0] == pytest.approx([0.73008, 0.0, 0.864, 1.0, 0.0], abs=1e-6)
    assert advantages.tolist()[1] == pytest.approx([-1.25, 0.0, 0.0, 0.0, 0.0], abs=1e-6)
    assert returns.tolist()[1] == pytest.approx([-1.0, 0.0, 0.0, 0.0, 0.0], abs=1e-6)


def test_per_token_rewards_put_the_reward_on_the_last_model_token_and_the_kl_on_each():
    mask = torch.tensor([[True, True, False, True, False], [True, False, False, False, False]])
    lp, ref = torch.full((2, 5), -1.0), torch.full((2, 5), -1.5)
    r = ppo.token_rewards(torch.tensor([2.0, -1.0]), mask, lp, ref, kl_coef=0.1)
    assert torch.allclose(r, torch.tensor([[-0.05, -0.05, 0.0, 2 - 0.05, 0.0],
                                           [-1 - 0.05, 0.0, 0.0, 0.0, 0.0]]))


def test_the_value_loss_and_its_clip_by_hand():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    loss, m = ppo.value_loss(values, old, returns, mask, clip=0.2, num_tokens=4)
    # token 0: unclipped (1 - 0)^2 = 1; clipped V = 0.5 + 0.2 = 0.7, (0.7)^2 = 0.49 -> max 1
    # token 1: V = old: both (0 - 1)^2 = 1; token 2 is masked
    assert float(loss) == pytest.approx(0.5 * (1 + 1) / 4)
    assert m["value_clip_frac"] == 0.0 and m["value_mean"] == 1.0 and m["return_mean"] == 1.0
    loss, m = ppo.value_loss(torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                             torch.tensor([[True]]), clip=0.5, num_tokens=1)
    # unclipped (0 - 2)^2 = 4; clipped V = 1 - 0.5 = 0.5: (0.5 - 2)^2 = 2.25 -> max 4
    assert float(loss) == pytest.approx(2.0) and m["value_clip_frac"] == 0.0
    loss, m = ppo.value_loss(torch.tensor([[3.0]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                             torch.tensor([[True]]), clip=0.5, num_tokens=1)
    # unclipped (3 - 2)^2 = 1; clipped V = 1.5: (1.5 - 2)^2 = 0.25 -> max 1: not the clipped one
    assert float(loss) == pytest.approx(0.5) and m["value_clip_frac"] == 0.0
    loss, m = ppo.value_loss(torch.tensor([[2.2]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]),
                             torch.tensor([[True]]), clip=0.5, num_tokens=1)
    # unclipped 0.04; clipped V = 1.5: 0.25 -> the clipped term counts
    assert float(loss) == pytest.approx(0.125) and m["value_clip_frac"] == 1.0


def test_the_value_clip_holds_v_near_v_old_on_both_sides_and_cuts_the_gradient_by_hand():
    """clip(V, V_old - 0.5, V_old + 0.5) on either side of V_old; the max keeps the larger
    (pessimistic) term, and where the clipped one counts the clamp is flat: no gradient. The
    denominator is num_tokens (the global batch's: 8 here, 4 tokens in this micro-batch)."""
    values = torch.tensor([[2.2, -0.2, 0.3, 3.0, 5.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0, 2.0, 0.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    loss, m = ppo.value_loss(values, old, returns, mask, clip=0.5, num_tokens=8)
    # 0: V 1.2 above V_old: clipped V 1.5, (1.5 - 2)^2 = 0.25 > (2.2 - 2)^2 = 0.04 -> clipped
    # 1: V 1.2 below V_old: clipped V 0.5, (0.5 - 0)^2 = 0.25 > (-0.2 - 0)^2 = 0.04 -> clipped
    # 2: V within 0.5 of V_old: both (0.3 - 1)^2 = 0.49
    # 3: V 2 above: clipped V 1.5, (1.5 - 2)^2 = 0.25 < (3 - 2)^2 = 1 -> the unclipped counts
    # 4: not in the mask
    assert float(loss) == pytest.approx(0.5 * (0.25 + 0.25 + 0.49 + 1.0) / 8)
    assert m["value_loss"] == pytest.approx(0.5 * (0.25 + 0.25 + 0.49 + 1.0))
    assert m["value_clip_frac"] == 2.0
    loss.backward()
    # d/dV of 1/2 (V - G)^2 / 8 = (V - G) / 8 where V itself is in the counted term, else 0
    assert values.grad.tolist()[0] == pytest.approx([0.0, 0.0, (0.3 - 1) / 8, (3 - 2) / 8, 0.0])
    loss, m = ppo.value_loss(values, old, returns, mask, clip=0.0, num_tokens=8)  # 0: no clip
    assert float(loss) == pytest.approx(0.5 * (0.04 + 0.04 + 0.49 + 1.0) / 8)
    assert m["value_clip_frac"] == 0.0


def _cfg(model_dir, **kw):
    return ppo.Config(data="arith", model=model_dir, dtype="fp32", lr=1e-3, critic_lr=1e-3,
                      micro_batch_size=2, max_new_tokens=6, **kw)


def _batch():
    batch = make_batch([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]],
                       [[20, 21, 2], [22, 2], [23, 24, 25, 26], [27, 2]], [0.0] * 4)
    return replace(batch, rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]))


def test_each_model_gets_the_gradient_of_its_own_loss_only(tiny_model_dir, monkeypatch):
    """The policy's loss never reaches the critic's weights and the value loss never the
    policy's: each optimizer steps with gradients its own loss made."""
    trainer = _cfg(tiny_model_dir, kl_coef=0.02).setup()
    seen = {}

    def recording(who, model):
        def hook(optimizer, args, kwargs):
            seen[who] = {n: p.grad is not None for n, p in model.named_parameters()}
        return hook
    trainer.optimizer.register_step_pre_hook(recording("policy", trainer.model))
    trainer.critic.optimizer.register_step_pre_hook(recording("critic", trainer.critic.model))
    real_backward = torch.Tensor.backward
    calls = []

    def grads(model):
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    def changed(model, before):
        return any((b is None) != (p.grad is None) or (b is not None and not torch.equal(
            b, p.grad)) for p, b in zip(model.parameters(), before))

    def backward(loss, *args, **kwargs):  # which model's weights each backward reaches
        policy, critic = grads(trainer.model), grads(trainer.critic.model)
        real_backward(loss, *args, **kwargs)
        calls.append((changed(trainer.model, policy), changed(trainer.critic.model, critic)))
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    ppo.train_on_rollout(trainer, _batch())
    assert calls and all(policy != critic for policy, critic in calls)  # one model per backward
    assert all(seen["policy"].values()) and all(seen["critic"].values())


def test_a_critic_warm_up_step_moves_the_critic_alone(tiny_model_dir, monkeypatch):
    """...and builds no graph through the policy, whose backward never comes (found by review:
    each micro-batch's graph lived through the next one's forward, a batch of one chunk's
    logits with it)."""
    trainer = _cfg(tiny_model_dir).setup()
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    critic_before = {n: p.clone() for n, p in trainer.critic.model.named_parameters()}
    graphs, policy_logprobs = [], ppo.policy_logprobs

    def recorded(*args):
        logprobs, entropy = policy_logprobs(*args)
        graphs.append(logprobs.grad_fn)
        return logprobs, entropy
    monkeypatch.setattr(ppo, "policy_logprobs", recorded)
    ppo.train_on_rollout(trainer, replace(_batch(), train_policy=False))
    assert graphs and all(graph is None for graph in graphs)
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert any(not torch.equal(p, critic_before[n])
               for n, p in trainer.critic.model.named_parameters())


def test_a_tiny_run_resumes_exactly_and_logs_what_tells_about_the_critic(tiny_model_dir,
                                                                        tmp_path):
    common = ["--model", tiny_model_dir, "--data", "arith", "--steps", "4", "--prompts-per-step",
              "2", "--num-generations", "2", "--max-new-tokens", "6", "--eval-every", "2",
              "--eval-size", "4", "--lr", "1e-3", "--critic-lr", "1e-3", "--kl-coef", "0.02",
              "--critic-warmup", "1", "--dtype", "fp32"]
    whole = ppo.main(parse_config(ppo.Config, common + ["--save-every", "2", "--keep-last", "0",
                                                         "--out", str(tmp_path / "a")]))
    for key in ("value_loss", "explained_variance", "value_clip_frac", "value_mean",
                "return_mean", "value_grad_norm", "eval_accuracy"):
        assert key in whole[-1], key
    assert (tmp_path / "a/checkpoints/step_2/critic/model.safetensors").exists()
    ppo.main(parse_config(ppo.Config, common + ["--resume", str(tmp_path / "a/checkpoints/step_2"),
                                                "--out", str(tmp_path / "b")]))
    assert read_metrics(tmp_path / "a") == read_metrics(tmp_path / "b")
    # The rollout log: the critic's per-token figures for the detailed samples. At the last token
    # GAE's target is that token's reward -- the sequence's, less the KL penalty there.
    logs = [[json.loads(line) for line in (tmp_path / run / "rollouts.jsonl").read_text()
             .splitlines() if '"kind": "train"' in line] for run in "ab"]
    detailed = [r for r in logs[0] if "tokens" in r]
    assert len(detailed) == 4 * 2 and all(r["advantage"] is None for r in logs[0])  # (a group)
    for r in detailed:
        t = r["tokens"]
        assert r["reward"] - 0.02 * (t["old_logprob"][-1] - t["ref_logprob"][-1]) == \
            pytest.approx(t["return"][-1], abs=2e-3)
        assert len(t["advantage"]) == len(t["value"]) == len(r["completion_ids"])
    assert logs[1] == logs[0]  # (resumed: a's samples up to its checkpoint, then the same ones)


def test_the_critic_reads_the_state_before_each_completion_token(tiny_model_dir, monkeypatch):
    """V(s_t) is the scalar head on the decoder's state at position prompt_len + t - 1 -- the state
    the policy's log-prob of token t comes from -- computed here row by row, alone, with no
    padding; the batch runs each group's prompt once (logprobs.share_prompts: asserted taken)."""
    trainer = _cfg(tiny_model_dir).setup()
    critic = trainer.critic.model
    torch.manual_seed(0)
    with torch.no_grad():
        critic.score.weight.normal_()  # (a fresh head is zero: it would read nothing)
    taken = []
    real = ppo.share_prompts
    monkeypatch.setattr(ppo, "share_prompts",
                        lambda *a: taken.append(real(*a)) or taken[-1])
    prompts = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [8, 9], [8, 9], [8, 9]]
    completions = [[20, 21, 2], [22], [23, 24, 25, 26], [27, 2], [28], [29, 30, 2]]
    batch = make_batch(prompts, completions, [0.0] * 6)
    with torch.no_grad():
        values = ppo.token_values(critic, batch, torch.arange(6), "cpu", False)  # (6, T)
        assert taken and taken[0] is not None
        for b, (p, c) in enumerate(zip(prompts, completions)):
            hidden = critic.model(input_ids=torch.tensor([p + c])).last_hidden_state[0]
            expected = critic.score(hidden[len(p) - 1:len(p) + len(c) - 1]).squeeze(-1)
            torch.testing.assert_close(values[b, :len(c)], expected, rtol=1e-5, atol=1e-5)
            assert bool((values[b, len(c):] == 0).all())


def test_a_bf16_step_values_as_fp32_does_and_trains_both_models(tiny_model_dir):
    """--dtype bf16 (what `auto` picks on AMX and Zen 5): the critic's bf16 compute copy gives the
    fp32 master's values within bf16's rounding, and one step moves both models, finitely."""
    trainer = replace(_cfg(tiny_model_dir), dtype="bf16").setup()
    critic = trainer.critic
    torch.manual_seed(0)
    with torch.no_grad():
        critic.model.score.weight.normal_()
    from trainer import refresh_bf16_copy
    refresh_bf16_copy(critic)
    batch = _batch()
    assert next(critic.compute.parameters()).dtype == torch.bfloat16  # (the critic's bf16 copy)
    with torch.no_grad():
        low = ppo.token_values(critic.compute, batch, torch.arange(4), "cpu", True)
        full = ppo.token_values(critic.model, batch, torch.arange(4), "cpu", False)
    scale = float(full.abs().max())
    assert scale > 0 and float((low - full).abs().max()) < 0.05 * scale
    before = [p.clone() for p in (trainer.model.lm_head.weight, critic.model.score.weight)]
    metrics = ppo.train_on_rollout(trainer, batch)
    after = (trainer.model.lm_head.weight, critic.model.score.weight)
    assert all(not torch.equal(b, a) for b, a in zip(before, after))
    from trainer import finish_metrics
    out = finish_metrics([metrics])
    assert all(torch.isfinite(torch.tensor(out[k])) for k in ("loss", "value_loss", "grad_norm"))


def test_a_critic_from_nothing_stops_in_one_line_before_any_model_loads(tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    import trainer as trainer_module
    monkeypatch.setattr(trainer_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    cfg = replace(_cfg(tiny_model_dir), critic_from=str(tmp_path / "no-such-model"),
                  out=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match=r"^error: --critic-from .*no-such-model"):
        ppo.main(cfg)


def test_a_critic_from_a_model_without_a_trained_head_stops_in_one_line(tiny_model_dir, tmp_path,
                                                                        monkeypatch):
    """Issue 55 item 17: --critic-from a causal LM, or a reward model whose weights lost their
    head, would start the critic from a random head and train on its noise: one line, read from
    the weight files' keys, before any model loads."""
    import trainer as trainer_module
    from model import load_model
    from safetensors.torch import load_file, save_file
    headless = tmp_path / "headless"
    model, tokenizer = load_model(tiny_model_dir, head="reward")
    model.save_pretrained(headless)
    tokenizer.save_pretrained(headless)
    weights = load_file(headless / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, headless / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(trainer_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    for folder in (tiny_model_dir, str(headless)):
        cfg = replace(_cfg(tiny_model_dir), critic_from=folder, out=str(tmp_path / "out"))
        with pytest.raises(SystemExit, match=r"^error: --critic-from .*: its weights hold no "
                                             r"trained scalar head \(score.weight\)[^\n]*$"):
            ppo.main(cfg)

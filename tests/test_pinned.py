"""Training-signal paths pinned against plausible one-line bugs that no other test caught
(issue 30). benchmarks/mutants.py holds the mutants -- each a one-line change to the source -- and
says which test kills each; every test here names the mutants it is there for, and each was
checked to fail with them applied and to pass without."""

import copy
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import rl_trainer, REL_TOL, assert_close_to_scale, make_batch, record_grads
from grpo import Config, train_on_rollout
from logprobs import completion_logprobs, length_mask
from trainer import finish_metrics

PROMPTS = [[5, 6], [7, 8, 9], [10], [11, 12], [13, 14, 15], [16]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23, 24, 25, 26], [27, 2], [28, 29], [30, 2]]
ADVANTAGES = [-1.0, 0.0, 0.5, 0.0, 2.0, -1.0]  # positive, zero and negative


def _flat(recorded):
    return torch.cat([g.flatten() for g in recorded.values()])


# ---------------------------------------------------------------------------------------------
# --async-steps 1: pi_old is the policy that sampled, one step stale, per the engine.


def _stale_copy(model, scale=0.01, seed=1):
    """The weights one step before: `model`'s less a fixed update (scale x N(0, 1) per weight,
    seeded). For the tiny model it puts the token ratios between 0.74 and 1.79."""
    stale = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stale.parameters():
            p.sub_(torch.randn(p.shape, generator=generator) * scale)
    return stale


def test_async_ratio_uses_the_engines_logprobs_as_pi_old(tiny_model_dir):
    """With --async-steps 1 the batch was sampled by the weights of the step before (the engine
    reports their log-probs), and the trainer holds weights one update newer. The loss must be
    the clipped surrogate with pi_old = the engine's log-probs,
        -min(r A, clip(r, 0.8, 1.2) A),  r = exp(log pi_theta - log pi_engine),
    token-mean over the batch (15 tokens), and the gradient its gradient -- not on-policy GRPO
    (pi_old = pi_theta detached: ratio 1, nothing clipped, no importance correction), which the
    rest of the suite cannot tell apart. The trained rows go in micro-batches of two: (0, 2), 7
    tokens, and (4, 5), 4 tokens in 2 columns -- the engine's log-probs are indexed by row and
    cut to each micro-batch's width, and the clip fractions are token-weighted over them.
    Mutants: async-pi-old-on-policy, async-engine-rows, stats-unweighted-metrics."""
    trainer = rl_trainer(Config(data="arith", model=tiny_model_dir, dtype="fp32", beta=0.0,
                                   lr=1e-3, async_steps=1, micro_batch_size=2))
    current = copy.deepcopy(trainer.model)  # the weights the update starts from
    on_policy = copy.deepcopy(trainer.model)
    stale = _stale_copy(trainer.model)  # the weights that sampled
    T = trainer.cfg.temperature
    batch = make_batch(PROMPTS, COMPLETIONS, ADVANTAGES)
    mask = length_mask(batch.completion_lens, 4)  # (6, 4)
    with torch.no_grad():
        engine, _ = completion_logprobs(stale, batch.input_ids, batch.prompt_lens,
                                        batch.completion_lens, temperature=T)
    batch = make_batch(PROMPTS, COMPLETIONS, ADVANTAGES, engine_logprobs=engine * mask)
    grads = record_grads(trainer)
    metrics = finish_metrics([train_on_rollout(trainer, batch)])

    # By hand, on a copy of the weights the trainer started from.
    lp, _ = completion_logprobs(current, batch.input_ids, batch.prompt_lens,
                                batch.completion_lens, temperature=T)  # (6, 4)
    A = torch.tensor(ADVANTAGES)[:, None]
    r = torch.exp(lp - engine)  # (6, 4)
    per_token = -torch.minimum(r * A, r.clamp(0.8, 1.2) * A)
    loss = (per_token * mask).sum() / 15
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(current.parameters(), 1.0))
    trained = mask & (A != 0)  # 11 tokens: the zero-advantage rows are skipped
    clip_high = int((trained & (r > 1.2) & (A > 0)).sum())
    clip_low = int((trained & (r < 0.8) & (A < 0)).sum())
    assert (clip_high, clip_low) == (2, 2)  # measured: r 1.25, 1.79 at A 0.5; r 0.74, 0.79 at A -1
    assert int(trained.sum()) == 11

    assert metrics["loss"] == pytest.approx(loss.item(), rel=REL_TOL[torch.float32])
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=REL_TOL[torch.float32])
    assert_close_to_scale(_flat(grads), torch.cat([p.grad.flatten() for p in
                                                   current.parameters()]), what="gradients")
    assert metrics["clip_high"] == pytest.approx(clip_high / 11)
    assert metrics["clip_low"] == pytest.approx(clip_low / 11)
    assert metrics["ratio"] == pytest.approx(float((r.detach() * trained).sum()) / 11,
                                             rel=1e-5)

    # On-policy GRPO on the same batch: ratio 1, loss -sum(A) / 15, gradient -A grad lp / 15.
    lp, _ = completion_logprobs(on_policy, batch.input_ids, batch.prompt_lens,
                                batch.completion_lens, temperature=T)
    on_policy_loss = -(torch.exp(lp - lp.detach()) * A * mask).sum() / 15
    on_policy_loss.backward()
    torch.nn.utils.clip_grad_norm_(on_policy.parameters(), 1.0)
    on_policy_grads = torch.cat([p.grad.flatten() for p in on_policy.parameters()])
    assert on_policy_loss.item() == pytest.approx(-(-1.0 * 3 + 0.5 * 4 + 2.0 * 2 - 1.0 * 2) / 15)
    assert abs(metrics["loss"] - on_policy_loss.item()) > 0.1 * abs(on_policy_loss.item())
    assert float((_flat(grads) - on_policy_grads).norm()) > 0.1 * float(on_policy_grads.norm())


# ---------------------------------------------------------------------------------------------
# trainer.py: the importance correction, the optimizer step's guard, the step's bookkeeping.


def test_is_cap_weights_are_the_truncated_ratio_of_trainer_to_engine():
    """--is-cap: each token's surrogate is weighted min(pi_old / pi_engine, cap) -- the trainer's
    probability over the engine's, truncated -- never the inverse. Mutant: is-cap-inverted."""
    from trainer import engine_correction
    old = torch.tensor([[-1.0, -2.0, -0.5]])  # the trainer's log-probs
    engine = torch.tensor([[-9.0, -9.0, -9.0], [-1.5, -1.0, -0.5]])  # row 0: another sequence
    batch = make_batch([[5], [6]], [[7, 8, 9], [10, 11, 12]], [1.0, 1.0], engine_logprobs=engine)
    mask = torch.ones(1, 3, dtype=torch.bool)
    mismatch = {}
    weights = engine_correction(batch, torch.tensor([1]), old, mask, 1.5,
                                mismatch)
    # exp(0.5) = 1.649 capped at 1.5; exp(-1) = 0.368; exp(0) = 1
    assert weights[0].tolist() == pytest.approx([1.5, 0.36787944, 1.0])
    assert mismatch["logprob_max_abs_diff"] == pytest.approx(1.0)
    assert mismatch["mismatch_tokens"] == 3


def _linear_trainer(**cfg):
    """A Trainer around a 2 x 2 linear layer: enough for the optimizer step and the bookkeeping
    (no language model needed)."""
    from model import adamw_with_warmup
    from trainer import Trainer
    torch.manual_seed(0)
    layer = torch.nn.Linear(2, 2)
    optimizer, scheduler = adamw_with_warmup(layer, lr=1e-2, warmup_steps=4)
    return Trainer(layer, layer, None, None, optimizer, scheduler,
                   Config(data="arith", beta=0.0, **cfg), "cpu")


def test_a_non_finite_loss_skips_the_step_even_with_finite_gradients():
    """optimizer_step leaves the weights alone when the loss *or* the gradient is not finite. A
    NaN advantage makes both NaN; here only the loss is, so the loss check alone must skip it.
    Mutant: step-ignores-loss."""
    from trainer import optimizer_step
    trainer = _linear_trainer()
    layer = trainer.model
    before = copy.deepcopy(layer.state_dict())
    layer(torch.ones(1, 2)).sum().backward()  # finite gradients
    assert optimizer_step(trainer, float("nan")) is None
    for name, value in layer.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert trainer.scheduler.last_epoch == 0 and not trainer.optimizer.state
    assert all(p.grad is None for p in layer.parameters())  # freed all the same
    layer(torch.ones(1, 2)).sum().backward()
    # d sum(W x + b) / dW = 1 (four entries), / db = 1 (two): gradient norm sqrt(6)
    assert optimizer_step(trainer, 0.5) == pytest.approx(6 ** 0.5)
    assert trainer.scheduler.last_epoch == 1


def test_the_step_reports_the_mean_of_its_updates_and_token_weighted_metrics():
    """Two updates per rollout, both applied: the loss and gradient norm reported are their
    means; grpo_loss's metrics are weighted by each micro-batch's tokens, so that they are means
    over the batch's tokens. Update 1: micro-batches of 2 tokens (loss 0.3, clip_low 0.5) and 6
    tokens (0.1, 0.0), grad norm 2; update 2: 4 tokens (0.2, 0.25), grad norm 4.
    Loss (0.4 + 0.2) / 2 = 0.3, grad norm 3, clip_low (0.5 * 2 + 0 * 6 + 0.25 * 4) / 12 = 1/6.
    Mutants: stats-loss-not-averaged, stats-unweighted-metrics."""
    from trainer import UpdateStats
    trainer = _linear_trainer()
    batch = make_batch([[5], [6]], [[7, 8, 9], [10, 11, 12]], [1.0, -1.0])
    stats = UpdateStats(trainer, batch, torch.tensor([0, 1]))
    for loss, clip_low, mask in ((0.3, 0.5, [[1, 1, 0]]), (0.1, 0.0, [[1, 1, 1], [1, 1, 1]])):
        mask = torch.tensor(mask, dtype=torch.bool)
        stats.add(torch.tensor(loss), {"clip_low": clip_low}, torch.zeros(mask.shape), mask)
    stats.end_update(2.0)
    stats.add(torch.tensor(0.2), {"clip_low": 0.25}, torch.zeros(2, 3),
              torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool))
    stats.end_update(4.0)
    metrics = finish_metrics([stats.result()])
    assert metrics["loss"] == pytest.approx(0.3)
    assert metrics["grad_norm"] == pytest.approx(3.0)
    assert metrics["clip_low"] == pytest.approx(1 / 6)


def test_a_batch_without_signal_takes_no_optimizer_step():
    """Every advantage 0 and no KL term: nothing is trained, and nobody steps -- not Adam, and not
    the learning-rate schedule, whose warmup would otherwise advance on empty steps.
    Mutant: any-rank-trains-always."""
    trainer = _linear_trainer()
    metrics = finish_metrics([train_on_rollout(trainer, make_batch(
        PROMPTS, COMPLETIONS, [0.0] * 6))])
    assert metrics["trained_frac"] == 0.0 and metrics["loss"] == 0.0
    assert trainer.scheduler.last_epoch == 0 and not trainer.optimizer.state


def test_a_resumed_runs_reference_takes_the_policys_prompt_sharing_verdict(tiny_model_dir):
    """The KL reference must share prompts exactly when the policy does (computing_like), or
    KL(pi || ref) is rounding noise with a gradient instead of 0. In a fresh run the reference
    is a deep copy of the checked policy and inherits its verdict anyway; on --resume it is the
    initial model loaded anew, which has none: only computing_like gives it the policy's.
    Mutant: reference-shares-own-verdict."""
    from model import load_model
    from trainer import computing_like
    for verdict in (True, False):
        policy = SimpleNamespace(smolrl_shares_prompts=verdict)
        initial = load_model(tiny_model_dir)[0]  # as setup_trainer loads it on --resume
        assert not hasattr(initial, "smolrl_shares_prompts")
        ref = computing_like(initial, policy)
        assert ref.smolrl_shares_prompts is verdict and not ref.training


# ---------------------------------------------------------------------------------------------
# hardware.py: the dtype choice; model.py: a folder swap that fails half-way.


def test_choose_dtype_on_a_cpu_takes_bf16_only_by_a_clear_margin(monkeypatch):
    """--dtype auto on a CPU times both kinds of matmul: fp32 where bf16 is emulated (50 vs 1
    GFLOP/s), bf16 where it is native (338 vs 1,312), and fp32 on a tie or near it -- a loaded
    machine once read 14.2 vs 14.2 and six launches of one command chose bf16 four times.
    Mutants: dtype-slower-wins, dtype-no-margin."""
    import hardware
    monkeypatch.delenv(hardware.AUTO_DTYPE_ENV, raising=False)
    for fp32, bf16, expected in ((50.0, 1.0, "fp32"), (337.8, 1311.6, "bf16"),
                                 (14.2, 14.2, "fp32"), (14.2, 15.5, "fp32"), (50.0, 70.0, "fp32"),
                                 (50.0, 75.0, "bf16")):
        rates = {torch.float32: fp32, torch.bfloat16: bf16}
        monkeypatch.setattr(hardware, "matmul_rate", lambda dtype, rates=rates: rates[dtype])
        choice = hardware.cpu_dtype.__wrapped__()  # (uncached)
        assert choice.name == expected, choice.reason
        assert f"matmul bf16 {bf16:.1f} vs fp32 {fp32:.1f} GFLOP/s; bf16 only if >= 1.5x" in \
            choice.reason


def test_a_resumed_run_computes_in_the_dtype_it_recorded(tmp_path, monkeypatch):
    """A resumed run with --dtype auto takes its checkpoint's recorded dtype, untimed and said
    so; an explicit --dtype wins; a fresh run chooses anew (here: the environment's pin)."""
    import json
    import grpo
    import hardware
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "grpo_config.json").write_text(json.dumps({"dtype": "bf16"}))
    (step / "driver_state.pt").write_bytes(b"")  # (what marks a checkpoint folder)
    monkeypatch.setenv(hardware.AUTO_DTYPE_ENV, "fp32")
    monkeypatch.setattr(hardware, "matmul_rate", lambda dtype: pytest.fail("timed again"))
    for resume in ("auto", str(step)):
        cfg = grpo.Config(data="arith", out=str(tmp_path), resume=resume)
        assert (cfg.dtype, cfg.dtype_reason) == ("bf16", "as the resumed run recorded it: not "
                                                         "timed again")
    assert grpo.Config(data="arith", out=str(tmp_path), resume="auto", dtype="fp32").dtype == "fp32"
    assert grpo.Config(data="arith", out=str(tmp_path / "fresh")).dtype == "fp32"


def test_a_resumed_run_decodes_as_it_recorded(tmp_path, monkeypatch):
    """How the HF engine decoded (flash, grow or concat: a bf16 run's samples depend on it) is in
    the run's config; a resumed run's engines decode so, untimed and said so -- unless
    SMOLRL_DECODE pins another; a fresh run chooses anew. (The recording: test_faults.py.)"""
    import json
    import attention
    import grpo
    import hardware
    from transformers import LlamaConfig
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "grpo_config.json").write_text(json.dumps({"dtype": "bf16", "decoding": "concat"}))
    (step / "driver_state.pt").write_bytes(b"")  # (what marks a checkpoint folder)
    assert grpo.Config(data="arith", out=str(tmp_path / "fresh")).decoding == ""
    for resume in ("auto", str(step)):
        assert grpo.Config(data="arith", out=str(tmp_path), resume=resume).decoding == "concat"
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.delenv(hardware.DECODE_ENV, raising=False)
    monkeypatch.setattr(attention, "decode_times", lambda *a: pytest.fail("timed again"))
    choice = attention.choose_decode(config, torch.bfloat16, "cpu", recorded="concat")
    assert (choice.flash, choice.grows, choice.mode) == (False, False, "concat")
    assert "as the run chose: concat" in choice.line
    monkeypatch.setenv(hardware.DECODE_ENV, "flash")  # the environment's pin wins
    choice = attention.choose_decode(config, torch.bfloat16, "cpu", recorded="concat")
    assert (choice.flash, choice.mode) == (True, "flash") and "SMOLRL_DECODE=flash" in choice.line
    monkeypatch.delenv(hardware.DECODE_ENV)  # a record that is none of the three: timed, said
    monkeypatch.setattr(attention, "decode_times", lambda *a: attention.DecodeTimes(1.0, 2.0, 3.0))
    choice = attention.choose_decode(config, torch.bfloat16, "cpu", recorded="banana")
    assert choice.mode == "flash" and choice.line.endswith(
        "3 us; the run's config records 'banana', none of flash, grow, concat)")


def test_a_leg_without_an_engine_keeps_the_runs_recorded_decoding(tmp_path):
    """A resumed leg that builds no HF engine (SFT resumed with --eval-every 0) writes the
    decoding the run recorded into its config, for a later leg's engine to decode alike; an
    engine's own mode wins, and a record that is none of the three is not carried on."""
    import json
    import grpo
    from session import open_run, resume_driver, start_log
    from stopping import release_stop_signals
    for recorded, engine, written in (("grow", "", "grow"), ("grow", "flash", "flash"),
                                      ("banana", "", None), ("", "", None)):
        out = tmp_path / f"{recorded}-{engine}"
        cfg = grpo.Config(out=str(out), data="arith", model="unused")
        cfg.decoding = recorded  # (as options.settle reads it back on --resume)
        folder = open_run(cfg)
        resume_driver(folder)
        start_log(folder, cfg, None, engine)
        release_stop_signals()  # (start_log catches them, for the run's loop)
        assert json.loads((out / "grpo_config.json").read_text()).get("decoding") == written


def test_a_folder_swap_that_fails_halfway_leaves_the_old_folder_whole(tmp_path, monkeypatch):
    """replace_folder renames the old folder aside before the new one takes its place, and
    deletes it last: if the second rename fails (a full disk, a kill), the old folder still
    exists whole. Mutant: replace-deletes-first."""
    import model as model_module
    target, new = tmp_path / "model", tmp_path / "new"
    for folder, text in ((target, "old"), (new, "new")):
        folder.mkdir()
        (folder / "weights.txt").write_text(text)
    rename = os.replace

    def failing(src, dst):
        if Path(src) == new:
            raise OSError("no space left on device")
        return rename(src, dst)

    monkeypatch.setattr(model_module.os, "replace", failing)
    with pytest.raises(OSError):
        model_module.replace_folder(new, target)
    monkeypatch.undo()
    assert sorted(p.read_text() for p in tmp_path.rglob("weights.txt")) == ["new", "old"]


# ---------------------------------------------------------------------------------------------
# rollout.py: top-p's boundary, seeds per prompt, decoding with a shared prefix.


def test_top_p_stops_at_the_first_token_that_reaches_it():
    """Four equally likely tokens (exactly 0.25 each) and top_p = 0.5: the two likeliest already
    hold 0.5, so the nucleus is those two -- not three. Mutant: top-p-inclusive."""
    from sampling import Sampling, sample_next
    torch.manual_seed(0)
    tokens = sample_next(torch.zeros(4000, 4), Sampling(temperature=1.0, top_p=0.5))
    assert len(set(tokens.tolist())) == 2


def test_request_seeds_differ_per_prompt_and_fit_31_bits():
    """Every prompt of a seeded call gets its own random stream (vLLM seeds sample k of a request
    with seed + k, so equal or neighbouring seeds would share draws), the same on every call, and
    below 2**31. Mutants: seed-ignores-index, seed-32-bits."""
    from sampling import request_seed
    seeds = [request_seed(7, i) for i in range(1000)]
    assert len(set(seeds)) == 1000
    assert all(0 <= s < 2**31 for s in seeds)
    assert seeds[:3] == [request_seed(7, i) for i in range(3)]
    assert request_seed(8, 0) != seeds[0]


def _greedy_alone(model, prompt, steps):
    """Argmax continuation of one prompt in its own batch, with the model's own full forward."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_prompts_sharing_a_prefix_decode_as_if_alone(tiny_model):
    """The HF engine runs the tokens every prompt starts with once and copies their cache to each
    prompt (_decode): each prompt's own tokens must then attend to the prefix, at positions that
    continue from it, and every prompt keeps at least its last token for its next-token logits --
    here the 12-token `base` is itself one of the prompts, so the prefix is its first 11 tokens.
    Each greedy completion must be the one the model gives the prompt alone. Mutants:
    prefix-whole-prompt, prefix-positions-restart, prefix-not-attended."""
    from rollout import MIN_SHARED_PREFIX, HFRollout, shared_prefix
    from sampling import Sampling
    model, tok = tiny_model
    model = copy.deepcopy(model)
    with torch.no_grad():  # sharp attention, so that positions and context change the argmax
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    model.smolrl_shares_prompts = True  # (what check_head_logits finds for Llama)
    base = list(range(100, 112))
    prompts = [base, base + [201, 202, 203], base + [300]]
    assert shared_prefix(prompts) == base[:11] and len(base[:11]) >= MIN_SHARED_PREFIX
    assert shared_prefix([[1, 2, 3], [1, 2, 3]]) == [1, 2] and shared_prefix([base]) == []
    engine = HFRollout(model, tok, dtype=torch.float32)
    assert engine.share_prefix
    engine.stop_ids = {-1}  # no stops: every sample decodes to the limit
    out = engine.generate(prompts, 2, Sampling(max_new_tokens=6, temperature=0.0))
    expected = [_greedy_alone(model, p, 6) for p in prompts]
    assert out.completion_ids == [e for e in expected for _ in range(2)]


def test_engine_logprobs_cover_exactly_each_completions_tokens(tiny_model):
    """Completions.engine_logprobs holds one log-prob per completion token: a sample that stops
    early has as many as its tokens, not max_new_tokens (an episode appends them turn after turn
    beside the ids: one too many and every later turn is misaligned), and each is the trainer's
    own log-prob of that token at the sampling temperature. A quarter of the vocabulary stops a
    sample here, so lengths vary. (conftest's check_an_episode_on samples greedily, and the HF
    engine returns no log-probs for greedy decoding.) Mutant: engine-logprobs-uncut."""
    from logprobs import pack
    from rollout import HFRollout
    from sampling import Sampling
    model, tok = tiny_model
    engine = HFRollout(model, tok, dtype=torch.float32, logprobs=True)
    engine.stop_ids = set(range(0, model.config.vocab_size, 4))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    out = engine.generate(prompts, 3, Sampling(max_new_tokens=6, temperature=0.7, seed=0))
    lengths = [len(ids) for ids in out.completion_ids]
    assert min(lengths) < 6 and any(out.truncated)  # some stopped early, some ran to the limit
    assert [len(lps) for lps in out.engine_logprobs] == lengths
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, *pack(out.prompt_ids, out.completion_ids, 0),
                                         temperature=0.7)
    for row, lps in enumerate(out.engine_logprobs):
        assert lps == pytest.approx(trainer[row, :len(lps)].tolist(), abs=1e-4)


# ---------------------------------------------------------------------------------------------
# checkpoint.py: which checkpoint --resume auto takes, and whose checkpoints are whose.


def _checkpoints(out, steps, run_id):
    """save_checkpoint with a stand-in for the trainer's half (no model needed)."""
    from checkpoint import DriverState, save_checkpoint
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    for step in steps:
        save_checkpoint(out, DriverState(step, consumed=2 * step, run_id=run_id),
                        lambda folder: torch.save({"optimizer": {}, "scheduler": {},
                                                   "torch_rng": torch.get_rng_state()},
                                                  Path(folder) / "trainer_state.pt"), 0)
    return out / "checkpoints"


def test_resume_auto_takes_the_highest_step_not_the_last_name(tmp_path):
    """step_10 is newer than step_9, though "step_9" sorts after "step_10".
    Mutant: newest-by-name."""
    from checkpoint import find_checkpoint
    _checkpoints(tmp_path, [9, 10], "run")
    assert Path(find_checkpoint(tmp_path, "auto")).name == "step_10"


def test_a_run_keeps_its_id_across_resumes_and_runs_get_their_own(tmp_path):
    """--keep-last prunes this run's checkpoints only, by run id: a resumed run must carry the
    id on (or it would never prune the checkpoints it wrote before), and two runs -- even in one
    process -- must not share one. Mutants: run-id-shared-default, resume-new-run-id."""
    from checkpoint import DriverState, load_driver_state
    assert DriverState().run_id != DriverState().run_id
    folder = _checkpoints(tmp_path, [3], "abc123")
    assert load_driver_state(folder / "step_3").run_id == "abc123"


# ---------------------------------------------------------------------------------------------
# dpo.py: IPO's length-averaged log-probs, everywhere they are used; which prompt tokens go.


def _pairs():
    from dpo import Pair
    return [Pair([5, 6], [7, 8, 9], [10, 11]), Pair([12], [13], [14, 15, 16, 17])]


def test_ipo_averages_each_response_over_its_own_length(tiny_model):
    """IPO takes log-probs averaged over each response's own tokens (3, 1 chosen; 2, 4
    rejected), not over the longest response of the micro-batch (4). Mutant: ipo-average-by-T."""
    from dpo import Config as DPOConfig, pair_logps
    model, _ = tiny_model
    cfg = DPOConfig(dtype="fp32")
    with torch.no_grad():
        chosen, rejected = pair_logps(model, _pairs(), cfg, "cpu")
        chosen_avg, rejected_avg = pair_logps(model, _pairs(), cfg, "cpu", average=True)
    torch.testing.assert_close(chosen_avg, chosen / torch.tensor([3.0, 1.0]))
    torch.testing.assert_close(rejected_avg, rejected / torch.tensor([2.0, 4.0]))


def test_ipo_references_and_sft_term_are_length_averaged_too(tiny_model):
    """With --loss-type ipo the cached reference log-probs are averaged like the policy's (else
    h compares an average with a sum), and the SFT term's per-token NLL is the averaged chosen
    log-prob itself (dividing it by the length again would shrink it). By hand:
    loss = sum_i (h_i - 1 / (2 beta))^2 / 2 + w * sum_i -pc_i / 2 with the averages pc, pr.
    Mutants: ipo-reference-summed, ipo-sft-divided-twice."""
    from dpo import Config as DPOConfig, batch_loss, pair_logps, reference_logps
    model, _ = tiny_model
    cfg = DPOConfig(dtype="fp32", loss_type="ipo", sft_weight=0.5, beta=0.1, micro_batch_size=1)
    with torch.no_grad():
        pc, pr = pair_logps(model, _pairs(), cfg, "cpu", average=True)
        refs = reference_logps(model, _pairs(), cfg, "cpu")
        assert [x for pair in refs for x in pair] == pytest.approx(
            [x for pair in zip(pc.tolist(), pr.tolist()) for x in pair], rel=1e-6)
        shifted = [(c - 1.0, r + 0.5) for c, r in refs]  # a reference that differs: h = 1.5
        loss, _ = batch_loss(model, _pairs(), shifted, cfg, "cpu", num_pairs=2)
    expected = 2 * (1.5 - 1 / (2 * 0.1)) ** 2 / 2 + 0.5 * float(-pc.sum()) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_an_over_long_pair_loses_the_start_of_its_prompt(tokenizer):
    """Pairs too long for --max-length keep the *end* of the prompt (its last
    --max-prompt-length tokens: the question and the assistant turn's opening), not its start.
    Mutant: prompt-keeps-start."""
    from dpo import Config as DPOConfig
    from pairs import _chat_ids, tokenize_pairs
    prompt = "a question " * 20
    rows = [{"prompt": prompt, "chosen": "long answer " * 30, "rejected": "no"}]
    (pair,), _ = tokenize_pairs(tokenizer, rows, "prefs.jsonl", DPOConfig(
        dtype="fp32", max_length=128, max_prompt_length=16))
    full = _chat_ids(tokenizer, [{"role": "user", "content": prompt}], True)
    assert len(full) > 16 and pair.prompt == full[-16:]


# ---------------------------------------------------------------------------------------------
# DAPO: dynamic sampling's group selection, the overlong penalty and filter.


def _round(rewards, first_id):
    """A scored round of groups of 2; completion ids number the samples from first_id."""
    from rl import Scored
    from sampling import Completions
    n = len(rewards)
    comps = Completions([[1]] * n, [[first_id + i] for i in range(n)], [False] * n, [""] * n)
    return Scored([{"problem": "p"}] * n, comps, torch.tensor(rewards), [0.0] * n, {})


def test_dynamic_sampling_keeps_the_first_groups_with_signal_and_counts_the_rest():
    """Round A: groups (1, 1), (0, 1), (0, 0); round B: (0, 1), (1, 0), (1, 1), (0, 0). Only
    groups whose rewards differ have signal -- A's second, B's first and second -- and only the
    first two of them are kept (N = 2); the four whose rewards are all equal are counted as
    dropped. Mutants: signal-always, signal-over-limit, dropped-counts-kept."""
    from grpo import groups_with_signal, has_signal
    a = _round([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], 0)
    b = _round([0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0], 10)
    assert has_signal(a.rewards, 2).tolist() == [False, True, False]
    assert has_signal(b.rewards, 2).tolist() == [True, True, False, False]
    kept, dropped, taken = groups_with_signal([a, b], G=2, limit=2)
    assert kept.completions.completion_ids == [[2], [3], [10], [11]]
    assert kept.rewards.tolist() == [0.0, 1.0, 0.0, 1.0] and dropped == 4
    # (which samples of the rounds those are: the rollout log's `kept`)
    assert taken == [False, False, True, True, False, False] + [True] * 2 + [False] * 6


def test_dynamic_sampling_keeps_groups_of_rows_without_answers():
    """A bug this pass found (it crashed). Scored.correct is [] when no row has an answer (score():
    correctness is measured only against answers) -- the built-in guess task, or a prompts-only
    file scored by a custom reward. Dynamic sampling's selection must still keep the group with
    signal."""
    from grpo import groups_with_signal
    scored = _round([0.0, 1.0, 1.0, 1.0], 0)
    scored.correct = []  # as score() leaves it for rows without an answer
    kept, dropped, _ = groups_with_signal([scored], G=2, limit=2)
    assert kept.completions.completion_ids == [[0], [1]] and dropped == 1
    assert kept.correct == []


def test_the_overlong_penalty_is_added_to_the_reward():
    """--overlong-buffer 2 with --max-new-tokens 4: lengths 2, 3, 4, 4 get 0, -0.5, -1, -1 added
    to their reward (0.5 each here). Mutant: penalty-subtracted."""
    from rl import Started, score
    from sampling import Completions, Ready
    cfg = Config(data="arith", num_generations=2, max_new_tokens=4, overlong_buffer=2)
    comps = Completions([[1]] * 4, [[5, 6], [5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]],
                        [False, False, False, True], [""] * 4)
    scored = score(Started([{"problem": "p"}, {"problem": "q"}], Ready(comps)), cfg,
                   lambda prompts, completions, completion_ids, rows: ([0.5] * 4, {}), None,
                   cfg.overlong_buffer)
    assert scored.rewards.tolist() == [0.5, 0.0, -0.5, -0.5]


def test_overlong_filtering_takes_truncated_samples_out_of_the_loss_and_its_count():
    """--overlong-filter: a truncated sample (the second) is out of the loss, and out of the
    token-mean's denominator: 2 + 3 + 4 = 9 tokens, not 13. The fourth hit the limit with its
    stop token: not truncated, trained. Mutants: filter-inverted, denom-counts-filtered."""
    from rl import train_batch
    from sampling import Completions
    cfg = Config(data="arith", max_new_tokens=4, overlong_filter=True)
    comps = Completions([[1]] * 4, [[5, 2], [5, 6, 7, 8], [5, 6, 2], [5, 6, 7, 2]],
                        [False, True, False, False], [""] * 4)
    batch = train_batch(comps, torch.tensor([1.0, -1.0, 0.5, -0.5]), cfg, pad_id=2,
                        overlong_filter=cfg.overlong_filter)
    assert batch.in_loss.tolist() == [True, False, True, True]
    assert batch.denom == 9.0


# ---------------------------------------------------------------------------------------------
# env.py: the turn loop's limits, seeds and bookkeeping.


class _Scripted:
    """An engine whose turn t is the text turns[t] and the stop token; records each call's seed.
    With logprobs, it reports -(t + 1) / 10 as the log-prob of every token of turn t."""

    def __init__(self, tokenizer, turns, logprobs=False):
        self.tokenizer, self.turns, self.seeds, self.logprobs = tokenizer, turns, [], logprobs

    def ids(self, t):
        return self.tokenizer(self.turns[t], add_special_tokens=False)["input_ids"] + \
            [self.tokenizer.eos_token_id]

    def generate(self, prompt_ids, n, sampling):
        from sampling import Completions
        t = len(self.seeds)
        ids = self.ids(t)[:sampling.max_new_tokens]
        cut = len(self.ids(t)) > sampling.max_new_tokens
        self.seeds.append(sampling.seed)
        k = len(prompt_ids)
        logprobs = [[-(t + 1) / 10] * len(ids)] * k if self.logprobs else None
        return Completions(prompt_ids, [ids] * k, [cut] * k, [""] * k, logprobs, 0, 0.01)


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


def _agent(tokenizer, max_turns, max_tokens):
    from env import Agent, ToolChat, load_tools
    return Agent(ToolChat(tokenizer, load_tools("calculator")), "{problem}", max_turns, max_tokens)


def test_each_turn_draws_with_its_own_seed_and_a_good_call_is_no_error(tokenizer):
    """Turn t of a seeded episode samples with request_seed(seed, t): a fresh stream per turn.
    A call that succeeds is counted as a call, not as an error. Mutants: turn-seed-repeated,
    tool-errors-count-calls."""
    from sampling import Sampling, request_seed
    engine = _Scripted(tokenizer, [CALL, "The answer is 5."])
    _, (episode,) = _agent(tokenizer, 4, 1024).run(engine, [{"problem": "2 + 3?"}], 1,
                                                   Sampling(64, 1.0, seed=5))
    assert engine.seeds == [request_seed(5, 0), request_seed(5, 1)]
    assert (episode.turns, episode.tool_calls, episode.tool_errors) == (2, 1, 0)
    assert episode.messages[1] == {"role": "tool", "name": "calculator", "content": "5"}


def test_an_episodes_engine_logprobs_line_up_with_its_ids(tokenizer):
    """An episode's engine log-probs are the engine's for the model's tokens and 0 for the tool
    result's, one per id: the trainer reads them position by position beside the mask.
    Mutant: observation-logprobs-missing."""
    from sampling import Sampling
    engine = _Scripted(tokenizer, [CALL, "It is 5."], logprobs=True)
    comps, (episode,) = _agent(tokenizer, 4, 1024).run(engine, [{"problem": "2 + 3?"}], 1,
                                                       Sampling(64, 1.0))
    first, second = engine.ids(0), engine.ids(1)
    observation = len(episode.ids) - len(first) - len(second)
    assert observation > 0 and episode.ids[-len(second):] == second
    assert comps.engine_logprobs == [[-0.1] * len(first) + [0.0] * observation +
                                     [-0.2] * len(second)]


def test_a_call_on_the_last_turn_truncates_the_episode_and_an_answer_does_not(tokenizer):
    """--max-turns 1 and the model calls a tool: no room to read the result, so the tool is not
    run and the episode is truncated. --max-turns 2, a call then an answer on the last turn: done,
    not truncated. Mutants: last-turn-never, last-turn-always-truncates."""
    from sampling import Sampling
    _, (episode,) = _agent(tokenizer, 1, 1024).run(_Scripted(tokenizer, [CALL]),
                                                   [{"problem": "2 + 3?"}], 1, Sampling(64, 1.0))
    assert episode.truncated and episode.tool_calls == 0
    assert [m["role"] for m in episode.messages] == ["assistant"]
    _, (episode,) = _agent(tokenizer, 2, 1024).run(_Scripted(tokenizer, [CALL, "It is 5."]),
                                                   [{"problem": "2 + 3?"}], 1, Sampling(64, 1.0))
    assert episode.done and not episode.truncated and episode.answer == "It is 5."


def test_an_episode_never_exceeds_its_token_budget(tokenizer):
    """--max-episode-tokens counts every token after the prompt. When turn 1 and its tool result
    fill the budget exactly, no turn can follow: the episode ends, truncated, without the
    result's tokens; one token more of budget and it goes on. Mutant: budget-off-by-one."""
    from sampling import Sampling
    engine = _Scripted(tokenizer, [CALL, "It is 5."])
    first = engine.ids(0)
    observation = _agent(tokenizer, 4, 1).chat.observation_ids([("calculator", "5")])
    budget = len(first) + len(observation)
    _, (episode,) = _agent(tokenizer, 4, budget).run(engine, [{"problem": "2 + 3?"}], 1,
                                                     Sampling(64, 1.0))
    assert episode.truncated and episode.ids == first and episode.mask == [True] * len(first)
    engine = _Scripted(tokenizer, [CALL, "It is 5."])
    _, (episode,) = _agent(tokenizer, 4, budget + 1).run(engine, [{"problem": "2 + 3?"}], 1,
                                                         Sampling(64, 1.0))
    assert episode.ids[:budget] == first + observation and len(episode.ids) == budget + 1


def test_tool_arguments_that_are_not_an_object_are_named_as_such(tokenizer):
    """Some models write a call's arguments as a JSON *string*; the model is told to send an
    object rather than handed Python's TypeError. Mutant: arguments-unchecked."""
    from env import Episode, call_tool
    chat = _agent(tokenizer, 1, 64).chat
    episode = Episode({}, None, [], [])
    call = {"function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}
    assert call_tool(chat, episode, call) == ("calculator",
                                              "error: the arguments must be a JSON object")

"""train_on_rollout: what it skips changes nothing (zero advantages, overlong-filtered samples),
micro-batching changes nothing, the KL starts at 0, the engine mismatch covers every sampled token,
a non-finite step never touches the weights, and a lone trainer issues no collective; and
benchmarks/update_profile.py --by-op, which times one, counts its matmuls as torch does, and
benchmarks/phases.py draws a run's update seconds against its tokens."""

import copy
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor import config as inductor_config

from conftest import rl_trainer, REL_TOL, assert_close_to_scale, make_batch, record_grads
from conftest import run_script
from grpo import Config, grpo_loss, train_on_rollout
import logprobs as logprobs_module
from logprobs import completion_logprobs, length_mask
from trainer import finish_metrics

PROMPTS = [[5, 6], [7, 8, 9], [10], [11, 12], [13, 14, 15], [16]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23, 24, 25, 26], [27, 2], [28, 29], [30, 31, 32, 2]]
ADVANTAGES = [1.0, 0.0, -0.5, 0.0, 2.0, -1.0]  # positive, zero and negative


def _trainer(model_dir, **kw):
    return rl_trainer(Config(data="arith", model=model_dir, dtype="fp32", lr=1e-3,
                                micro_batch_size=2, **kw))


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_skipping_zero_advantage_sequences_changes_neither_loss_nor_gradient(tiny_model_dir):
    """With beta = 0 only sequences with a non-zero advantage (positive or negative) go through
    forward/backward; the result must equal the loss over the whole batch."""
    trainer = _trainer(tiny_model_dir, beta=0.0)
    reference = copy.deepcopy(trainer.model)
    batch = make_batch(PROMPTS, COMPLETIONS, ADVANTAGES)
    grads = record_grads(trainer)
    metrics = finish_metrics([train_on_rollout(trainer, batch)])
    assert metrics["trained_frac"] == pytest.approx(4 / 6)

    lp, _ = completion_logprobs(reference, batch.input_ids, batch.prompt_lens,
                                batch.completion_lens, temperature=trainer.cfg.temperature)
    mask = length_mask(batch.completion_lens, lp.shape[1])
    loss, _ = grpo_loss(lp, lp.detach(), None, batch.advantages, mask, num_tokens=batch.denom)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert metrics["loss"] == pytest.approx(loss.item(), rel=REL_TOL[torch.float32], abs=1e-9)
    assert_close_to_scale(_flat(grads), _grads(reference), what="gradients")


SHARED = [[5, 6, 7, 8]] * 3 + [[9, 10, 11]] * 3  # two groups of three samples: share_prompts runs


def test_kl_is_zero_before_the_first_update(tiny_model_dir, monkeypatch):
    """Policy and reference take every numerical decision together -- the dtype (the bf16 copy),
    and whether a group's prompt is shared (share_prompts): the policy's verdict, made once in
    fp32. A check of the reference's own, in bf16, could refuse it (SmolLM2-135M: 0.139 nats apart
    in bf16, 1e-5 in fp32), as the patched check below does: the KL must still be exactly 0."""
    check = logprobs_module._sharing_changes_nothing
    monkeypatch.setattr(logprobs_module, "_sharing_changes_nothing", lambda model, ids, atol: (
        check(model, ids, atol) and next(model.parameters()).dtype == torch.float32))
    trainer = rl_trainer(Config(data="arith", model=tiny_model_dir, dtype="bf16", beta=0.04,
                                   lr=1e-3))
    assert trainer.compute.smolrl_shares_prompts and trainer.ref_model.smolrl_shares_prompts
    assert next(trainer.ref_model.parameters()).dtype == torch.bfloat16
    batch = make_batch(SHARED, COMPLETIONS, [0.0] * 6)
    assert logprobs_module.share_prompts(trainer.compute, batch.input_ids, batch.prompt_lens,
                                      batch.completion_lens) is not None
    metrics = finish_metrics([train_on_rollout(trainer, batch)])
    assert metrics["kl"] == 0.0
    assert metrics["grad_norm"] == 0.0  # no spurious KL gradient


def test_engine_mismatch_covers_every_sampled_token(tiny_model_dir):
    """The mismatch metrics describe the engine: the same rollout gives the same figures whether
    or not the trainer skips zero-advantage sequences (beta = 0 or not)."""
    batch = make_batch(PROMPTS, COMPLETIONS, ADVANTAGES)
    model = _trainer(tiny_model_dir, beta=0.0).model
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch.input_ids, batch.prompt_lens,
                                    batch.completion_lens, temperature=Config().temperature)
    mask = length_mask(batch.completion_lens, lp.shape[1])
    offsets = torch.tensor([0.0, 0.3, 0.0, 0.3, 0.0, 0.0])[:, None]  # off where advantage is 0
    batch.engine_logprobs = (lp - offsets) * mask
    expected = float((torch.exp(offsets.expand_as(lp)) * mask).sum() / mask.sum())
    for beta in (0.0, 0.01):
        metrics = finish_metrics([train_on_rollout(_trainer(tiny_model_dir, beta=beta), batch)])
        assert metrics["token_mult_prob_error"] == pytest.approx(expected, rel=1e-5), beta
        assert metrics["logprob_max_abs_diff"] == pytest.approx(0.3, rel=1e-4), beta


def test_a_non_finite_step_leaves_the_weights_alone(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, beta=0.0)
    before = copy.deepcopy(trainer.model.state_dict())
    metrics = finish_metrics([train_on_rollout(trainer, make_batch(
        PROMPTS, COMPLETIONS, [1.0, float("nan"), -1.0, 0.5, 0.0, 0.0]))])
    assert metrics["skipped_updates"] == 1
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not trainer.optimizer.state  # Adam never stepped
    assert trainer.scheduler.last_epoch == 0


def test_a_run_stops_after_three_non_finite_steps_in_a_row(tiny_model_dir, tmp_path,
                                                            monkeypatch):
    """python grpo.py whose step 1 is fine and every later step's advantages NaN: each later
    update is skipped, and the third in a row stops the run in one line. (In this process, as
    __main__: conftest.run_script; grpo.py's main block runs the imported grpo, patched here.)"""
    import grpo
    real, calls = grpo.group_advantages, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        adv = real(*args, **kwargs)
        return adv if len(calls) == 1 else adv * float("nan")

    monkeypatch.setattr(grpo, "group_advantages", poisoned)
    result = run_script("grpo.py", [
        "--model", tiny_model_dir, "--data", "arith", "--steps", "8",
        "--prompts-per-step", "2", "--num-generations", "4", "--max-new-tokens", "6",
        "--beta", "0.01", "--eval-every", "0", "--save-every", "1", "--keep-last", "0",
        "--out", str(tmp_path)])
    assert result.returncode != 0
    assert "error: 3 steps in a row had a non-finite loss or gradient" in result.stderr
    assert "update skipped" in result.stdout
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_1"]  # nothing is saved from a skipped step
    assert not (tmp_path / "model").exists()  # nor a final model


def test_one_trainer_issues_no_collective_even_inside_a_process_group(tiny_model_dir,
                                                                      monkeypatch):
    """vLLM's in-process engine initialises a one-rank default group in the trainer's process
    (NCCL on a GPU, where a CPU tensor in a collective fails): a lone trainer must not use it."""
    import torch.distributed as dist
    calls = []
    # An engine started earlier in this worker (test_vllm.py) may have left its group: use it.
    made_here = not dist.is_initialized()
    if made_here:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
            monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name))
        trainer = _trainer(tiny_model_dir, beta=0.0)
        finish_metrics([train_on_rollout(trainer, make_batch(PROMPTS, COMPLETIONS, ADVANTAGES))])
    finally:
        monkeypatch.undo()
        if made_here:
            dist.destroy_process_group()
    assert calls == []


def _tiny_trainer(model_dir, **kw):
    return rl_trainer(Config(data="arith", model=model_dir, dtype="fp32", beta=0.0, lr=1e-3, **kw))


def _flat(recorded):
    return torch.cat([g.flatten() for g in recorded.values()])


def test_overlong_filtered_sample_has_zero_weight(tiny_model_dir):
    prompts = [[5, 6], [7, 8, 9], [10]]
    completions = [[11, 12, 2], [13, 14, 15, 16], [17, 2]]
    adv = torch.tensor([1.0, -2.0, 0.5])
    in_loss = torch.tensor([True, False, True])  # sample 1 was truncated: out of the loss
    a = _tiny_trainer(tiny_model_dir)
    grads_a = record_grads(a)
    ra = finish_metrics([train_on_rollout(a, make_batch(prompts, completions, adv,
                                                        in_loss=in_loss))])
    keep = [0, 2]  # the same batch without sample 1 at all
    b = _tiny_trainer(tiny_model_dir)
    grads_b = record_grads(b)
    rb = finish_metrics([train_on_rollout(b, make_batch([prompts[i] for i in keep],
                                                        [completions[i] for i in keep],
                                                        adv[keep]))])
    assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
    assert_close_to_scale(_flat(grads_a), _flat(grads_b), what="gradients")
    assert ra["trained_frac"] == pytest.approx(2 / 3)


def test_token_budget_micro_batches_leave_loss_and_gradient_unchanged(tiny_model_dir):
    prompts = [[5, 6], [7, 8, 9, 10, 11], [12], [13, 14, 15], [16, 17]]
    completions = [[20, 21, 2], [22, 2], [23, 24, 25, 26, 27, 28], [29], [30, 31, 2]]
    batch = make_batch(prompts, completions, [1.0, -1.0, 0.5, 2.0, -0.3])
    results = []
    for kw in (dict(micro_batch_size=16), dict(max_tokens_per_microbatch=9),
               dict(max_tokens_per_microbatch=16, gradient_checkpointing=True)):
        trainer = _tiny_trainer(tiny_model_dir, **kw)
        grads = record_grads(trainer)
        metrics = finish_metrics([train_on_rollout(trainer, batch)])
        results.append((metrics["loss"], _flat(grads)))
    for loss, grads in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5)
        assert_close_to_scale(grads, results[0][1], what="gradients")


def test_bf16_copy_sums_micro_batches_in_fp32_and_takes_the_new_master_weights(tiny_model_dir):
    """With bf16 (the default) forward and backward run on a bf16 copy: every micro-batch's
    gradient reaches the fp32 master gradient, which matches autocast over fp32 weights up to bf16
    rounding; after the step the copy holds exactly the new master weights, rounded to bf16."""
    batch = make_batch(PROMPTS, COMPLETIONS, ADVANTAGES)
    grads = {}
    for mode, micro_batch in (("copy", 1), ("copy", 16), ("autocast", 16)):
        trainer = rl_trainer(Config(data="arith", model=tiny_model_dir, dtype="bf16", beta=0.0,
                                       lr=1e-3, micro_batch_size=micro_batch))
        assert next(trainer.model.parameters()).dtype == torch.float32
        if mode == "autocast":
            trainer.compute = trainer.model
        else:
            assert next(trainer.compute.parameters()).dtype == torch.bfloat16
        recorded = record_grads(trainer)
        train_on_rollout(trainer, batch)
        grads[mode, micro_batch] = _flat(recorded)
        for master, p in zip(trainer.model.parameters(), trainer.compute.parameters()):
            assert torch.equal(p, master.to(p.dtype))
            assert p.grad is None and master.grad is None
    one = grads["copy", 16]
    for other in (grads["copy", 1], grads["autocast", 16]):  # 4 micro-batches; autocast
        assert float((other - one).norm() / one.norm()) < 0.02  # measured: 0.002, 0.007


def test_a_frozen_parameter_has_no_master_gradient_in_the_bf16_copy(tiny_model_dir):
    """(found by review) trainer.bf16_copy hooked every parameter's bf16 copy, and torch takes no
    hook on a tensor that needs no gradient: a model with a frozen parameter stopped there. Now
    the frozen one is left alone (no hook, no buffer) and the others train."""
    from trainer import bf16_copy
    from model import load_model
    model = load_model(tiny_model_dir)[0]
    frozen = model.get_input_embeddings().weight
    frozen.requires_grad_(False)
    compute = bf16_copy(model)
    compute(input_ids=torch.tensor([[5, 6, 7]])).logits.float().sum().backward()
    assert frozen.grad is None
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_master_gradients_land_in_buffers_kept_from_step_to_step_on_a_cpu(tiny_model_dir,
                                                                          monkeypatch):
    """On a CPU the bf16 copy's gradients go into fp32 buffers made once (trainer.bf16_copy): a
    step's gradients are where the last step's were, though that step's are still referenced
    here -- fresh ones could not be. On a GPU (the device pretended) each step's are made afresh
    and freed after it. The gradients are the same bit for bit either way, over micro-batches
    that add up."""
    import trainer as trainer_module
    batch = make_batch(PROMPTS, COMPLETIONS, ADVANTAGES)
    values = {}
    for gpu in (False, True):
        monkeypatch.setattr(trainer_module, "on_cuda", lambda device: gpu)
        trainer = rl_trainer(Config(data="arith", model=tiny_model_dir, dtype="bf16", beta=0.0,
                                    lr=1e-3, micro_batch_size=2))
        steps = []  # each step's gradients as the optimizer saw them: the tensors themselves
        trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: steps.append(
            [(p.grad, p.grad.clone()) for p in trainer.model.parameters()]))
        for _ in range(2):
            train_on_rollout(trainer, batch)
            assert all(p.grad is None for p in trainer.model.parameters())  # set to None
        same_place = [first.data_ptr() == second.data_ptr()
                      for (first, _), (second, _) in zip(*steps)]
        assert all(same_place) if not gpu else not any(same_place)
        values[gpu] = [[copy for _, copy in step] for step in steps]
    for cpu_step, gpu_step in zip(values[False], values[True]):
        assert all(torch.equal(a, b) for a, b in zip(cpu_step, gpu_step))


@pytest.mark.skipif(not shutil.which(inductor_config.cpp.cxx[-1]), reason="no C++ compiler")
def test_compiled_layers_train_as_the_eager_ones_do(tiny_model_dir, capsys):
    """--compile: the compute copy's decoder layers run through torch.compile -- inductor really
    generates and builds C++ kernels here, ~20-35 s -- and the log-probs and the step's gradients
    match the eager ones up to rounding (inductor keeps some intermediates in fp32). Prompts
    are shared by samples, so the layers see share_prompts' attention mask. The KL reference's
    layers are compiled too: the KL is exactly 0 before the first update. One graph serves both
    layers and all calls of a mode: the update's, and the reference's (no gradient). Without a C++
    compiler the layers run eagerly, with one line that says so."""
    from torch._dynamo.utils import counters
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]] * 3 + [[13, 14, 15, 16, 17, 18, 19]] * 3
    batch = make_batch(prompts, COMPLETIONS, [1.0, 0.5, -0.5, 0.5, 2.0, -1.0])  # all trained
    torch._dynamo.reset()  # (no graph cached by another test)
    results = {}
    for compiled in (False, True):
        trainer = rl_trainer(Config(data="arith", model=tiny_model_dir, beta=0.04, lr=1e-3,
                                       compile=compiled))
        recorded = record_grads(trainer)
        counters.clear()
        # Zero advantages: the policy and its reference agree exactly (Adam's step is then 0)
        first = finish_metrics([train_on_rollout(trainer, make_batch(prompts, COMPLETIONS,
                                                                     [0.0] * 6))])
        assert (first["kl"], first["grad_norm"]) == (0.0, 0.0)
        logprobs, _ = completion_logprobs(trainer.compute.train(), batch.input_ids,
                                          batch.prompt_lens, batch.completion_lens)
        train_on_rollout(trainer, batch)
        results[compiled] = logprobs.detach(), _flat(recorded)
        assert counters["stats"]["unique_graphs"] == (2 if compiled else 0)  # update, reference
    (eager_logprobs, eager), (logprobs, grads) = results[False], results[True]
    assert torch.allclose(logprobs, eager_logprobs, atol=1e-2)  # measured: 0.002 (bf16)
    assert float((grads - eager).norm() / eager.norm()) < 0.02  # measured: 0.006 (bf16)

    with inductor_config.patch({"cpp.cxx": ("no-such-compiler",)}):  # (monkeypatch would delete it)
        trainer = rl_trainer(Config(data="arith", model=tiny_model_dir, beta=0.0, compile=True))
    assert "found none: the layers run eagerly" in capsys.readouterr().err
    assert all(layer._compiled_call_impl is None for layer in trainer.compute.model.layers)


def test_a_skipped_update_leaves_the_applied_ones_metrics_whole(tiny_model_dir, monkeypatch):
    """With two updates per rollout of which the second is skipped (non-finite), the step reports
    the first update's loss and gradient norm -- their mean over the updates that happened, not
    half of them."""
    import grpo
    real, seen = grpo.optimizer_step, []

    def second_not_finite(trainer, loss):
        if seen:  # the second update: skipped, as a non-finite one is
            trainer.optimizer.zero_grad(set_to_none=True)
            return None
        seen.append((loss, real(trainer, loss)))
        return seen[-1][1]

    monkeypatch.setattr(grpo, "optimizer_step", second_not_finite)
    trainer = _trainer(tiny_model_dir, beta=0.0, updates_per_rollout=2)
    metrics = finish_metrics([train_on_rollout(trainer, make_batch(PROMPTS, COMPLETIONS,
                                                                   ADVANTAGES))])
    (loss, grad_norm), = seen
    assert metrics["skipped_updates"] == 1
    assert metrics["loss"] == pytest.approx(loss)
    assert metrics["grad_norm"] == pytest.approx(grad_norm)


def test_by_op_counts_the_updates_matmul_flops_as_torch_does_and_gives_the_step_back(
        tiny_model_dir, monkeypatch, capsys):
    """update_profile.by_op (--by-op): its matmul FLOPs are torch's FlopCounterMode's for the same
    update, and grpo.optimizer_step, which it times by swapping it, is grpo's own again after an
    update -- one that raises too."""
    import grpo
    from torch.utils.flop_counter import FlopCounterMode
    sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from update_profile import by_op
    # (groups sharing a prompt: their attention is SmallAttention's batched products)
    trainer, batch = _trainer(tiny_model_dir), make_batch(SHARED, COMPLETIONS, ADVANTAGES)
    train_on_rollout(trainer, batch)  # (the first measures this CPU's peak: a matmul of its own)
    with FlopCounterMode(display=False) as counted:  # (its numbers only: it changes gradients)
        train_on_rollout(trainer, batch)
    step = grpo.optimizer_step
    times = by_op(trainer, batch, [1.0], 1.0, "six sequences")
    assert times.mm_flops == counted.get_total_flops() > 0
    assert {"aten::mm", "aten::bmm"} <= {name for name, _ in times.seconds}
    assert "aten::mm" in capsys.readouterr().out and grpo.optimizer_step is step

    def broken(*args, **kwargs):
        raise RuntimeError("a step that fails")

    monkeypatch.setattr(grpo, "policy_logprobs", broken)
    with pytest.raises(RuntimeError, match="a step that fails"):
        by_op(trainer, batch, [1.0], 1.0, "six sequences")
    assert grpo.optimizer_step is step


def test_phases_draws_the_updates_line_through_the_steps_after_the_first():
    """benchmarks/phases.py's update_line: seconds = fixed + per-token x tokens over the steps
    after the first that trained, the rollout log's pass left out as mfu leaves it; one slow step
    does not tilt it (Theil-Sen); the median mfu the tokens alone reach, each step at its own
    peak; and no line where none says anything."""
    sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from phases import update_line

    def step(tokens, fixed=0.3, detail=0.1, peak=2e9):  # 1 ms a token, at half of a 2e9 peak
        return {"trained_tokens": tokens, "train_seconds": fixed + 1e-3 * tokens + detail,
                "detail_seconds": detail, "model_flops": 1e6 * tokens, "peak_flops": peak}

    first = {**step(500), "train_seconds": 60.0}  # (a first step's warm-ups: left out)
    nothing = {"trained_tokens": 0, "train_seconds": 1.4}  # (a step that trained nothing)
    slow = {**step(2200), "train_seconds": 9.0}  # (a compile, a busy neighbour)
    steps = [first, nothing, slow] + [step(t) for t in (1000, 2500, 1800, 4000, 3100)]
    line = update_line(steps + [{**step(3600, peak=4e9), "train_seconds": 0.3 + 1.8 + 0.1}])
    assert line.fixed == pytest.approx(0.3) and line.per_token == pytest.approx(1e-3)
    assert line.mfu_without == pytest.approx(0.5)  # (the faster step at twice the peak: 0.5 too)
    fast = [{**step(t, peak=4e9), "train_seconds": 0.3 + 0.5e-3 * t + 0.1} for t in (1e3, 2e3, 3e3)]
    assert update_line([first] + fast).mfu_without == pytest.approx(0.5)  # (at 4e9, not 2e9)
    assert update_line([first] + [step(t) for t in (1000, 2500, 1000)]) is None  # two counts
    assert update_line([first] + [step(t) for t in (3000, 3100, 3200, 3300)]) is None  # alike
    assert update_line([first] + [step(t, fixed=-0.5) for t in (1000, 2000, 3000)]) is None
    falling = [{**step(t), "train_seconds": 5.0 - 1e-3 * t} for t in (1000, 2000, 3000)]
    assert update_line([first] + falling) is None  # (no cost model: more tokens, less time)

"""What long runs depend on: checkpoints and exact resume, --init-from, config files and recipes,
dynamic sampling, overlong filtering, GSPO, token-budget micro-batches, </think> grading."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data import parse_config
from grpo import (Config, find_checkpoint, finish_metrics, grpo_loss, loss_denominator,
                  overlong_penalty, setup_trainer, train_on_rollout)
from conftest import make_batch, record_grads
from reward import Grader, RewardFunctions

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("seconds", "tokens_per_s", "peak_memory")


def _run(args, timeout=600):
    result = subprocess.run([sys.executable, "grpo.py", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _common(model_dir, out):
    return ["--model", model_dir, "--prompts-per-step", "2", "--num-generations", "4",
            "--max-new-tokens", "6", "--eval-every", "0", "--beta", "0.01", "--temperature", "1.0",
            "--lr", "1e-3", "--reward", "tests.rewards:parity_reward", "--out", str(out)]


def _metrics(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def test_resume_is_exact(tiny_model_dir, tmp_path):
    _run(_common(tiny_model_dir, tmp_path / "a") + ["--steps", "4"])
    _run(_common(tiny_model_dir, tmp_path / "b") + ["--steps", "2", "--save-every", "2"])
    assert (tmp_path / "b/checkpoints/step_2/trainer_state.pt").exists()
    result = _run(_common(tiny_model_dir, tmp_path / "b") + ["--steps", "4", "--resume", "auto"])
    assert "resuming from" in result.stdout
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b  # every non-timing metric of steps 3 and 4 (and 1, 2) is identical


def test_keep_last_and_bad_resume(tiny_model_dir, tmp_path):
    _run(_common(tiny_model_dir, tmp_path) + ["--steps", "3", "--save-every", "1",
                                              "--keep-last", "2"])
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_2", "step_3"]
    with pytest.raises(SystemExit, match="not a checkpoint folder"):
        find_checkpoint(tmp_path, str(tmp_path))


KILL_DURING_SAVE = r"""
import os, signal, sys, torch
sys.path.insert(0, ".")
import grpo
real_save = torch.save
def dying_save(obj, path, *a, **k):
    if "driver_state" in str(path) and "step_2" in str(path):
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 in the middle of writing checkpoint 2
    return real_save(obj, path, *a, **k)
torch.save = dying_save
grpo.main(grpo.Config(model=sys.argv[1], out=sys.argv[2], steps=3, save_every=1, keep_last=5,
                      prompts_per_step=2, num_generations=2, max_new_tokens=4, eval_every=0))
"""


def test_kill_during_save_leaves_the_last_checkpoint_whole(tiny_model_dir, tmp_path):
    result = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, tiny_model_dir,
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == -9
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == [".tmp-step_2", "step_1"]  # half-written 2 never took step_2's name
    assert find_checkpoint(tmp_path, "auto").endswith("step_1")
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints/step_1")  # loadable
    _run(["--model", tiny_model_dir, "--out", str(tmp_path), "--resume", "auto", "--steps", "2",
          "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4",
          "--eval-every", "0"])
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]


def test_init_from_starts_from_the_weights(tiny_model_dir, tmp_path):
    _run(_common(tiny_model_dir, tmp_path / "a") + ["--steps", "1", "--save-every", "1"])
    ckpt = tmp_path / "a/checkpoints/step_1"
    _run(_common(tiny_model_dir, tmp_path / "b") + ["--steps", "0", "--init-from", str(ckpt)])
    from safetensors.torch import load_file
    start, saved = load_file(ckpt / "model.safetensors"), load_file(tmp_path / "b/model.safetensors")
    original = load_file(Path(tiny_model_dir) / "model.safetensors")
    for name in start:
        assert torch.equal(start[name], saved[name]), name
    assert any(not torch.equal(start[n], original[n]) for n in start)  # really other weights


def test_config_file_is_overridden_by_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('lr = 3e-6\nsteps = 7\nloss-agg = "seq-mean"\n')
    cfg = parse_config(Config, ["--config", str(path), "--steps", "9"])
    assert (cfg.lr, cfg.steps, cfg.loss_agg) == (3e-6, 9, "seq-mean")
    path.write_text("stepz = 3\n")
    with pytest.raises(SystemExit, match="unknown option 'stepz'"):
        parse_config(Config, ["--config", str(path)])
    path.write_text('steps = "many"\n')
    with pytest.raises(SystemExit, match="'steps' must be int"):
        parse_config(Config, ["--config", str(path)])


@pytest.mark.parametrize("recipe", sorted(str(p) for p in (ROOT / "recipes").rglob("*.toml")))
def test_every_recipe_passes_dry_run(recipe, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(Config, ["--config", recipe, "--dry-run"])
    assert exit_.value.code == 0
    assert "max_new_tokens" in capsys.readouterr().out


def test_dynamic_sampling_never_loops_forever(tiny_model_dir, tmp_path):
    # A random model never answers correctly: every group has zero spread, every round is dropped.
    _run(_common(tiny_model_dir, tmp_path) + ["--steps", "1", "--dynamic-sampling",
                                              "--max-fill-rounds", "2", "--reward", "correctness"])
    r = _metrics(tmp_path)[0]
    assert (r["fill_rounds"], r["kept_groups"], r["dropped_groups"]) == (2, 0, 6)
    assert r["trained_frac"] == 0.0


def test_dynamic_sampling_fills_the_batch(tiny_model_dir, tmp_path):
    _run(_common(tiny_model_dir, tmp_path) + ["--steps", "2", "--dynamic-sampling"])
    for r in _metrics(tmp_path):
        assert r["kept_groups"] == 2  # the batch is full of groups that have signal
        assert r["dropped_groups"] <= 2 * (r["fill_rounds"] + 1)


def test_overlong_penalty_values():
    assert overlong_penalty([10, 12, 14, 16], max_new_tokens=16, buffer=4) == [0.0, 0.0, -0.5, -1.0]


def _tiny_trainer(model_dir, **kw):
    return setup_trainer(Config(model=model_dir, bf16=False, beta=0.0, lr=1e-3, **kw))


def _grads(recorded):
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
    assert torch.allclose(_grads(grads_a), _grads(grads_b), atol=1e-7)
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
        results.append((metrics["loss"], _grads(grads)))
    for loss, grads in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5)
        assert torch.allclose(grads, results[0][1], atol=1e-6)


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


def test_require_think_close():
    fns = RewardFunctions("correctness", "boxed", Grader(), require_think_close=True)
    completions = ["<think>maybe \\boxed{4}</think> so \\boxed{5}",
                   "<think>still thinking \\boxed{5}",
                   "<think>x</think> \\boxed{4}"]
    total, _ = fns(["q"] * 3, completions, [{"answer": "5"}] * 3)
    assert total == [1.0, 0.0, 0.0]


def _fake_checkpoints(out, steps, keep_last):
    """save_checkpoint with a stand-in for the trainer's half (no model needed)."""
    from grpo import save_checkpoint
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    (out / "grpo_config.json").write_text("{}")

    def save_trainer(folder):
        torch.save({"optimizer": {}, "scheduler": {}, "torch_rng": torch.get_rng_state()},
                   Path(folder) / "trainer_state.pt")

    for step in steps:
        save_checkpoint(out, step, save_trainer, consumed=step * 2, keep_last=keep_last)
    return sorted((p.name for p in (out / "checkpoints").iterdir()), key=lambda n: int(n[5:]))


def test_keep_last_zero_keeps_every_checkpoint(tmp_path):
    assert _fake_checkpoints(tmp_path / "a", [1, 2, 3], keep_last=0) == ["step_1", "step_2", "step_3"]
    assert _fake_checkpoints(tmp_path / "b", [1, 2, 3], keep_last=1) == ["step_3"]


def test_checkpoint_state_loads_weights_only(tmp_path):
    from model import load_state
    _fake_checkpoints(tmp_path, [4], keep_last=0)
    state = load_state(tmp_path / "checkpoints/step_4/driver_state.pt")
    assert state["step"] == 4 and state["consumed"] == 8
    assert find_checkpoint(tmp_path, "auto").endswith("step_4")


def test_a_damaged_checkpoint_is_named(tmp_path):
    _fake_checkpoints(tmp_path, [1, 2], keep_last=0)
    driver = tmp_path / "checkpoints/step_2/driver_state.pt"
    driver.write_bytes(driver.read_bytes()[:100])  # truncated by a full disk, say
    with pytest.raises(SystemExit, match=r"checkpoint .*step_2: driver_state.pt cannot be loaded"
                                         r".*--resume PATH \(others there: step_1\)"):
        find_checkpoint(tmp_path, "auto")


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_crafted_checkpoint_cannot_run_code(tiny_model_dir, tmp_path):
    _fake_checkpoints(tmp_path, [1], keep_last=0)
    marker = tmp_path / "code-ran"
    ckpt = tmp_path / "checkpoints/step_1"
    torch.save({"step": 1, "consumed": 2, "payload": _Exploit(str(marker))},
               ckpt / "driver_state.pt")
    result = subprocess.run([sys.executable, "grpo.py", "--model", tiny_model_dir, "--resume",
                             str(ckpt), "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "driver_state.pt cannot be loaded safely" in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()

"""grpo.py through the command line on a tiny random model: a two-step run, bad data, DAPO's
dynamic sampling, TensorBoard and W&B logging."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_metrics, run_grpo, run_script, small_run_args

ROOT = Path(__file__).resolve().parents[1]


def test_two_step_run(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "grpo.py", "--model", tiny_model_dir, "--data", "arith", "--steps", "2",
           "--prompts-per-step", "2", "--num-generations", "4", "--max-new-tokens", "8",
           "--eval-size", "6", "--eval-every", "1", "--micro-batch-size", "3", "--beta", "0.04",
           "--updates-per-rollout", "2", "--reward", "correctness,format=0.1", "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("reward", "accuracy", "completion_len", "step_seconds", "eval_accuracy", "kl",
                "clip_low", "clip_high", "entropy_trained", "grad_norm", "zero_std_frac",
                "truncated_frac", "gen_seconds", "reward_seconds", "train_seconds"):
        assert key in records[2], key
    assert "eval_accuracy" in records[0] and 0.0 <= records[2]["eval_accuracy"] <= 1.0
    assert (out / "curves.png").stat().st_size > 1000

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out / "model")  # a plain HF folder
    assert model.config.num_hidden_layers == 2
    assert not (out / "trainer_state.pt").exists()  # optimizer state belongs in checkpoints only


def test_bad_data_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    result = run_script("grpo.py", ["--data", str(bad), "--out", str(tmp_path / "o")])
    assert result.returncode != 0
    assert f"{bad}: row 2 has no 'answer' field" in result.stderr


def test_jsonl_data_with_prompt_column_and_too_few_rows_to_hold_out(tiny_model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 2?", "answer": i + 2}) + "\n"
                            for i in range(5)))
    out = tmp_path / "run"
    run_grpo(["--model", tiny_model_dir, "--data", str(data), "--steps", "1", "--prompts-per-step",
              "2", "--num-generations", "2", "--max-new-tokens", "4", "--template", "boxed",
              "--out", str(out)])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]  # 5 rows: nothing to hold out, no evaluation
    assert "eval_accuracy" not in records[0]


def test_dynamic_sampling_never_loops_forever(tiny_model_dir, tmp_path):
    # A random model never answers correctly: every group has zero spread, every round is dropped.
    run_grpo(small_run_args(tiny_model_dir, tmp_path) + ["--steps", "1", "--dynamic-sampling",
                                              "--max-fill-rounds", "2", "--reward", "correctness"])
    r = read_metrics(tmp_path)[0]
    assert (r["fill_rounds"], r["kept_groups"], r["dropped_groups"]) == (2, 0, 6)
    assert r["trained_frac"] == 0.0


def test_dynamic_sampling_fills_the_batch(tiny_model_dir, tmp_path):
    run_grpo(small_run_args(tiny_model_dir, tmp_path) + ["--steps", "2", "--dynamic-sampling"])
    for r in read_metrics(tmp_path):
        assert r["kept_groups"] == 2  # the batch is full of groups that have signal
        assert r["dropped_groups"] <= 2 * (r["fill_rounds"] + 1)


def test_report_to_tensorboard_and_wandb(tiny_model_dir, tmp_path):
    """TensorBoard's event files hold exactly metrics.jsonl's scalars; W&B runs offline."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    result = subprocess.run([sys.executable, "grpo.py", *small_run_args(tiny_model_dir, out),
                             "--steps", "2", "--eval-every", "2", "--eval-size", "4",
                             "--report-to", "tensorboard,wandb"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for key in ("reward", "loss", "grad_norm", "completion_len", "eval_accuracy"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        expected = {r["step"]: r[key] for r in records if key in r}
        assert logged.keys() == expected.keys(), key
        for step, value in expected.items():
            assert abs(logged[step] - value) <= 1e-6 * max(1.0, abs(value)), (key, step)
    assert list((out / "wandb").glob("offline-run-*"))  # the W&B run, ready for `wandb sync`


def test_async_generation_time_is_the_engines_own(tiny_model_dir, tmp_path, monkeypatch):
    """With --async-steps 1 and the engine in this process, a batch is generated before the
    training step that precedes its own: gen_seconds (and gen_tokens_per_s) are the engine's time,
    not the wall time since the batch was started, which includes a whole training step."""
    import time
    import grpo
    train = grpo.train_on_rollout

    def slow_train(trainer, batch):
        time.sleep(2.0)  # longer than any generation here, even on a loaded machine
        return train(trainer, batch)

    monkeypatch.setattr(grpo, "train_on_rollout", slow_train)
    history = grpo.main(grpo.Config(model=tiny_model_dir, data="arith", steps=3, async_steps=1,
                                    prompts_per_step=2, num_generations=2, max_new_tokens=4,
                                    eval_every=0, log_samples_every=0, out=str(tmp_path)))
    assert [r["policy_lag"] for r in history] == [0, 1, 1]
    assert all(0 < r["gen_seconds"] < 2.0 for r in history), [r["gen_seconds"] for r in history]

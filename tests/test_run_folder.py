"""A run's folder (session.py, checkpoint.py): nothing a user made is lost. A run reads every model
before it moves anything in --out; a resume into a folder holding another run, or from an earlier
checkpoint, moves what it would overwrite aside whole; one run at a time holds --out;
superseded/ is bounded and the disk is checked before training; a damaged checkpoint is one line."""

import importlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import small_run_args
from data import parse_config


def _earlier_run(out: Path, model_dir: str):
    """What a finished run leaves in --out: its model, metrics and config (no checkpoints)."""
    shutil.copytree(model_dir, out / "model")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "grpo_config.json").write_text("{}")
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _pairs(path: Path) -> str:
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "chosen": f"{i + 1}",
                                        "rejected": f"{i + 7}"}) + "\n" for i in range(12)))
    return str(path)


def _conversations(path: Path) -> str:
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} * 3?"},
        {"role": "assistant", "content": f"The answer is {3 * i}."}]}) + "\n" for i in range(12)))
    return str(path)


RL = ["--data", "arith", "--steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
      "--max-new-tokens", "4", "--eval-every", "0", "--dtype", "fp32"]
OFFLINE = ["--steps", "1", "--batch-size", "4", "--eval-every", "0", "--dtype", "fp32"]


def _args(algorithm: str, tiny: str, out: Path, tmp_path: Path) -> list[str]:
    """A one-step run of `algorithm` whose starting model (or teacher) is the run folder it writes
    in: --model out, --init-from out, --teacher out."""
    o = str(out)
    return {
        "sft": ["--model", o, "--data", _conversations(tmp_path / "c.jsonl"), "--max-length",
                "64", *OFFLINE],
        "rm": ["--model", o, "--data", _pairs(tmp_path / "p.jsonl"), "--micro-batch-size", "2",
               "--eval-pairs", "2", *OFFLINE],
        "dpo": ["--model", o, "--data", _pairs(tmp_path / "p.jsonl"), "--micro-batch-size", "2",
                "--eval-pairs", "2", *OFFLINE],
        "grpo": ["--model", tiny, "--init-from", o, *RL],
        "ppo": ["--model", o, *RL],
        "distill": ["--model", tiny, "--teacher", o, "--lmbda", "0", *RL],  # (the teacher samples)
    }[algorithm] + ["--out", o]


@pytest.mark.parametrize("algorithm", ["sft", "rm", "dpo", "grpo", "ppo", "distill"])
def test_a_run_started_from_its_own_out_keeps_both_models(algorithm, tiny_model_dir, tmp_path):
    """`python sft.py --model out/sft` (any algorithm; --init-from, --teacher alike): the earlier
    model is read before the run moves it to superseded/, and the run saves its own (it once read
    the moved model again at its export: `Unrecognized model in out/sft`, nothing saved)."""
    out = tmp_path / "out"
    earlier = _earlier_run(out, tiny_model_dir)
    module = importlib.import_module(algorithm)
    module.main(parse_config(module.Config, _args(algorithm, tiny_model_dir, out, tmp_path)))
    [aside] = (out / "superseded").iterdir()
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == \
        earlier
    assert (out / "model" / "model.safetensors").exists() and (out / "report.html").exists()

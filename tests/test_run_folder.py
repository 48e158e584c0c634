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


def _files(folder: Path, skip=()) -> dict:
    """Every file under `folder` (its lock file, and the folders named in `skip`, left out), by
    its path there: its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != ".smolrl.lock"
            and not any(part in skip for part in p.relative_to(folder).parts)}


def _lines(out: Path, name: str) -> list[str]:
    return (out / name).read_text().splitlines()


def test_a_resume_into_a_folder_holding_a_finished_run_moves_that_run_aside(tiny_model_dir,
                                                                              tmp_path):
    """--resume A/checkpoints/step_2 --out B, B a finished run without checkpoints (the default):
    B's run is moved whole to B/superseded/ before anything is written (it once had its metrics
    rewritten, its rollouts cut and A's appended, its config and model replaced); B then holds
    A's run so far -- its metrics and samples up to step 2 -- and the resumed steps."""
    a, b = tmp_path / "a", tmp_path / "b"
    from conftest import run_grpo
    run_grpo(small_run_args(tiny_model_dir, a) + ["--steps", "3", "--save-every", "2"])
    run_grpo(small_run_args(tiny_model_dir, b) + ["--steps", "1"])
    before = _files(b)
    result = run_grpo(small_run_args(tiny_model_dir, b) + [
        "--steps", "3", "--resume", str(a / "checkpoints" / "step_2")])
    [aside] = (b / "superseded").iterdir()
    assert _files(aside) == before
    assert f"moved whole to {aside}" in result.stdout
    assert _lines(b, "rollouts.jsonl") == _lines(a, "rollouts.jsonl")  # (exact on a CPU)
    assert [json.loads(line)["step"] for line in _lines(b, "metrics.jsonl")] == [1, 2, 3]


def test_branching_from_an_earlier_checkpoint_moves_the_branch_aside_whole(tiny_model_dir,
                                                                           tmp_path):
    """A run of 5 steps (checkpoints at 2 and 4) resumed from step_2: the branch it leaves --
    step_4, and what lies past it only in the run's files: step 5's samples and metrics, the
    final model, the report -- is moved whole to superseded/<time>/, a run folder of its own (it
    once lost all but step_4). Resumed from there (the line says how), the branch being run is
    moved aside in turn: --keep-last prunes only the checkpoints of the branch in --out, and
    --resume auto picks among them; and the run ends where the first one did, exactly."""
    from checkpoint import find_checkpoint
    from conftest import read_metrics, run_grpo
    out, args = tmp_path / "run", small_run_args(tiny_model_dir, tmp_path / "run")
    run_grpo(args + ["--steps", "5", "--save-every", "2", "--keep-last", "0"])
    first = _files(out, skip=("step_2",))
    first_metrics = read_metrics(out)
    result = run_grpo(args + ["--steps", "3", "--save-every", "1", "--keep-last", "1",
                              "--resume", str(out / "checkpoints" / "step_2")])
    [aside] = (out / "superseded").iterdir()
    assert _files(aside) == first  # step_4, metrics and samples of steps 1-5, model, report
    back = aside / "checkpoints" / "step_4"
    assert f"moved whole to {aside}" in result.stdout and f"--resume {back}" in result.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert read_metrics(out) == first_metrics[:3]
    assert _lines(out, "rollouts.jsonl") == first[Path("rollouts.jsonl")].decode().splitlines()[
        :3 * 8]
    branch = _files(out, skip=("superseded",))
    result = run_grpo(args + ["--steps", "5", "--save-every", "1", "--keep-last", "1",
                              "--resume", str(back)])
    second = sorted(set((out / "superseded").iterdir()) - {aside})
    assert len(second) == 1 and _files(second[0]) == branch  # steps 2 and 3 kept whole
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_5"]
    assert find_checkpoint(out, "auto") == str(out / "checkpoints" / "step_5")
    assert (back / "trainer_state.pt").exists()
    assert read_metrics(out) == first_metrics
    assert _lines(out, "rollouts.jsonl") == first[Path("rollouts.jsonl")].decode().splitlines()

"""Checkpoints (checkpoint.py): exact resume, --keep-last, a kill during a save, --init-from,
weights-only loading, damaged and crafted files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoint import DriverState, find_checkpoint, load_state, save_checkpoint
from conftest import rl_trainer, ROOT, read_metrics, run_grpo, run_script, small_run_args


def test_resume_is_exact(tiny_model_dir, tmp_path):
    """b stops after step 3 with its checkpoint at step 2, and resumes from it: its metrics and
    its rollout log (step 3 cut, then sampled again) are a's, which ran straight through."""
    run_grpo(small_run_args(tiny_model_dir, tmp_path / "a") + ["--steps", "4"])
    run_grpo(small_run_args(tiny_model_dir, tmp_path / "b") + ["--steps", "3", "--save-every", "2"])
    assert (tmp_path / "b/checkpoints/step_2/trainer_state.pt").exists()
    result = run_grpo(small_run_args(tiny_model_dir, tmp_path / "b") + ["--steps", "4",
                                                                       "--resume", "auto"])
    assert "resuming from" in result.stdout
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b  # every non-timing metric of steps 3 and 4 (and 1, 2) is identical
    logs = [(tmp_path / run / "rollouts.jsonl").read_text().splitlines() for run in "ab"]
    assert len(logs[0]) == 4 * 8 and logs[0] == logs[1]


def test_keep_last_and_bad_resume(tiny_model_dir, tmp_path):
    run_grpo(small_run_args(tiny_model_dir, tmp_path) + ["--steps", "3", "--save-every", "1",
                                                         "--keep-last", "2"])
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_2", "step_3"]
    with pytest.raises(SystemExit, match="not a checkpoint folder"):
        find_checkpoint(tmp_path, str(tmp_path))


def test_a_run_prunes_only_its_own_checkpoints(tmp_path):
    """--keep-last deletes the oldest checkpoints of *this* run: an older run's step_20 and step_30
    in the same folder are not "newer" than this run's step_5, and are never touched."""
    _fake_checkpoints(tmp_path, [20, 30], keep_last=2, run_id="older")
    assert _fake_checkpoints(tmp_path, [5, 10, 15], keep_last=2, run_id="this") == [
        "step_10", "step_15", "step_20", "step_30"]


def test_a_fresh_run_refuses_a_folder_with_another_runs_checkpoints(tiny_model_dir, tmp_path):
    """A new run in a folder holding checkpoints stops before loading anything, names them, and
    deletes nothing; --resume auto continues them."""
    _fake_checkpoints(tmp_path, [3], keep_last=2, run_id="older")
    result = run_script("grpo.py", [*small_run_args(tiny_model_dir, tmp_path), "--steps", "1"])
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'checkpoints'} holds another run's checkpoints (step_3): continue "
        f"that run with --resume auto, or choose another --out (nothing was changed)")
    assert (tmp_path / "checkpoints/step_3/trainer_state.pt").exists()
    assert (tmp_path / "grpo_config.json").read_text() == "{}"  # not the new run's


def test_an_export_replaces_the_model_folder_whole(tiny_model, tmp_path):
    """The final model is written beside its folder and renamed into place: nothing of an older
    export survives in it -- not even the shards of a larger one, whose index would otherwise win
    over the new model.safetensors when transformers loads the folder."""
    from model import save_model
    model, tokenizer = tiny_model
    target = tmp_path / "model"
    target.mkdir()
    for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (target / stale).write_text("an older export")
    save_model(model, tokenizer, target)
    assert "model.safetensors" in {p.name for p in target.iterdir()}
    assert not any(p.name.startswith("model-0") or p.name.endswith("index.json")
                   for p in target.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary folder left behind


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
grpo.main(grpo.Config(data="arith", model=sys.argv[1], out=sys.argv[2], steps=3, save_every=1,
                      keep_last=5, prompts_per_step=2, num_generations=2, max_new_tokens=4,
                      eval_every=0))
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
    run_grpo(["--model", tiny_model_dir, "--data", "arith", "--out", str(tmp_path), "--resume",
              "auto", "--steps", "2",
          "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4",
          "--eval-every", "0"])
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_init_from_starts_from_the_weights(tiny_model_dir, tmp_path):
    run_grpo(small_run_args(tiny_model_dir, tmp_path / "a") + ["--steps", "1", "--save-every",
                                                                "1"])
    ckpt = tmp_path / "a/checkpoints/step_1"
    run_grpo(small_run_args(tiny_model_dir, tmp_path / "b") + ["--steps", "0", "--init-from",
                                                                str(ckpt)])
    from safetensors.torch import load_file
    start, saved = load_file(ckpt / "model.safetensors"), load_file(tmp_path / "b/model/model.safetensors")
    original = load_file(Path(tiny_model_dir) / "model.safetensors")
    for name in start:
        assert torch.equal(start[name], saved[name]), name
    assert any(not torch.equal(start[n], original[n]) for n in start)  # really other weights


def _fake_checkpoints(out, steps, keep_last, run_id="run"):
    """save_checkpoint with a stand-in for the trainer's half (no model needed): one run's."""
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    (out / "grpo_config.json").write_text("{}")

    def save_trainer(folder):
        torch.save({"optimizer": {}, "scheduler": {}, "torch_rng": torch.get_rng_state()},
                   Path(folder) / "trainer_state.pt")

    for step in steps:
        save_checkpoint(out, DriverState(step, consumed=step * 2, run_id=run_id), save_trainer,
                        keep_last)
    return sorted((p.name for p in (out / "checkpoints").iterdir()), key=lambda n: int(n[5:]))


def test_keep_last_zero_keeps_every_checkpoint(tmp_path):
    assert _fake_checkpoints(tmp_path / "a", [1, 2, 3], keep_last=0) == ["step_1", "step_2",
                                                                          "step_3"]
    assert _fake_checkpoints(tmp_path / "b", [1, 2, 3], keep_last=1) == ["step_3"]


def test_checkpoint_state_loads_weights_only(tmp_path):
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


def _changed(checkpoint, name, **changes):
    """A state file of `checkpoint` rewritten with `changes` (None: the key dropped)."""
    state = torch.load(checkpoint / name, weights_only=True)
    state.update(changes)
    torch.save({k: v for k, v in state.items() if v is not None}, checkpoint / name)


@pytest.mark.parametrize("damage, said", [
    (lambda c: (c / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "loss": \n'),
     r"metrics.jsonl, line 2: not JSON \(Expecting value"),
    (lambda c: (c / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n'),
     r"metrics.jsonl, line 2: not a JSON object"),
    (lambda c: (c / "metrics.jsonl").write_text('{"step": 9}\n'),
     r"metrics.jsonl, line 1: step 9, past the checkpoint's step 2"),
    (lambda c: (c / "metrics.jsonl").write_text('{"loss": 1.0}\n'),
     r"metrics.jsonl, line 1: no step"),
    (lambda c: (c / "metrics.jsonl").unlink(), r"no metrics.jsonl"),
    (lambda c: _changed(c, "driver_state.pt", python_rng=[1, 2]), r"driver_state.pt: python_rng"),
    (lambda c: _changed(c, "driver_state.pt", numpy_rng=["MT19937", [0], 0]),
     r"driver_state.pt: numpy_rng"),
    (lambda c: _changed(c, "driver_state.pt", step="2"), r"driver_state.pt: step"),
    (lambda c: _changed(c, "driver_state.pt", consumed=None), r"driver_state.pt: consumed"),
    (lambda c: _changed(c, "driver_state.pt", run_id=7), r"driver_state.pt: run_id"),
    (lambda c: torch.save([1, 2], c / "driver_state.pt"), r"driver_state.pt: step"),
    (lambda c: _changed(c, "trainer_state.pt", torch_rng=None), r"trainer_state.pt: torch_rng"),
    (lambda c: _changed(c, "trainer_state.pt", scheduler=[1]), r"trainer_state.pt: scheduler"),
])
def test_a_crafted_checkpoint_that_loads_is_one_line_before_any_model(damage, said, tmp_path):
    """Issue 67: files that load weights-only but are not what a checkpoint holds -- a damaged
    metrics.jsonl, a driver state without its RNGs -- once passed the checks and stopped the run
    with a traceback in resume_driver, after the models had loaded. Now: one line when the
    checkpoint is found."""
    _fake_checkpoints(tmp_path, [2], keep_last=0)
    checkpoint = tmp_path / "checkpoints" / "step_2"
    damage(checkpoint)
    with pytest.raises(SystemExit, match=rf"^error: checkpoint {checkpoint}: (\S*/)?{said}.*"
                                         rf"resume from another checkpoint"):
        find_checkpoint(tmp_path, "auto")


def test_a_crafted_checkpoint_beside_the_one_resumed_is_one_line(tmp_path):
    """--resume step_2 while step_4's driver state loads weights-only but is no dict (crafted):
    telling whose step_4 is stopped the run with a traceback (AttributeError: 'list' object has
    no attribute 'get'); now it is a checkpoint of no run of this one: one line."""
    from checkpoint import claim_checkpoints
    _fake_checkpoints(tmp_path, [2, 4], keep_last=0)
    torch.save([1, 2], tmp_path / "checkpoints" / "step_4" / "driver_state.pt")
    resumed = find_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step_2"))
    with pytest.raises(SystemExit, match=r"^error: .* holds another run's checkpoints \(step_4\)"):
        claim_checkpoints(tmp_path, resumed)


def test_a_damaged_checkpoint_stops_a_run_before_its_models_load(tiny_model_dir, tmp_path):
    _fake_checkpoints(tmp_path, [1], keep_last=0)
    checkpoint = tmp_path / "checkpoints/step_1"
    (checkpoint / "metrics.jsonl").write_text("{not json\n")
    result = run_script("grpo.py", ["--model", tiny_model_dir, "--data", "arith", "--resume",
                                    str(checkpoint), "--out", str(tmp_path)])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: checkpoint {checkpoint}: {checkpoint}/metrics.jsonl, line 1: not JSON")
    assert "Loading weights" not in result.stderr


OSC52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"  # a terminal's clipboard write


def _crafted_weights(path, dtype: str):
    """A safetensors file whose header names `dtype` (safetensors quotes it in its error)."""
    import struct
    header = json.dumps({"w": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}},
                        ensure_ascii=False).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))


def test_a_crafted_checkpoint_is_named_in_one_printable_line(tmp_path):
    """What a checkpoint folder someone else made quotes -- a weight file's header, a folder's
    or a file's name beside it -- reaches the refusal, and the line that says what a fresh run
    moved aside, escaped: an escape sequence there (a clipboard write) shows as text, never
    reaches the terminal as a command."""
    from run_folder import left_behind, set_aside
    _fake_checkpoints(tmp_path, [1, 2], keep_last=0)
    _crafted_weights(tmp_path / "checkpoints/step_2/model.safetensors", OSC52)
    with pytest.raises(SystemExit) as stop:
        find_checkpoint(tmp_path, "auto")
    assert "model.safetensors is damaged" in str(stop.value)
    assert "\\x1b]52;c;" in str(stop.value) and str(stop.value).isprintable()
    (tmp_path / f"checkpoints/step_3{OSC52}").mkdir()
    (tmp_path / "checkpoints/step_2/driver_state.pt").write_bytes(b"damaged")
    with pytest.raises(SystemExit) as stop:
        find_checkpoint(tmp_path, "auto")
    assert "others there: " in str(stop.value) and str(stop.value).isprintable()
    out = tmp_path / f"run{OSC52}"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}")
    (out / "grpo_config.json").write_text("{}")
    moved, _, _ = set_aside(out, left_behind(out, ""), "", None)
    assert "moved whole" in moved and "\\x1b]52;c;" in moved and moved.isprintable()


@pytest.mark.parametrize("damage, said", [
    (b'{"step": 1}\n{"step" 2}\n', "line 2: not JSON (Expecting ':' delimiter, column 9)"),
    (b"\xff\n", "line 1: not UTF-8 (byte 0xff at offset 0)"),
    (b"[1]\n", "line 1: not a JSON object")])
def test_a_checkpoint_with_a_damaged_metrics_log_is_named_before_anything_loads(
        tmp_path, damage, said):
    """A checkpoint's metrics.jsonl (the run's history it resumes with) is checked with its other
    files: damage is one line naming it (it was JSONDecodeError's or UnicodeDecodeError's
    traceback once the reward models had loaded; a list was taken as a step's record)."""
    _fake_checkpoints(tmp_path, [1], keep_last=0)
    log = tmp_path / "checkpoints/step_1/metrics.jsonl"
    log.write_bytes(damage)
    with pytest.raises(SystemExit) as stop:
        find_checkpoint(tmp_path, "auto")
    assert str(stop.value).startswith(f"error: checkpoint {log.parent}: {log}, {said}; "), \
        str(stop.value)

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
    result = run_script("grpo.py", ["--model", tiny_model_dir, "--resume", str(ckpt), "--out",
                                    str(tmp_path)])
    assert result.returncode != 0
    assert "driver_state.pt cannot be loaded safely" in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists()


def test_the_trained_model_is_saved_in_the_dtype_it_came_in(tiny_model_dir, tmp_path):
    """bf16 in (as Qwen ships), bf16 out, and no optimizer state beside it -- though training ran
    on fp32 master weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from grpo import Config
    from model import load_model
    from trainer import export_model
    model, tokenizer = load_model(tiny_model_dir)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tokenizer.save_pretrained(tmp_path / "bf16")
    trainer = rl_trainer(Config(data="arith", model=str(tmp_path / "bf16")))
    assert next(trainer.model.parameters()).dtype == torch.float32  # fp32 master weights
    export_model(trainer, str(tmp_path / "out" / "model"))
    weights = load_file(tmp_path / "out/model/model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert AutoConfig.from_pretrained(tmp_path / "out" / "model").dtype == torch.bfloat16
    assert not (tmp_path / "out/trainer_state.pt").exists()


def test_a_resume_into_another_runs_folder_is_refused_as_a_fresh_run_is(tiny_model_dir, tmp_path):
    """--resume X/checkpoints/step_1 --out Y, with Y holding another run's checkpoints: refused
    before anything is written (it once deleted Y's step_2, wrote X's in its place and rewrote Y's
    metrics.jsonl)."""
    import grpo
    from cli import parse_config
    x, y = tmp_path / "x", tmp_path / "y"
    run_grpo(small_run_args(tiny_model_dir, x) + ["--steps", "1", "--save-every", "1"])
    run_grpo(small_run_args(tiny_model_dir, y) + ["--steps", "2", "--save-every", "2"])
    before = {p: p.read_bytes() for p in y.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match=rf"{y / 'checkpoints'} holds another run's checkpoints "
                                         rf"\(step_2\): resume .*step_1 into an --out of its own"):
        grpo.main(parse_config(grpo.Config, small_run_args(tiny_model_dir, y) + [
            "--steps", "3", "--save-every", "1", "--resume", str(x / "checkpoints/step_1")]))
    assert {p: p.read_bytes() for p in y.rglob("*") if p.is_file()} == before


def test_resuming_an_earlier_step_branches_and_keeps_every_checkpoint(tmp_path):
    """Resumed from step_2 while step_4 exists: step_4 is another branch now, moved whole with
    the run's files to superseded/<time>/checkpoints/ (said on the first screen: how to go back);
    --keep-last 1 never deletes the checkpoint resumed from; --resume auto then picks the newest
    of the branch that was run (step_3), not the abandoned step_4."""
    from checkpoint import claim_checkpoints, load_driver_state
    from run_folder import left_behind, set_aside
    _fake_checkpoints(tmp_path, [2, 4], keep_last=0, run_id="this")
    resumed = tmp_path / "checkpoints" / "step_2"
    assert claim_checkpoints(tmp_path, str(resumed)) == [tmp_path / "checkpoints" / "step_4"]
    line, _, _ = set_aside(tmp_path, left_behind(tmp_path, str(resumed)), str(resumed), None)
    assert line.startswith("resuming from step_2: what this run wrote past it, another branch "
                           "now (checkpoints/step_4, grpo_config.json, metrics.jsonl), is moved "
                           "whole to ")
    [aside] = (tmp_path / "superseded").iterdir()
    back = aside / "checkpoints" / "step_4"
    assert (back / "trainer_state.pt").exists() and f"--resume {back} goes back to it" in line
    assert (aside / "metrics.jsonl").exists() and not (tmp_path / "metrics.jsonl").exists()
    driver = load_driver_state(resumed)
    assert driver.run_id == "this" and driver.resumed_from == str(resumed)
    driver.step = 3
    for name in ("metrics.jsonl", "grpo_config.json"):  # (start_log writes them anew)
        (tmp_path / name).write_text("")
    save_checkpoint(tmp_path, driver, lambda folder: torch.save(
        {"optimizer": {}, "scheduler": {}, "torch_rng": torch.get_rng_state()},
        Path(folder) / "trainer_state.pt"), keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    assert find_checkpoint(tmp_path, "auto") == str(tmp_path / "checkpoints" / "step_3")
    assert claim_checkpoints(tmp_path, str(tmp_path / "checkpoints" / "step_3")) == []


def test_a_branch_on_another_disk_is_refused_before_the_models_load(tmp_path):
    """<out>/checkpoints a link to another filesystem (checkpoints on a scratch disk): a branch
    from step_2 moved step_4 aside with a rename across disks, and stopped with a traceback
    (OSError: Invalid cross-device link) once the models had loaded. Now: one line, at once."""
    import os
    import tempfile
    from run_folder import left_behind
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem at /dev/shm")
    with tempfile.TemporaryDirectory(dir=other) as scratch:
        (tmp_path / "checkpoints").symlink_to(scratch)
        _fake_checkpoints(tmp_path, [2, 4], keep_last=0)
        with pytest.raises(SystemExit, match=rf"^error: {tmp_path / 'checkpoints' / 'step_4'} "
                                             rf"lies on another filesystem than {tmp_path}"):
            left_behind(tmp_path, str(tmp_path / "checkpoints" / "step_2"))


def test_a_fresh_run_moves_a_finished_run_aside_and_says_where(tiny_model_dir, tmp_path):
    """`python grpo.py` twice (no checkpoints: the default): the first run's log, metrics,
    report, curves, config and model are moved whole to <out>/superseded/<time>/, and the second
    run says where (its rollouts.jsonl was emptied without a word). A resumed run moves
    nothing."""
    out = tmp_path / "run"
    run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "1"])
    first = {p.relative_to(out): p.read_bytes() for p in out.rglob("*")
             if p.is_file() and p.name != ".smolrl.lock"}  # (the lock stays: run_folder.py)
    assert {Path("rollouts.jsonl"), Path("metrics.jsonl"), Path("report.html"),
            Path("model/config.json")} <= set(first)
    result = run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "2"])
    [aside] = (out / "superseded").iterdir()
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == first
    assert f"moved whole to {aside}" in result.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert len((out / "rollouts.jsonl").read_text().splitlines()) == 16
    run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "1", "--save-every", "1"])
    assert len(list((out / "superseded").iterdir())) == 2
    result = run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "2", "--resume", "auto"])
    assert "moved" not in result.stdout and len(list((out / "superseded").iterdir())) == 2


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "distill", "sft", "dpo", "rm"])
def test_every_algorithm_moves_an_earlier_run_aside_at_its_first_write(algorithm, tmp_path,
                                                                       capsys):
    """Every algorithm opens and starts its run folder with session.open_run and start_log: a
    fresh run finds another's files (its own kind's or not) and moves them whole, once its models
    have loaded (a run refused before that changes nothing), and a resumed run keeps them."""
    import importlib
    from session import open_run, resume_driver, start_log
    cfg = importlib.import_module(algorithm).Config(
        out=str(tmp_path), **({"teacher": "a/teacher"} if algorithm == "distill" else {}))
    earlier = {"metrics.jsonl": '{"step": 1}\n', "rollouts.jsonl": "{}\n", "report.html": "<p>",
               "curves.png": "png", "machine.json": "{}", "sft_config.json": "{}",
               "model/config.json": "{}", "notes.txt": "the user's own"}
    for name, text in earlier.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    folder = open_run(cfg)
    assert not (tmp_path / "superseded").exists()
    resume_driver(folder)
    start_log(folder, cfg)
    [aside] = (tmp_path / "superseded").iterdir()
    assert f"moved whole to {aside}" in capsys.readouterr().out
    for name, text in earlier.items():
        assert ((tmp_path if name == "notes.txt" else aside) / name).read_text() == text
    assert (tmp_path / cfg.CONFIG_FILE).exists() and (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_checkpoint_named_through_another_mount_of_its_folder_is_that_folders(tmp_path):
    """--out /data/run --resume /mnt/data/run/checkpoints/step_2, the one folder mounted twice
    (a container's bind mount): the resumed run took its own branch for another folder's -- it
    moved the whole run aside and started its samples empty (the log it keeps lay at a path
    moved away) -- and superseded/ pruning deleted the folder it was resuming from, named
    through the other mount. Now a checkpoint is found by what it is, not by its path."""
    import shutil
    from types import SimpleNamespace
    from run_folder import _doomed, read_paths
    out, bind = tmp_path / "out", tmp_path / "bind"
    _fake_checkpoints(out, [2, 4], keep_last=0)
    kept = out / "superseded" / "20260101-000001"
    shutil.copytree(out / "checkpoints", kept / "checkpoints")
    (out / "superseded" / "20260101-000002" / "model").mkdir(parents=True)
    bind.mkdir()
    if subprocess.run(["mount", "--bind", str(out), str(bind)], capture_output=True).returncode:
        pytest.skip("no bind mounts here (they need root)")
    try:
        assert find_checkpoint(out, str(bind / "checkpoints" / "step_2")) == \
            str(out / "checkpoints" / "step_2")
        other = kept.relative_to(out) / "checkpoints" / "step_2"
        reads = read_paths(SimpleNamespace(resume=str(bind / other)))
        assert _doomed(out, 1, reads) == []
    finally:
        subprocess.run(["umount", str(bind)], check=True)


def test_a_resume_in_a_hard_linked_copy_leaves_the_original_as_it_was(tmp_path):
    """`cp -al run copy` (or a backup by rsync --link-dest: the files hard-linked), then
    `--resume auto --out copy`: the resumed run wrote its config, machine.json and curves.png
    through the links -- the original's config then named the copy's --out and flags, its curves
    the copy's steps. Now what a run writes anew is written beside and renamed over."""
    import os
    import shutil
    import grpo
    from charts import plot_curves
    from session import open_run, resume_driver, start_log
    run, copy = tmp_path / "run", tmp_path / "copy"
    _fake_checkpoints(run, [2], keep_last=0)
    for name in ("machine.json", "curves.png"):
        (run / name).write_text(name)
    shutil.copytree(run, copy, copy_function=os.link)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cfg = grpo.Config(out=str(copy), resume="auto", data="arith", model="unused")
    folder = open_run(cfg)
    resume_driver(folder)
    start_log(folder, cfg)
    plot_curves([{"step": 3, "reward": 0.5}], copy / "curves.png")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert json.loads((copy / "grpo_config.json").read_text())["out"] == str(copy)


def test_a_checkpoint_of_another_script_or_structure_is_refused_before_loading(tiny_model_dir,
                                                                              tmp_path):
    """--resume checks whose checkpoint it is: sft.py (or dpo.py, rm.py, ppo.py) given grpo.py's
    would skip GRPO's steps and carry its metrics into its own log, or fail half loaded; grpo.py
    with --lora-rank given a full-weights one would fail half loaded. One line each, nothing in
    the new --out."""
    run_grpo(small_run_args(tiny_model_dir, tmp_path / "grpo") + ["--steps", "1",
                                                                  "--save-every", "1"])
    ck = tmp_path / "grpo" / "checkpoints" / "step_1"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "1+1?", "chosen": "2", "rejected": "3"}\n' * 2)
    for script, extra in [("sft.py", []), ("dpo.py", ["--data", str(pairs)]),
                          ("rm.py", ["--data", str(pairs)]), ("ppo.py", [])]:
        out = tmp_path / script.removesuffix(".py")
        said = run_script(script, ["--model", tiny_model_dir, "--resume", str(ck),
                                   "--out", str(out), *extra])
        code, stderr = said.returncode, said.stderr
        assert code != 0 and f"a checkpoint of grpo.py (grpo_config.json), not of {script}" \
            in stderr, (script, stderr[-600:])
        assert "Traceback" not in stderr and not any(out.glob("*.jsonl")), script
    before = sorted(p.name for p in (tmp_path / "grpo").iterdir())
    said = run_script("grpo.py", small_run_args(tiny_model_dir, tmp_path / "grpo") +
                      ["--steps", "2", "--resume", "auto", "--lora-rank", "4"])
    code, stderr = said.returncode, said.stderr
    assert code != 0 and "its run trained with --lora-rank 0, this one asks for 4" in stderr
    assert "Traceback" not in stderr
    # Full weights resume from the checkpoint, but the tokenizer and the KL reference load from
    # --model: a resume that forgot it (the offline default instead) is another run
    said = run_script("grpo.py", ["--data", "arith", "--out", str(tmp_path / "grpo"),
                                  "--steps", "2", "--resume", "auto"])
    assert said.returncode != 0 and "its run trained with --model (or --init-from) " \
        f"{os.path.realpath(tiny_model_dir)}, this one asks for SmolLM2" in said.stderr, \
        said.stderr[-600:]
    assert sorted(p.name for p in (tmp_path / "grpo").iterdir()) == before  # nothing moved


def test_a_lora_checkpoint_resumes_only_onto_what_its_adapters_fit(tiny_model_dir, tmp_path):
    """A LoRA checkpoint holds adapters only: resumed with another --lora-alpha they would be
    rescaled, on another base model they fail half loaded (or, of the same shapes, adapt the wrong
    weights) -- refused before loading; the same targets in another order, with spaces, and the
    same base spelled otherwise resume."""
    import shutil
    lora = ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj"]
    run_grpo(small_run_args(tiny_model_dir, tmp_path / "g") + ["--steps", "1", "--save-every", "1",
                                                               *lora])
    resume = ["--steps", "2", "--resume", "auto", "--lora-rank", "4"]
    shutil.copytree(tiny_model_dir, tmp_path / "other")
    for args, said in [(["--lora-targets", "q_proj,v_proj", "--lora-alpha", "64"],
                        "trained with --lora-alpha 8, this one asks for 64"),
                       (["--lora-targets", "q_proj,v_proj", "--model", str(tmp_path / "other")],
                        "trained with --model (or --init-from)")]:
        # (the last --model given is the one taken)
        refused = run_script("grpo.py", small_run_args(tiny_model_dir, tmp_path / "g") + resume +
                             args)
        assert refused.returncode != 0 and said in refused.stderr, refused.stderr[-400:]
    run_grpo(small_run_args(tiny_model_dir + "/", tmp_path / "g") + resume +
             ["--lora-targets", "v_proj, q_proj"])  # (order, spaces, a trailing slash)
    assert [r["step"] for r in read_metrics(tmp_path / "g")] == [1, 2]

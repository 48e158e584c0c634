"""A run's folder (session.py, checkpoint.py): nothing a user made is lost. A run reads every model
before it moves anything in --out; a resume into a folder holding another run, or from an earlier
checkpoint, moves what it would overwrite aside whole; one run at a time holds --out;
superseded/ is bounded and the disk is checked before training; a damaged checkpoint is one line."""

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest

from cli import parse_config
from conftest import small_run_args


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


def test_one_run_at_a_time_holds_its_out_and_a_killed_ones_is_taken_over(tiny_model_dir,
                                                                         tmp_path):
    """Two runs into one --out at once (the same command twice, a requeued job): the second stops
    in one line naming the first (pid, host, since when) and changes nothing -- also when it names
    the folder through a link (it once moved the live run's logs aside, both wrote into them and
    both exported to model/). Once the first is killed (kill -9: no chance to clean up), the next
    run takes the folder over and says so."""
    import socket
    import subprocess
    import sys
    import time
    import grpo
    from conftest import ROOT, run_grpo
    out, link = tmp_path / "out", tmp_path / "link"
    args = small_run_args(tiny_model_dir, out) + ["--steps", "1"]
    slow = args[:args.index("--reward") + 1] + ["tests.rewards:slow_reward"] + \
        args[args.index("--reward") + 2:]
    first = subprocess.Popen([sys.executable, "grpo.py", *slow], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300  # (a loaded 2-core machine: its start took over 120 s once)
        while not (out / "metrics.jsonl").exists() and first.poll() is None:
            assert time.time() < deadline, "the first run never started"
            time.sleep(0.2)
        link.symlink_to(out)
        before = _files(out)
        for folder in (out, link):
            cfg = parse_config(grpo.Config, small_run_args(tiny_model_dir, folder) +
                               ["--steps", "1"])
            with pytest.raises(SystemExit, match=rf"^error: --out {folder} is in use by another "
                                                 rf"run \(pid {first.pid} on "
                                                 rf"{socket.gethostname()}, since 20"):
                grpo.main(cfg)
        assert _files(out) == before and not (out / "superseded").exists()
    finally:
        first.kill()  # SIGKILL
        first.wait()
    result = run_grpo(args)
    assert f"was held by a run that ended without releasing it (pid {first.pid} " in \
        result.stdout
    [aside] = (out / "superseded").iterdir()  # (the killed run's metrics and config)
    assert (out / "model" / "model.safetensors").exists()
    assert (out / ".smolrl.lock").read_text() == ""  # (released at the end)


def test_a_filesystem_without_locks_is_a_warning(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl
    from run_folder import lock_out, release_out

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock_out(tmp_path)
    release_out(tmp_path)
    assert capsys.readouterr().out.startswith(
        f"warning: --out {tmp_path}: its filesystem cannot lock files (No locks available)")


def test_superseded_keeps_the_newest_and_never_what_a_run_reads_or_writes_in(tmp_path, capsys):
    """Every rerun moves a whole run to superseded/: it once grew until an export found no room.
    Now the newest --keep-superseded are kept and the oldest deleted, said on the first screen --
    never a folder holding something the run's flags name (here its --model), nor one another
    run holds as its --out, nor one whose name is not a move's."""
    import grpo
    from run_folder import lock_out, release_out
    from session import open_run, resume_driver, start_log
    out = tmp_path / "out"
    stamps = [f"20260101-00000{i}" for i in range(1, 5)]
    for stamp in stamps + ["notes"]:
        (out / "superseded" / stamp / "model").mkdir(parents=True)
        (out / "superseded" / stamp / "model" / "config.json").write_text("{}")
    (out / "model").mkdir()  # (a run to move: a fifth folder)
    (out / "model" / "config.json").write_text("{}")
    (out / "grpo_config.json").write_text("{}")
    lock_out(out / "superseded" / stamps[1])  # (a run writes there: its --out)
    try:
        cfg = grpo.Config(out=str(out), keep_superseded=2, data="arith",
                          model=str(out / "superseded" / stamps[0] / "model"))
        folder = open_run(cfg)
        resume_driver(folder)
        start_log(folder, cfg)
    finally:
        release_out(out / "superseded" / stamps[1])
    kept = sorted(p.name for p in (out / "superseded").iterdir())
    assert kept[:3] == [stamps[0], stamps[1], stamps[3]] and kept[4] == "notes"
    assert f"{out / 'superseded'} keeps its newest 2 (--keep-superseded): {stamps[2]} deleted" \
        in capsys.readouterr().out
    cfg.keep_superseded = 0  # (keeps all)
    folder = open_run(cfg)
    resume_driver(folder)
    start_log(folder, cfg)
    assert len(list((out / "superseded").iterdir())) == 6


def _free(monkeypatch, free: int):
    """The disk --out is on, with `free` bytes free."""
    from types import SimpleNamespace
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(
        total=usage.total, used=usage.total - free, free=free))


def test_a_disk_without_room_for_the_model_stops_the_run_before_it_loads(tiny_model_dir,
                                                                         tmp_path, monkeypatch):
    """A run whose export (or checkpoint) would not fit on the disk stops before training, in
    one line that says how much it needs and what superseded/ holds (a fourth rerun's export once
    failed for lack of room: its trained model was lost); what pruning superseded/ will free
    counts as room. The flag it suggests works as written (it said "a smaller
    --keep-superseded" to a run passing 0, which keeps all)."""
    from conftest import run_script
    weights = (Path(tiny_model_dir) / "model.safetensors").stat().st_size
    out = tmp_path / "out"
    (out / "superseded" / "20260101-000001" / "model").mkdir(parents=True)
    with open(out / "superseded" / "20260101-000001" / "model" / "big", "wb") as f:
        f.truncate(4 * weights)  # (sparse: only its size counts)
    _free(monkeypatch, weights)
    result = run_script("grpo.py", small_run_args(tiny_model_dir, out) + [
        "--steps", "1", "--save-every", "1", "--keep-superseded", "0"])
    mib = f"{weights / 2**20:.0f} MiB"
    assert result.returncode != 0 and "Loading weights" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --out {out}: {mib} free on its disk, and this run writes "
        f"{4 * weights / 2**20:.0f} MiB ({mib} for its model, {3 * weights / 2**20:.0f} MiB for "
        f"a checkpoint); make room, or choose another --out; {out / 'superseded'} holds "
        f"{4 * weights / 2**20:.0f} MiB of earlier runs (delete what you no longer need there, "
        f"or pass --keep-superseded 1: 0 keeps all) (nothing was changed)")
    import grpo
    from session import open_run
    (out / "grpo_config.json").write_text("{}")  # (a run to move aside: the old folder is to go)
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}")
    open_run(grpo.Config(out=str(out), model=tiny_model_dir, data="arith", save_every=1,
                         keep_superseded=1))
    _free(monkeypatch, 2 * weights)
    open_run(grpo.Config(out=str(out), model=tiny_model_dir, data="arith"))  # (no checkpoints)


def test_an_out_holding_what_no_run_wrote_is_refused_not_moved(tmp_path):
    """`--out .` in a project folder that holds the user's own wandb/, another framework's
    checkpoints/ and a model/ of theirs, but no run's config: a run once took them for an earlier
    run, moved them to superseded/ and, two reruns later, deleted them (--keep-superseded). Now
    it stops in one line before any model loads, and changes nothing."""
    import grpo
    from session import open_run
    out = tmp_path / "project"
    for name in ("wandb/offline-run-1/run.wandb", "checkpoints/checkpoint-500/model.bin",
                 "model/config.json", "notes.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    before = _files(out)
    with pytest.raises(SystemExit, match=rf"^error: --out {out} holds checkpoints, model, wandb, "
                                         rf"but no smolrl run's config \(a \*_config.json\): not an earlier run"):
        open_run(grpo.Config(out=str(out), model="unused", data="arith"))
    assert _files(out) == before and not (out / "superseded").exists()


def test_the_run_a_rerun_moves_aside_is_never_the_one_pruned(tmp_path, capsys):
    """superseded/ keeps the newest folders by their names, the local time of their move: folders
    named ahead of this machine's clock (another host's time zone on a shared disk, the hour a
    clock goes back) made the earlier run just moved aside the "oldest", deleted a moment after
    its move. Now the run never prunes the folder it has just moved (superseded/ holds one more
    for a while)."""
    import grpo
    from session import open_run, resume_driver, start_log
    out = tmp_path / "out"
    for stamp in ("20991231-000001", "20991231-000002"):
        (out / "superseded" / stamp / "model").mkdir(parents=True)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_text("weights")
    earlier = _earlier_run(out, str(tmp_path / "m"))
    cfg = grpo.Config(out=str(out), keep_superseded=2, data="arith", model="unused")
    folder = open_run(cfg)
    resume_driver(folder)
    start_log(folder, cfg)
    [moved] = [p for p in (out / "superseded").iterdir() if not p.name.startswith("2099")]
    assert _files(moved) == earlier and "deleted" not in capsys.readouterr().out


def _held_by_another_process(folder: Path):
    """A run of another process holding `folder` as its --out (its lock, as run_folder takes it):
    the process, to be killed."""
    import subprocess
    import sys
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(folder / '.smolrl.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, b'{\"pid\": 1, \"host\": \"h\", \"since\": \"then\", \"command\": \"b\"}')\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_run_never_moves_nor_writes_over_another_runs_folder_inside_its_own(tmp_path):
    """Run B with --out X/model inside run A's X, both running: A's export replaced X/model whole
    (B's config and samples deleted; B's metrics, checkpoints and model went on into A's exported
    model), and a rerun into X moved B's live folder aside. Now a run refuses an --out inside a
    folder a run holds, and a rerun refuses to move a folder a run holds; nothing is changed."""
    import grpo
    from session import open_run
    x = tmp_path / "x"
    (x / "model").mkdir(parents=True)
    for name in ("grpo_config.json", "metrics.jsonl", "model/grpo_config.json"):
        (x / name).write_text("{}")
    before = _files(x)
    b = _held_by_another_process(x / "model")
    try:
        with pytest.raises(SystemExit, match=rf"^error: {x / 'model'} is the --out of a run that "
                                             rf"is running \(pid 1 on h, since then: b\)"):
            open_run(grpo.Config(out=str(x), model="unused", data="arith"))
    finally:
        b.kill()
        b.wait()
    assert _files(x) == before and not (x / "superseded").exists()
    y = tmp_path / "y"  # (a run that has not written its config yet: loading its models)
    y.mkdir()
    a = _held_by_another_process(y)
    try:
        with pytest.raises(SystemExit, match=rf"^error: --out {y / 'model'} lies in {y}, the --out "
                                             rf"of a run that is running \(pid 1 on h"):
            open_run(grpo.Config(out=str(y / "model"), model="unused", data="arith"))
        open_run(grpo.Config(out=str(y / "sft"), model="unused", data="arith"))  # (beside: fine)
    finally:
        a.kill()
        a.wait()
    assert not (y / "model").exists()


def test_an_empty_checkpoints_link_made_for_a_run_is_left_where_it_is(tmp_path):
    """`ln -s /scratch/run out/checkpoints` before the first run (checkpoints on a bigger disk):
    an empty folder holds nothing of an earlier run, so it is neither moved aside (the run's
    checkpoints then went to the small disk) nor taken for a folder of the user's own."""
    import grpo
    from session import open_run
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    (out / "checkpoints").symlink_to(scratch)
    assert open_run(grpo.Config(out=str(out), model="unused", data="arith")).aside == []


def test_runs_stopped_before_they_saved_weights_never_push_a_trained_model_out(tmp_path,
                                                                             capsys):
    """A finished run, then two reruns stopped before they saved any weights (Ctrl-C, a crash
    at step 1: their metrics, config and samples alone), then a run: the two stopped ones
    counted as runs, and the third rerun deleted the finished run's trained model. Now
    --keep-superseded counts the folders that hold weights (a model/, checkpoints/); the others,
    logs alone, are kept."""
    import grpo
    from session import open_run, resume_driver, start_log
    out = tmp_path / "out"
    (out / "superseded" / "20260101-000001" / "model").mkdir(parents=True)  # (the trained one)
    for stamp in ("20260101-000002", "20260101-000003"):
        (out / "superseded" / stamp).mkdir()
        (out / "superseded" / stamp / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "grpo_config.json").write_text("{}")
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}")  # (a run that finished)
    cfg = grpo.Config(out=str(out), keep_superseded=2, data="arith", model="unused")
    folder = open_run(cfg)
    resume_driver(folder)
    start_log(folder, cfg)
    assert (out / "superseded" / "20260101-000001" / "model").is_dir()
    assert len(list((out / "superseded").iterdir())) == 4 and "deleted" not in \
        capsys.readouterr().out


def test_a_process_that_runs_again_into_a_remade_out_locks_it_anew(tmp_path):
    """A notebook's run stopped with an error (its process keeps the lock), the user deleted
    --out and ran again: the run took the kept lock of the deleted folder for its own, and the
    new folder had none -- a second run into it was not stopped. Now it locks the folder there."""
    import subprocess
    import sys
    from run_folder import lock_out, release_out
    out = tmp_path / "out"
    out.mkdir()
    lock_out(out)
    shutil.rmtree(out)
    out.mkdir()
    lock_out(out)
    try:
        other = subprocess.run([sys.executable, "-c", (
            "import fcntl, os\n"
            f"fd = os.open({str(out / '.smolrl.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n")], capture_output=True, text=True)
    finally:
        release_out(out)
    assert "BlockingIOError" in other.stderr


def test_an_out_inside_a_run_folders_model_or_superseded_is_refused(tmp_path):
    """`--model X/model --out X/model` (fine-tuning a run's model "in place"): once that run was
    continued (--resume auto), its export replaced X/model whole and deleted the second run --
    its model, metrics and samples -- without a word. A run's model/, checkpoints/, superseded/
    (and its trackers' folders) are the run's to replace, move and prune: an --out inside them
    is refused in one line, and nothing is written."""
    import grpo
    from session import open_run
    x = tmp_path / "x"
    (x / "model").mkdir(parents=True)
    (x / "grpo_config.json").write_text("{}")
    (x / "model" / "config.json").write_text("{}")
    before = _files(x)
    for inside in (x / "model", x / "superseded" / "20260101-000001", x / "checkpoints" / "a"):
        with pytest.raises(SystemExit, match=rf"^error: --out {inside} lies in "
                                             rf"{x / inside.relative_to(x).parts[0]}, which the "
                                             rf"run in {x} replaces"):
            open_run(grpo.Config(out=str(inside), model="unused", data="arith"))
    assert _files(x) == before and not any(p.name == ".smolrl.lock" for p in x.rglob("*"))
    open_run(grpo.Config(out=str(x / "sft"), model="unused", data="arith"))  # (beside: fine)


def test_a_run_killed_inside_its_export_keeps_the_model_it_wrote(tmp_path):
    """model.replace_folder renames the old model/ aside, then the new one -- written whole by
    then -- into place: a kill between the two left no model/, the old one in .old-model-*/ and
    the trained one in .model-*/. The next run into --out once put the old model back and deleted
    the trained one (a run extended from step 2 to 3 then held step 3's metrics beside step 2's
    model, and step 3's was gone): now it finishes the swap, saying so, and deletes every
    half-written copy (a checkpoint's)."""
    from run_folder import recover_export
    out = tmp_path / "out"
    (out / ".old-model-abcd1234/model").mkdir(parents=True)
    (out / ".old-model-abcd1234/model/config.json").write_text("old")
    (out / ".model-wxyz5678").mkdir()
    (out / ".model-wxyz5678/config.json").write_text("trained")
    (out / "checkpoints/..tmp-step_4-q1w2e3r4").mkdir(parents=True)
    (out / "checkpoints/step_2").mkdir()
    (out / "grpo_config.json").write_text("{}")
    said = recover_export(out)
    assert said.startswith(f"{out / 'model'}: a run was stopped between the two renames of its "
                           f"export; the model it had written whole is put in place")
    assert (out / "model/config.json").read_text() == "trained"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "grpo_config.json", "model"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_2"]
    # No new one beside it (stopped before it was written): the old one goes back
    (out / ".old-model-efgh9012").mkdir()
    (out / "model").rename(out / ".old-model-efgh9012/model")
    assert recover_export(out).startswith(f"{out / 'model'} put back")
    assert (out / "model").is_dir() and not (out / ".old-model-efgh9012").exists()
    # A swap that finished: the new model/ stays, the old one's remains go, nothing is said
    (out / ".old-model-ijkl3456/model").mkdir(parents=True)
    assert recover_export(out) == "" and not (out / ".old-model-ijkl3456").exists()
    assert (out / "model/config.json").exists()


def test_what_looks_like_an_exports_remains_in_a_folder_no_run_wrote_is_left_alone(tmp_path):
    """`--out .` in a project holding the user's .model-cache/ and .old-model-backup/model: the
    run took them for an export's remains -- deleted the cache, made the backup ./model and
    deleted the rest of it -- and then refused the folder, saying "nothing was changed". Now
    only a run's folder (its *_config.json) is recovered, and only names as an export makes
    them."""
    import grpo
    from run_folder import recover_export
    from session import open_run
    out = tmp_path / "project"
    for name in (".model-cache/weights.bin", ".old-model-backup/model/config.json",
                 ".old-model-backup/notes.txt", "checkpoints/..tmp-step_1-mine/x", "notes.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    before = _files(out)
    with pytest.raises(SystemExit, match=r"^error: --out .* holds checkpoints, but no smolrl"):
        open_run(grpo.Config(out=str(out), model="unused", data="arith"))
    assert _files(out) == before
    (out / "grpo_config.json").write_text("{}")  # (a run's folder: names not an export's kept)
    assert recover_export(out) == "" and _files(out, skip=("grpo_config.json",)) == before


def test_runs_stopped_inside_their_first_checkpoint_never_push_a_trained_model_out(tmp_path,
                                                                                 capsys):
    """A finished run, then two reruns stopped while they wrote their first checkpoint (a full
    disk, Ctrl-C, a preempted job: checkpoints/.tmp-step_1 half written, nothing to resume from),
    then a run: the two counted as folders with weights, and the third rerun deleted the
    finished run's trained model. Only a model/ or a complete checkpoint counts."""
    import grpo
    from session import open_run, resume_driver, start_log
    out = tmp_path / "out"
    (out / "superseded" / "20260101-000001" / "model").mkdir(parents=True)  # (the trained one)
    for stamp in ("20260101-000002", "20260101-000003"):
        (out / "superseded" / stamp / "checkpoints" / ".tmp-step_1").mkdir(parents=True)
        (out / "superseded" / stamp / "checkpoints" / ".tmp-step_1" / "model.safetensors"
         ).write_text("half")
        (out / "superseded" / stamp / "grpo_config.json").write_text("{}")
    (out / "grpo_config.json").write_text("{}")
    (out / "checkpoints" / ".tmp-step_1").mkdir(parents=True)  # (a third, to move aside)
    cfg = grpo.Config(out=str(out), keep_superseded=2, data="arith", model="unused")
    folder = open_run(cfg)
    resume_driver(folder)
    start_log(folder, cfg)
    assert (out / "superseded" / "20260101-000001" / "model").is_dir()
    assert len(list((out / "superseded").iterdir())) == 4 and "deleted" not in \
        capsys.readouterr().out


def test_an_out_that_cannot_be_made_is_one_line(tmp_path):
    """`--out notes.txt/run` (a file where a folder must be made), or a folder the user cannot
    write in: a NotADirectoryError or PermissionError traceback. Now one line, before anything."""
    import grpo
    from session import open_run
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt" / "run", tmp_path / "notes.txt" / "run" / "deeper"):
        with pytest.raises(SystemExit, match=rf"^error: --out {out}: cannot make that folder "
                                             rf"\(Not a directory\); choose another --out"):
            open_run(grpo.Config(out=str(out), model="unused", data="arith"))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_superseded_folder_on_another_disk_is_refused_before_the_models_load(tmp_path,
                                                                               monkeypatch):
    """<out>/superseded a mount of a bigger disk (its runs pile up): a rerun moved the run before
    it there with a rename, and stopped with OSError: Invalid cross-device link once its models
    had loaded. Now one line, at once, and nothing is changed."""
    import os
    import grpo
    from session import open_run
    out, model = tmp_path / "out", tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    earlier = _earlier_run(out, str(model))
    (out / "superseded").mkdir()
    real = os.lstat

    def lstat(path, *args, **kwargs):  # (superseded/ a mount point: a device of its own)
        st = real(path, *args, **kwargs)
        if Path(path) == out / "superseded":
            return os.stat_result((st[0], st[1], st.st_dev + 1, *tuple(st)[3:]))
        return st
    monkeypatch.setattr(os, "lstat", lstat)
    with pytest.raises(SystemExit, match=rf"^error: {out / 'superseded'} lies on another "
                                         rf"filesystem than {out}"):
        open_run(grpo.Config(out=str(out), model="unused", data="arith"))
    assert _files(out) == earlier


def test_the_room_check_counts_a_model_saved_in_two_formats_once(tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    """A hub snapshot holds its weights twice, model.safetensors and pytorch_model.bin (the
    loader takes the first): the room check counted both, and refused a run the disk had room
    for -- with no way past it. Now the safetensors alone are counted where there are any."""
    import grpo
    from session import open_run
    both = tmp_path / "both"
    shutil.copytree(tiny_model_dir, both)
    shutil.copy(both / "model.safetensors", both / "pytorch_model.bin")
    weights = (both / "model.safetensors").stat().st_size
    _free(monkeypatch, weights * 3 // 2)
    open_run(grpo.Config(out=str(tmp_path / "out"), model=str(both), data="arith"))


def test_a_path_with_an_equals_sign_is_kept_whole(tmp_path):
    """A sweep's folder named lr=1e-5: --init-from runs/lr=1e-5/superseded/T/model was read as
    runs/lr, so pruning superseded/ did not know the run reads it and could delete it; as a
    --reward-model it became runs/lr at weight 1e-5. A `=` followed by a `/` is the path's; a
    folder whose own name ends in =number takes its weight written out (lr=1e-5=1)."""
    import grpo
    from reward import weighted
    from run_folder import read_paths
    model = tmp_path / "lr=1e-5" / "superseded" / "20260101-000000" / "model"
    model.mkdir(parents=True)
    cfg = grpo.Config(out=str(tmp_path / "o"), model="unused", data="arith",
                      init_from=str(model), reward_model=f"{tmp_path}/lr=1e-5=0.5")
    assert read_paths(cfg) == [model, tmp_path / "lr=1e-5"]
    assert weighted(f"{tmp_path}/lr=1e-5/rm, {tmp_path}/lr=1e-5=0.5,correctness=2,"
                    f"runs/a=b/r.py:fn,format") == [
        (f"{tmp_path}/lr=1e-5/rm", 1.0), (f"{tmp_path}/lr=1e-5", 0.5), ("correctness", 2.0),
        ("runs/a=b/r.py:fn", 1.0), ("format", 1.0)]
    (tmp_path / "rm_lr=1e-5").mkdir()  # (a sweep's reward model)
    assert weighted(f"{tmp_path}/rm_lr=1e-5", paths=True) == [(f"{tmp_path}/rm_lr=1e-5", 1.0)]
    assert weighted(f"{tmp_path}/rm_lr=1e-5") == [(f"{tmp_path}/rm_lr", 1e-5)]  # (a reward
    # function's name is never looked up on disk)
    (tmp_path / "rm_lr").mkdir()  # (and its sibling -- or a run's --out named like the item)
    with pytest.raises(SystemExit, match=rf"^error: {tmp_path}/rm_lr=1e-5: both the folder "
                                         rf"{tmp_path}/rm_lr=1e-5 and {tmp_path}/rm_lr at weight "
                                         rf"1e-5 exist: write {tmp_path}/rm_lr=1e-5=1 for the "
                                         rf"one, {tmp_path}/rm_lr/=1e-5 for the other$"):
        weighted(f"{tmp_path}/rm_lr=1e-5", paths=True)
    assert weighted(f"{tmp_path}/rm_lr/=1e-5,{tmp_path}/rm_lr=1e-5=1", paths=True) == [
        (f"{tmp_path}/rm_lr/", 1e-5), (f"{tmp_path}/rm_lr=1e-5", 1.0)]


def test_what_would_not_move_aside_is_refused_before_the_models_load(tmp_path, monkeypatch):
    """set_aside's first move failing after the models loaded -- an evaluation's whole work lost
    with it -- is said first, in one line: superseded/ a file or a link (to another disk), a
    folder this user may not write in (--out's, a resumed branch's checkpoints/, a folder to
    move). A folder to move that is a link moves as a link: its target's rights do not count."""
    import run_folder
    from run_folder import check_movable
    denied = set()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) not in denied and
                        real_access(path, mode, **kw))
    out = tmp_path / "out"
    (out / "checkpoints" / "step_4").mkdir(parents=True)
    (out / "results.json").write_text("{}")
    elsewhere = tmp_path / "shared-model"
    elsewhere.mkdir()
    (out / "model").symlink_to(elsewhere)
    moving = [out / "results.json", out / "model", out / "checkpoints" / "step_4"]
    denied.add(elsewhere)  # (a read-only model linked in: the link moves, not the model)
    check_movable(out, moving)
    start = f"error: --out {out} holds an earlier run's or evaluation's results.json, model, " \
            f"step_4, which it would move aside, but "
    for folder in (out, out / "checkpoints", out / "checkpoints" / "step_4"):
        denied.clear()
        denied.add(folder)
        with pytest.raises(SystemExit) as stop:
            check_movable(out, moving)
        assert str(stop.value) == f"{start}this user (uid {os.geteuid()}) may not write in " \
                                  f"{folder}: choose another --out"
    denied.clear()
    for kind in ("file", "link"):
        (out / "superseded").write_text("") if kind == "file" else \
            (out / "superseded").symlink_to(tmp_path)
        with pytest.raises(SystemExit) as stop:
            check_movable(out, moving)
        assert str(stop.value) == f"{start}{out / 'superseded'} is not a folder of its own (a " \
                                  f"file or a link: move it away): choose another --out"
        (out / "superseded").unlink()
    check_movable(out, moving)
    (out / "superseded").mkdir()  # (a bind mount of the same disk: one st_dev, yet rename fails)
    monkeypatch.setattr(run_folder, "mount_points", lambda: {os.path.realpath(out / "superseded")})
    with pytest.raises(SystemExit) as stop:
        check_movable(out, moving)
    assert str(stop.value) == f"{start}{out / 'superseded'} is a mount, which files cannot be " \
                              f"moved into or out of: choose another --out"

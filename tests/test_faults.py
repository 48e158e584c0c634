"""Faults a long run survives (issue 71, docs/long-runs.md): a signal -- SIGTERM from a scheduler,
Ctrl-C -- stops it after its step with a checkpoint and one line saying how to go on, a second
one at once, a step that outlasts the grace is given up; a disk that fills during a checkpoint
stops it in one line, the previous checkpoint whole. Every run here is a process of its own (the
signals and the file-size limit are a process's), its step 2 held (tests/rewards.py) so that the
signal lands inside it."""

import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint import find_checkpoint
from conftest import ROOT, TIMING, read_metrics, run_grpo, run_script, small_run_args


def args_for(model_dir, out, *extra) -> list[str]:
    """A three-step run of the tiny model whose reward holds step 2 (parity_held_at_step_2)."""
    args = small_run_args(model_dir, out) + ["--steps", "3", *extra]
    args[args.index("--reward") + 1] = "tests.rewards:parity_held_at_step_2"
    return args


def weights(run: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(run / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """The run uninterrupted: its metrics and its final weights."""
    out = tmp_path_factory.mktemp("straight")
    run_grpo(args_for(tiny_model_dir, out))
    return read_metrics(out), weights(out)


def assert_same_run(out: Path, straight):
    metrics, final = straight
    assert read_metrics(out) == metrics
    resumed = weights(out)
    assert resumed.keys() == final.keys()
    assert all(torch.equal(resumed[k], final[k]) for k in final)  # bit for bit


def start(args, log: Path, hold, **popen) -> subprocess.Popen:
    """python grpo.py ARGS, its stdout and stderr to `log`; hold: the file step 2 waits for, or
    "stuck" (it waits ten minutes). held(log) tells when step 2 has begun to wait."""
    return subprocess.Popen([sys.executable, "grpo.py", *args], cwd=ROOT,
                            env={**os.environ, "SMOLRL_TEST_HOLD": str(hold),
                                 "SMOLRL_TEST_HELD": f"{log}.held"},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, **popen)


def held(log: Path):
    """True once step 2 waits for its hold: a signal now lands inside step 2."""
    return Path(f"{log}.held").exists


def wait_for(proc, done, what: str, timeout: float = 300):
    """Poll done() until true; the test fails if the run ends first."""
    deadline = time.time() + timeout
    while not done():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the run ended (code {proc.poll()}) or timed out before {what}")
        time.sleep(0.05)


def step_logged(out: Path, step: int):
    def done():
        try:
            return any(json.loads(line)["step"] == step for line in
                       (out / "metrics.jsonl").read_text().splitlines())
        except (OSError, ValueError):  # (not there yet, or a line half written)
            return False
    return done


def lines(said: str) -> list[str]:
    """What a terminal shows, line by line (a progress bar redrawn with \\r ends a line too)."""
    return [line.strip() for line in said.replace("\r", "\n").splitlines() if line.strip()]


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def resume_command(args, script="grpo.py") -> str:
    return f"python {shlex.join([script, *args])} --resume auto"


def test_sigterm_checkpoints_the_step_and_the_resumed_run_is_exact(tiny_model_dir, tmp_path,
                                                                    straight, monkeypatch):
    """SIGTERM inside step 2 of a run that saves no checkpoints (--save-every 0): step 2 ends,
    is checkpointed, the run says so and how to go on in one line and exits 143 (128 + 15)
    without its final model; --resume auto then ends with the uninterrupted run's weights."""
    out, go, log = tmp_path / "run", tmp_path / "go", tmp_path / "log"
    args = args_for(tiny_model_dir, out)
    proc = start(args, log, go)
    wait_for(proc, held(log), "step 2")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    go.touch()
    code = proc.wait(timeout=120)
    seconds = time.monotonic() - signalled
    said = log.read_text()
    assert code == 128 + signal.SIGTERM, said[-3000:]
    assert "stopping after this step (signal 15); a second signal exits at once" in said
    assert (f"stopped after step 2 (signal 15): checkpoint {out / 'checkpoints/step_2'}; resume "
            f"with: {resume_command(args)}") in lines(said)
    assert "Traceback" not in said
    assert checkpoints(out) == ["step_2"] and not (out / "model").exists()
    # how the engine decoded, for the resumed run to decode alike (fp32: SMOLRL_DECODE=flash,
    # the suite's pin, grows the cache but never runs flash)
    assert json.loads((out / "checkpoints/step_2/grpo_config.json").read_text())["decoding"] == \
        "grow"
    print(f"SIGTERM to exit: {seconds:.1f} s")
    monkeypatch.delenv("SMOLRL_DECODE")  # (unpinned, the resumed run takes the recorded choice)
    said = run_grpo(args + ["--resume", "auto"]).stdout
    assert "decoding: matmuls on a cache grown in place (as the run chose: grow)" in said
    assert_same_run(out, straight)


def test_a_second_ctrl_c_ends_the_run_at_once(tiny_model_dir, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) inside a step that does not end: the run
    says it stops after the step; a second Ctrl-C ends it at once, killed by the signal, the
    checkpoint of step 1 whole and nothing half-written beside it."""
    out, log = tmp_path / "run", tmp_path / "log"
    proc = start(args_for(tiny_model_dir, out, "--save-every", "1"), log, "stuck",
                 start_new_session=True)
    wait_for(proc, held(log), "step 2")
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(proc, lambda: "a second signal exits at once" in log.read_text(), "the first line")
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == -signal.SIGINT
    assert time.monotonic() - signalled < 5
    assert checkpoints(out) == ["step_1"]


def test_an_offline_run_stops_after_its_step_and_resumes_exactly(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """sft.py's loop (session.offline_loop, dpo.py's and rm.py's too) stops as the RL loop does:
    SIGTERM inside step 1 -- sent by the step itself, in this process -- ends the step,
    checkpoints it (--save-every 0), exits 143 and hands the signals' handlers back; --resume
    auto then ends with the metrics of a run never stopped."""
    import sft
    from cli import parse_config
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + 1?"},
        {"role": "assistant", "content": f"The answer is {i + 1}."}]}) + "\n" for i in range(8)))
    common = ["--model", tiny_model_dir, "--data", str(rows), "--batch-size", "4", "--epochs",
              "1", "--lr", "1e-3", "--eval-every", "0", "--dtype", "fp32"]
    whole = sft.main(parse_config(sft.Config, common + ["--out", str(tmp_path / "whole")]))
    before, real_step = signal.getsignal(signal.SIGTERM), sft.optimizer_step

    def signalled(trainer, loss):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_step(trainer, loss)

    monkeypatch.setattr(sft, "optimizer_step", signalled)
    out = tmp_path / "cut"
    with pytest.raises(SystemExit) as stopped:
        sft.main(parse_config(sft.Config, common + ["--out", str(out)]))
    assert stopped.value.code == 128 + signal.SIGTERM
    assert checkpoints(out) == ["step_1"]
    assert signal.getsignal(signal.SIGTERM) == before
    monkeypatch.setattr(sft, "optimizer_step", real_step)
    resumed = sft.main(parse_config(sft.Config, common + ["--out", str(out), "--resume", "auto"]))
    strip = lambda rows: [{k: v for k, v in r.items() if not any(t in k for t in TIMING)}  # noqa
                          for r in rows]
    assert strip(resumed) == strip(whole) and [r["step"] for r in whole] == [1, 2]


@pytest.mark.parametrize("script", ["dpo", "rm"])
def test_builtin_pairs_are_sampled_again_as_the_run_recorded(script, tiny_model_dir, tmp_path,
                                                            capsys, monkeypatch):
    """dpo.py's and rm.py's --data builtin pairs come from the starting weights, sampled again
    when the run resumes: the checkpoint's config records how the engine decoded (fp32 under the
    suite's SMOLRL_DECODE=flash: grow), and the resumed run, unpinned, decodes so, untimed, says
    so, and ends with the uninterrupted run's metrics."""
    import importlib
    from cli import parse_config
    module = importlib.import_module(script)
    common = ["--model", tiny_model_dir, "--data", "builtin", "--builtin-problems", "10",
              "--builtin-samples", "2", "--batch-size", "2", "--steps", "3", "--eval-every", "0",
              "--lr", "1e-3", "--dtype", "fp32"]
    module.main(parse_config(module.Config, common + [
        "--save-every", "2", "--keep-last", "0", "--out", str(tmp_path / "a")]))
    step = tmp_path / "a" / "checkpoints" / "step_2"
    assert json.loads((step / f"{script}_config.json").read_text())["decoding"] == "grow"
    capsys.readouterr()
    monkeypatch.delenv("SMOLRL_DECODE")
    import attention
    monkeypatch.setattr(attention, "decode_times", lambda *a: pytest.fail("timed again"))
    module.main(parse_config(module.Config, common + ["--resume", str(step),
                                                      "--out", str(tmp_path / "b")]))
    said = capsys.readouterr().out
    assert "resuming from" in said and "(as the run chose: grow)" in said
    strip = lambda rows: [{k: v for k, v in r.items() if not any(t in k for t in TIMING)}  # noqa
                          for r in rows]
    assert strip(read_metrics(tmp_path / "a")) == strip(read_metrics(tmp_path / "b"))


def test_a_step_that_outlasts_the_grace_is_given_up_the_last_checkpoint_kept(tiny_model_dir,
                                                                             tmp_path):
    """--stop-grace 2: SIGTERM inside a step that does not end; 2 s later the run gives the step
    up in one line naming the checkpoint it keeps (step 1) and how to resume, and exits 143."""
    out, log = tmp_path / "run", tmp_path / "log"
    args = args_for(tiny_model_dir, out, "--save-every", "1", "--stop-grace", "2")
    proc = start(args, log, "stuck")
    wait_for(proc, held(log), "step 2")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    seconds = time.monotonic() - signalled
    said = log.read_text()
    assert code == 128 + signal.SIGTERM, said[-3000:]
    assert 2 <= seconds < 10
    assert lines(said)[-1] == (
        f"error: the step under way did not end, and save, within --stop-grace 2 s of signal "
        f"15: it is given up; the last checkpoint, {out / 'checkpoints/step_1'}, is whole: "
        f"resume with: {resume_command(args)}")
    assert checkpoints(out) == ["step_1"]


def test_a_ray_run_stops_after_its_step_though_its_workers_are_signalled(tiny_model_dir,
                                                                          tmp_path):
    """On Ray the driver alone stops the run: Ctrl-C reaches the driver's process group (the
    local Ray's own processes in it block SIGINT; the workers have groups of their own), and a
    scheduler that signals the job's processes sends the workers SIGTERM too (they ignore it).
    Here the driver's group gets SIGINT and every Ray worker SIGTERM: the driver finishes step 2,
    the trainer writes its half of the checkpoint, and the run exits 130 (128 + 2). (Ray's own
    processes -- the raylet, its agents -- end on SIGTERM, and the workers with them: a scheduler
    should signal the driver alone, docs/long-runs.md.)"""
    pytest.importorskip("ray")
    out, go, log = tmp_path / "run", tmp_path / "go", tmp_path / "log"
    args = args_for(tiny_model_dir, out, "--num-trainers", "1", "--num-engines", "1",
                    "--colocate", "--ray-address", "local")
    proc = start(args, log, go, start_new_session=True)
    wait_for(proc, held(log), "step 2")
    os.killpg(proc.pid, signal.SIGINT)
    for pid in [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
            if os.getsid(pid) == proc.pid and title.startswith((b"ray::Worker", b"ray::IDLE")):
                os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, FileNotFoundError):
            pass
    go.touch()
    code = proc.wait(timeout=120)
    said = log.read_text()
    assert code == 128 + signal.SIGINT, said[-3000:]
    assert (f"stopped after step 2 (signal 2): checkpoint {out / 'checkpoints/step_2'}; resume "
            f"with: {resume_command(args)}") in lines(said)
    assert checkpoints(out) == ["step_2"]
    assert find_checkpoint(out, "auto") == str(out / "checkpoints/step_2")  # whole: every file


def test_a_disk_that_fills_during_a_checkpoint_stops_in_one_line(tiny_model_dir, tmp_path,
                                                                  straight):
    """A run resumed from step 1 under a file-size limit (ulimit -f) too small for step 2's
    checkpoint -- for its weights, where the safetensors writer fails (SafetensorError), then
    for its optimizer state alone, where torch.save fails (RuntimeError) -- stops in one line
    naming the checkpoint, the limit and the previous checkpoint, whole; nothing of step 2's is
    left, and resuming from step 1 ends with the uninterrupted run's weights. (In this process,
    under a soft limit raised again after: Python ignores SIGXFSZ, so a write past the limit
    fails with EFBIG rather than ending the process.)"""
    out = tmp_path / "run"
    args = args_for(tiny_model_dir, out, "--save-every", "1")
    run_grpo(args + ["--steps", "1"])
    model = (out / "checkpoints/step_1/model.safetensors").stat().st_size
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for limit in (1 << 20, model + (4 << 20)):  # the weights' file, then trainer_state.pt's
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            result = run_script("grpo.py", [*args, "--resume", "auto"])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert result.returncode == 1, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        line = lines(result.stderr)[-1]
        assert line.startswith(f"error: checkpoint {out / 'checkpoints/step_2'} could not be "
                               f"written ("), line
        assert f"files of at most {limit / 2**20:.0f} MiB (ulimit -f)" in line
        assert line.endswith(f"nothing of it is kept. The previous checkpoint, "
                             f"{out / 'checkpoints/step_1'}, is whole: make room, then resume "
                             f"with: {resume_command(args, str(ROOT / 'grpo.py'))}")
        assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]
        assert find_checkpoint(out, "auto") == str(out / "checkpoints/step_1")
    run_grpo(args + ["--resume", "auto"])
    assert_same_run(out, straight)


def test_a_run_that_fails_after_a_signal_leaves_no_grace_timer_and_the_handlers_before_it(
        tiny_model_dir, tmp_path, monkeypatch):
    """In a process that goes on (a notebook, whose "interrupt" is SIGINT): a signal inside a
    step that then fails. The error reaches the caller as it is, and the run leaves nothing
    armed behind it: no grace timer that would end the process --stop-grace seconds later, as
    a step given up, and the signals' handlers from before the run back (a second signal had
    left SIGINT at the kernel's default, which kills the process instead of interrupting it)."""
    import sft
    import stopping
    from cli import parse_config
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + 1?"},
        {"role": "assistant", "content": f"The answer is {i + 1}."}]}) + "\n" for i in range(4)))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def interrupted_then_failed(trainer, loss):
        os.kill(os.getpid(), signal.SIGINT)
        raise RuntimeError("out of memory (a test's)")

    monkeypatch.setattr(sft, "optimizer_step", interrupted_then_failed)
    cfg = parse_config(sft.Config, ["--model", tiny_model_dir, "--data", str(rows), "--batch-size",
                                    "4", "--epochs", "1", "--eval-every", "0", "--dtype", "fp32",
                                    "--stop-grace", "30", "--out", str(tmp_path / "run")])
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            sft.main(cfg)
        timer = stopping._state["timer"]
        assert timer is None or not timer.is_alive()
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        stopping.release_stop_signals()  # (a failed check: not this process's end 30 s later)
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.parametrize("grace", [float("inf"), 1e12])
def test_a_grace_beyond_any_timer_is_no_limit(grace, monkeypatch):
    """--stop-grace inf (or one past what a timer can wait) is no limit, as 0 is: the signal is
    taken, with no traceback from the timer's thread in the middle of the run's output."""
    import threading
    import stopping
    failed = []
    monkeypatch.setattr(threading, "excepthook", failed.append)
    before = {s: signal.getsignal(s) for s in stopping.SIGNALS}
    stopping.catch_stop_signals(grace, lambda signum: failed.append("given up"))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)
        assert stopping.asked() == signal.SIGTERM and failed == []
    finally:
        stopping.release_stop_signals()
    assert {s: signal.getsignal(s) for s in before} == before

"""benchmarks/gpu_check.py, CPU-sized: every part runs each algorithm's main as on the lent GPU,
with the packages that machine lacks unimportable here too, and a part cut short still shows what
it reached (issues 41 and 54)."""

import os
import subprocess
import sys
from pathlib import Path

# (after the repository: its modules come first, whatever a script is named)
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_every_part_runs_cpu_sized_without_the_lent_machines_missing_packages(tmp_path):
    # A sitecustomize first on PYTHONPATH, which every child inherits (gpu_check.start_forking): importing
    # these fails, and importlib.util.find_spec finds none, as where they are not installed.
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nsys.modules.update(dict.fromkeys({gpu_check.ABSENT!r}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert f"[prepare] absent here, as on the lent machine: {', '.join(gpu_check.ABSENT)}\n" in out
    n = len(gpu_check.PARTS)
    assert f"time budget: prepare {gpu_check.CPU_LIMIT} + grpo" in out
    assert f"{n} of {n} parts finished" in out
    rows = {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in (
        line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| "))}
    for part in gpu_check.PARTS:
        seconds, peak, _, tokens_per_s, tflops, _, longest, shared = rows[part]
        assert float(seconds) > 0 and float(peak) > 0 and float(tokens_per_s) > 0, rows[part]
        assert float(tflops) > 0, rows[part]
    # the long part's training forwards all ran each group's prompt once, prompt + completion long
    *_, longest, shared = rows["grpo-8k"]
    taken, forwards = map(int, shared.split("/"))
    assert taken == forwards >= 1 and int(longest) > gpu_check.LONG_PROMPT[True], rows["grpo-8k"]
    assert "[grpo-8k] prompt sharing: " in out
    # the runs' own lines come through as they come, under their part's name
    assert "[grpo] step    1 |" in out and "[sft-lora] step 0 | eval_accuracy" in out
    assert "[distill-7b] step    1 | teacher samples" in out and "[dpo] step 2 |" in out
    assert "[ppo] step    1 |" in out and "value loss" in out and "[rm] step 2 |" in out


def test_the_limits_add_up_to_less_than_eight_minutes_on_the_gpu():
    total = gpu_check.PREPARE_LIMIT + sum(gpu_check.LIMITS.values())
    assert total <= 480 - 10  # (10 s for the parent's own start and its table)
    line = gpu_check.budget(list(gpu_check.PARTS), gpu_check.LIMITS, gpu_check.PREPARE_LIMIT)
    assert line == "time budget: " + " + ".join(
        [f"prepare {gpu_check.PREPARE_LIMIT}"] + [f"{p} {s}" for p, s in gpu_check.LIMITS.items()]
    ) + f" = {total} s at most"
    for part, seconds in gpu_check.LIMITS.items():  # (as the module docstring says them)
        assert f"\n    {part:<16}{seconds:<4}" in gpu_check.__doc__, part
    assert f"preparation's {gpu_check.PREPARE_LIMIT} s" in gpu_check.__doc__
    assert f"add up to {total} s" in gpu_check.__doc__


def test_a_part_cut_short_still_shows_what_it_reached(capsys):
    code = "print('reached step 1', flush=True); import time; time.sleep(60)"
    result = gpu_check.stream("slow", exec, (code,), timeout=3)
    out = capsys.readouterr().out
    assert result is None
    assert "[slow] reached step 1" in out and "[slow] cut short after 3 s" in out


def test_a_process_that_cannot_be_forked_falls_back_to_a_fresh_interpreter(capsys, monkeypatch):
    """A part that finds CUDA initialised before its fork (its exit code BAD_FORK) runs again in
    a fresh interpreter (spawn), and so do the parts after it."""
    monkeypatch.setattr(gpu_check, "_start", ["forkserver"])
    code = "import multiprocessing, os; print(multiprocessing.get_start_method(), flush=True)"
    gpu_check.stream("bad", exec, (code + f"; os._exit({gpu_check.BAD_FORK})",), timeout=120)
    assert gpu_check._start == ["spawn"]
    gpu_check.stream("next", exec, (code,), timeout=120)
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "[bad] forkserver",
        "[bad] CUDA was initialised before the fork: this part and the rest start in fresh "
        "interpreters",
        "[bad] spawn",
        f"[bad] failed (exit code {gpu_check.BAD_FORK})",
        "[next] spawn"], out


def test_a_drawing_library_that_fails_to_import_is_not_preloaded(tmp_path, monkeypatch, capsys):
    """The forkserver passes over a preload's ImportError but dies of any other exception, and
    every part would then start in a fresh interpreter: matplotlib is preloaded only where this
    process imports it (MPLBACKEND=nonsense made pyplot's import raise a ValueError)."""
    import multiprocessing.forkserver as forkserver
    (tmp_path / "broken_drawing.py").write_text("raise ValueError('no such backend')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(gpu_check, "DRAWING", "broken_drawing")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # (start_forking sets the parts' own)
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules",
                        forkserver._forkserver._preload_modules)
    gpu_check.start_forking(["json"])
    assert forkserver._forkserver._preload_modules == ["json"]
    assert "broken_drawing not preloaded (ValueError: no such backend)" in capsys.readouterr().out
    monkeypatch.setattr(gpu_check, "DRAWING", "email.message")  # (any module that imports)
    gpu_check.start_forking(["json"])
    assert forkserver._forkserver._preload_modules == ["json", "email.message"]

"""benchmarks/gpu_check.py, CPU-sized: every part runs each algorithm's main as on the lent GPU,
and a part cut short still shows what it reached (issue 41)."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_every_part_runs_cpu_sized_and_reports_its_figures():
    run = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert f"{len(gpu_check.PARTS)} of {len(gpu_check.PARTS)} parts finished" in out
    for part in gpu_check.PARTS:
        row = next(line for line in out.splitlines() if line.startswith(f"| {part} |"))
        seconds, peak, _, tokens_per_s, tflops, _ = row.split("|")[2:-1]
        assert float(seconds) > 0 and float(peak) > 0 and float(tokens_per_s) > 0, row
        assert float(tflops) > 0, row
    # the runs' own lines come through as they come, under their part's name
    assert "[grpo] step    1 |" in out and "[sft-lora] step 0 | eval_accuracy" in out
    assert "[distill-7b] step    1 | teacher samples" in out and "[dpo] step 2 |" in out


def test_a_part_cut_short_still_shows_what_it_reached(capsys):
    code = "print('reached step 1', flush=True); import time; time.sleep(60)"
    result = gpu_check.stream("slow", [sys.executable, "-c", code], timeout=3)
    out = capsys.readouterr().out
    assert result is None
    assert "[slow] reached step 1" in out and "[slow] cut short after 3 s" in out

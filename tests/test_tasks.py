"""Tasks (data.TASKS): --data auto picks one, files with MATH's or GSM8K's schema get its answers
and settings, explicit flags win, and the math task runs end to end on a tiny Qwen2 model."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_script
from data import load_problems, task_summary
from grpo import Config

MATH_ROWS = [{"problem": f"Compute ${i} + {i}$.", "level": "Level 1", "type": "Algebra",
              "solution": f"We add: ${i} + {i} = \\boxed{{{2 * i}}}$."} for i in range(1, 41)]
GSM8K_ROWS = [{"question": f"Tom has {i} apples and buys 1000 more. How many now?",
               "answer": f"He has {i} + 1000 = {i + 1000}.\n#### {i + 1000:,}"} for i in range(30)]


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_auto_is_arith_for_the_offline_model_and_math_for_any_other():
    assert (Config().task, Config().data, Config().template) == ("arith", "arith", "answer-is")
    cfg = Config(model="Qwen/Qwen2.5-Math-1.5B")
    assert (cfg.task, cfg.data, cfg.split) == ("math", "DigitalLearningGmbH/MATH-lighteval", "train")
    assert (cfg.template, cfg.max_new_tokens, cfg.eval_data) == ("boxed", 1024,
                                                                 "HuggingFaceH4/MATH-500")
    assert "task math" in task_summary(cfg) and "MATH-500 (500)" in task_summary(cfg)
    # arith's short sequences train a step's 64 samples in one micro-batch; 1,024-token math in 16s
    assert (Config().micro_batch_size, cfg.micro_batch_size) == (64, 16)


def test_explicit_flags_win_over_the_task():
    cfg = Config(model="Qwen/Qwen2.5-Math-1.5B", max_new_tokens=512, lr=3e-6, template="raw",
                 eval_data="HuggingFaceH4/aime_2024")
    assert (cfg.max_new_tokens, cfg.lr, cfg.template, cfg.eval_data) == (512, 3e-6, "raw",
                                                                          "HuggingFaceH4/aime_2024")
    assert cfg.temperature == 1.0  # the rest still from the task
    assert Config(micro_batch_size=8).micro_batch_size == 8


def test_files_with_a_tasks_schema_get_its_answers(tmp_path):
    cfg = Config(data=_parquet(tmp_path / "math.parquet", MATH_ROWS), eval_every=1, eval_size=4)
    assert cfg.task == "math" and cfg.eval_data == ""  # a local file: its tail is held out
    train, held_out, columns = load_problems(cfg)
    assert {"problem", "solution", "answer"} <= columns
    assert [r["answer"] for r in held_out] == ["74", "76", "78", "80"]  # the last \boxed{}
    assert next(train)["answer"] in {str(2 * i) for i in range(1, 37)}

    cfg = Config(data=_parquet(tmp_path / "gsm8k.parquet", GSM8K_ROWS), eval_size=3)
    assert cfg.task == "gsm8k"
    _, held_out, _ = load_problems(cfg)
    assert [r["answer"] for r in held_out] == ["1027", "1028", "1029"]  # after ####, no comma
    assert held_out[0]["problem"].startswith("Tom has 27 apples")


@pytest.mark.parametrize("task, rows", [("math", MATH_ROWS), ("gsm8k", GSM8K_ROWS)])
def test_a_task_end_to_end_on_a_tiny_qwen2(task, rows, tmp_path, tokenizer):
    """`python grpo.py --model <tiny qwen2> --data <math parquet>`: task, template and evaluation
    chosen by themselves (the sizes are made small for a CPU test)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-qwen2"
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        dtype=torch.bfloat16)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = _parquet(tmp_path / f"{task}.parquet", rows)
    out = tmp_path / "run"
    # (in this process, as __main__: a fresh interpreter would import torch again, ~6 s a run)
    result = run_script("grpo.py", ["--model", str(model_dir), "--data", data, "--steps", "2",
                                    "--prompts-per-step", "2", "--num-generations", "2",
                                    "--max-new-tokens", "8", "--eval-every", "2",
                                    "--eval-size", "4", "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"task {task}: train on" in result.stdout and "template boxed" in result.stdout
    config = json.loads((out / "grpo_config.json").read_text())
    assert (config["task"], config["template"], config["temperature"]) == (task, "boxed", 1.0)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and "eval_accuracy" in records[-1]


@pytest.mark.parametrize("argv", [["--task", "maths"], ["--data", "auto", "--task", "nope"]])
def test_unknown_tasks_are_refused(argv):
    from cli import parse_config
    with pytest.raises(SystemExit):
        parse_config(Config, argv + ["--dry-run"])


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("rows, said", [
    (MATH_ROWS[:1] + [{"problem": "2+2?"}] + MATH_ROWS[1:], "row 2 has no 'solution' field"),
    (MATH_ROWS[:1] + [{"problem": "2+2?", "solution": "four"}],
     "row 2: its solution has no \\boxed{} answer"),
    (GSM8K_ROWS[:1] + [{"question": "2+2?"}], "row 2 has no 'answer' field"),
    (GSM8K_ROWS[:1] + [5], "row 2 is not a JSON object")])
def test_a_later_row_without_its_tasks_columns_is_named(rows, said, tmp_path):
    """The task is told from the first row; a later row that lacks what its answers are read from
    is one line naming it, not a KeyError."""
    cfg = Config(data=_jsonl(tmp_path / "rows.jsonl", rows), eval_size=1)
    with pytest.raises(SystemExit, match=re.escape(said)):
        load_problems(cfg)


def test_a_gsm8k_row_may_give_a_problem_and_a_math_row_an_answer(tmp_path):
    rows = GSM8K_ROWS[:20] + [{"problem": "2+2?", "answer": "#### 4"}]
    _, held_out, _ = load_problems(Config(data=_jsonl(tmp_path / "g.jsonl", rows), eval_size=1))
    assert held_out[-1]["problem"] == "2+2?" and held_out[-1]["answer"] == "4"
    rows = MATH_ROWS[:20] + [{"problem": "2+2?", "answer": "4"}]
    _, held_out, _ = load_problems(Config(data=_jsonl(tmp_path / "m.jsonl", rows), eval_size=1))
    assert held_out[-1]["answer"] == "4"


@pytest.mark.parametrize("content, name, said", [
    ("5\n", "num.jsonl", "row 1 is not a JSON object"),
    ("[1, 2]", "arr.json", "row 1 is not a JSON object"),
    ("not parquet", "fake.parquet", "not a Parquet file"),
    (None, "folder", "a folder, not a data file"),
    (None, "", "an empty data path")])
def test_data_that_is_not_rows_is_one_line(content, name, said, tmp_path):
    """Telling the task from the first row reads what it can; the loader names what it cannot
    (a folder -- save_to_disk's --, an empty name, a row that is no object, a file no format)."""
    path = tmp_path / name if name else None
    if content is not None:
        path.write_text(content)
    elif path is not None:
        path.mkdir()
    cfg = Config(data=str(path) if path else "")
    with pytest.raises(SystemExit, match=re.escape(said)):
        load_problems(cfg)

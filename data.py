"""The data every algorithm and evaluate.py share: problems, where they come from, and the prompt
the model sees for each.

A problem is a dict with at least `problem` (the question) and `answer` (the reference answer);
other fields travel along to reward functions. In this file, top to bottom:

- prompt templates (TEMPLATES): a problem as the user message, and the answer format graded;
- the built-in procedural tasks, offline, seeded, infinite -- `arith` (two-digit addition),
  `multiply` and `guess` (agentic) -- each with a fixed held-out slice training never samples,
  and the demonstrators whose transcripts warm-start the agentic ones (sft.py);
- the hub datasets users ask for most (HUB_DATASETS: where each keeps its problem and answer),
  and the task table (TASKS): a source of problems and the settings that go with it (--data);
- untrusted text as it is printed (escaped, printable), and InputError, the one line that stops
  a run on bad input;
- loading: a local `.jsonl` / `.json` / `.csv` / `.parquet` file with `problem` + `answer` (or
  `prompt` + `answer`) columns, or a Hugging Face dataset id, loaded with `datasets` (needs the
  network); checked row by row, streamed for training.
"""

import csv
import io
import itertools
import json
import random
import re
import typing
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Prompt templates. A template turns a problem into the user message, and names the answer format
# the reward looks for. The model's chat template (if any) is applied on top unless chat=False.

TEMPLATES = {
    # Short answers, graded on the number after "The answer is" (or the last number).
    "answer-is": ("{problem}\nReply with one sentence: The answer is <number>.", "answer-is"),
    # Chain of thought with a boxed final answer (DeepScaleR's prompt).
    "boxed": ("{problem}\nLet's think step by step and output the final answer within \\boxed{{}}.",
              "boxed"),
    # The problem alone, for base models or prompts that already say how to answer.
    "raw": ("{problem}", "boxed"),
}
Template = typing.Literal[tuple(TEMPLATES)]  # the type of a config's `template` field


def build_prompt(tokenizer, problem: str, template: str, chat: bool = True) -> str:
    """The exact text the model sees for `problem`."""
    text = TEMPLATES[template][0].format(problem=problem)
    if chat and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


def encode_prompts(tokenizer, rows, template: str, chat: bool = True) -> list[list[int]]:
    """Token ids of each row's prompt. A conversational row (TRL's format: `prompt` is a list of
    messages) goes through the chat template as it is; a string goes through `template` first."""
    ids = []
    for row in rows:
        if isinstance(row.get("prompt"), list):
            if not tokenizer.chat_template:
                raise InputError("conversational prompts need a model with a chat template")
            text, special = tokenizer.apply_chat_template(
                row["prompt"], tokenize=False, add_generation_prompt=True), False
        else:
            text = build_prompt(tokenizer, row["problem"], template, chat)
            # Chat templates contain the special tokens; plain text gets the tokenizer's own.
            special = not (chat and tokenizer.chat_template)
        ids.append(tokenizer(text, add_special_tokens=special)["input_ids"])
    return ids


# ---------------------------------------------------------------------------------------------
# The built-in task: a + b with two-digit a, b. Untrained SmolLM2-135M-Instruct gets ~15-25 % of
# these right greedily, and sampling at T=0.7 it is right often enough that most groups of 8 have
# a non-zero reward spread -- the signal GRPO needs.

ARITH_LO, ARITH_HI = 10, 99


def _arith_row(a: int, b: int) -> dict:
    return {"problem": f"What is {a} + {b}?", "answer": str(a + b), "id": f"{a}+{b}"}


def _is_heldout(a: int, b: int) -> bool:
    # A fixed 1-in-8 slice of all pairs, chosen by arithmetic rather than by RNG so that it is the
    # same in every run and every program: 1012 held-out pairs, 7088 training pairs.
    return (a * 7 + b * 13) % 8 == 0


def arith_heldout(n: int) -> list[dict]:
    pairs = [(a, b) for a in range(ARITH_LO, ARITH_HI + 1) for b in range(ARITH_LO, ARITH_HI + 1)
             if _is_heldout(a, b)]
    random.Random(1234).shuffle(pairs)
    return [_arith_row(a, b) for a, b in pairs[:n]]


def arith_stream(seed: int):
    """Infinite seeded stream of training problems, never from the held-out slice."""
    rng = random.Random(seed)
    while True:
        a, b = rng.randint(ARITH_LO, ARITH_HI), rng.randint(ARITH_LO, ARITH_HI)
        if not _is_heldout(a, b):
            yield _arith_row(a, b)


# Agentic tasks (env.py). `multiply`: 3-digit times 2- or 3-digit numbers, which a small model
# cannot do in its head, with a calculator tool. `guess`: find a number from 1 to 16 by guessing,
# told "higher" or "lower" each time (env.GuessTheNumber). Held-out problems: a fixed slice.


def _multiply_row(a: int, b: int) -> dict:
    return {"problem": f"What is {a} * {b}? Use the calculator.", "answer": str(a * b),
            "id": f"{a}*{b}"}


def multiply_stream(seed: int):
    rng = random.Random(seed)
    while True:
        a, b = rng.randint(100, 999), rng.randint(10, 999)
        if (a + 3 * b) % 16:  # (the held-out slice: (a + 3b) % 16 == 0)
            yield _multiply_row(a, b)


def multiply_heldout(n: int) -> list[dict]:
    rng, rows = random.Random(1234), []
    while len(rows) < n:
        a, b = rng.randint(100, 999), rng.randint(10, 999)
        if (a + 3 * b) % 16 == 0:
            rows.append(_multiply_row(a, b))
    return rows


def _guess_row(secret: int, index: int) -> dict:
    return {"problem": "I am thinking of a whole number from 1 to 16. Find it: call guess with "
                       "a number, and I will tell you if mine is higher or lower.",
            "secret": secret, "id": f"guess-{index}"}


def guess_stream(seed: int):
    rng = random.Random(seed)
    for index in itertools.count():
        yield _guess_row(rng.randint(1, 16), index)


def guess_heldout(n: int) -> list[dict]:
    return [_guess_row(1 + i % 16, i) for i in range(n)]  # every number equally often


# The procedural tasks: (training stream by seed, held-out rows by count).
GENERATED = {"arith": (arith_stream, arith_heldout), "multiply": (multiply_stream, multiply_heldout),
             "guess": (guess_stream, guess_heldout)}


# ---------------------------------------------------------------------------------------------
# Warm starts for the agentic tasks (sft.py). SmolLM2-135M-Instruct never writes a tool call, so
# GRPO has nothing to reinforce; a few minutes of SFT on transcripts teach it the format. The
# transcripts come from a *demonstrator* that writes the format exactly but plays weakly, so that
# after SFT the model acts, and GRPO still has the strategy to learn: a demonstrator that solved
# the task would leave RL nothing to show. Each transcript is a TRL conversational row
# ({"messages": [...]}), played against the task's real tools, which the caller passes in
# (`tools`: name -> function, for this row's episode; data.py imports nothing above it).

# multiply: the demonstrator always calls the calculator, but like someone estimating, it rounds
# the second factor down to tens (347 * 520 for 347 * 524) in 3 calls of 4 and reports what the
# calculator says. Its own accuracy is 25 % + 75 % x 1/10 (factors already ending in 0) = 32.5 %.
# Whether it estimates is a coin the model cannot see, so imitation learns how often, not when:
# the warm-started model calls the tool on every problem, writes the exact call on about half of
# them (greedy: 50 % of 64 held-out after `python sft.py`; sampled at T = 0.7: 48 % of GRPO's
# first episodes) and the estimate on the rest -- and the reward then selects the exact one.
MULTIPLY_ESTIMATES = 0.75


def multiply_demonstration(row: dict, rng: random.Random, tools: dict) -> list[dict]:
    a, b = row["id"].split("*")
    if rng.random() < MULTIPLY_ESTIMATES:
        b = b[:-1] + "0"
    expression = f"{a} * {b}"
    result = tools["calculator"](expression=expression)
    return [_call("calculator", {"expression": expression}), _result("calculator", result),
            {"role": "assistant", "content": f"The answer is {result}."}]


# guess: the demonstrator guesses a number drawn at random among those still possible (between
# the highest "higher" and the lowest "lower" so far): always consistent with the feedback, never
# bisecting. For 1..16 it takes 2 (1 + 1/16) H_16 - 3 = 4.18 guesses on average where bisection
# takes 3.375, and finds the number within the task's 4 guesses (max_turns 5: four calls and the
# final word) 58 % of the time where bisection does 94 %.
def guess_demonstration(row: dict, rng: random.Random, tools: dict) -> list[dict]:
    low, high, messages = 1, 16, []
    while True:
        number = rng.randint(low, high)
        feedback = tools["guess"](number=number)
        messages += [_call("guess", {"number": number}), _result("guess", feedback)]
        if feedback == "higher":
            low = number + 1
        elif feedback == "lower":
            high = number - 1
        else:  # found it
            return messages + [{"role": "assistant", "content": f"The number is {number}."}]


def _call(name: str, arguments: dict) -> dict:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _result(name: str, text: str) -> dict:
    return {"role": "tool", "name": name, "content": text}


DEMONSTRATORS = {"multiply": multiply_demonstration, "guess": guess_demonstration}


def demonstrations(task: str, n: int, seed: int, tools_for) -> list[dict]:
    """n transcripts of the task's demonstrator on its training problems (never the held-out
    ones), as TRL `messages` rows; tools_for(row) -> {name: function}: the tools of that row's
    episode (for guess, bound to a fresh environment reset with the row)."""
    # (the demonstrator's own draws: seeded like the stream, its guesses would be the secrets)
    stream, rng, rows = GENERATED[task][0](seed), random.Random(f"demonstrator {seed}"), []
    template = TEMPLATES[TASKS[task].template][0]
    for _ in range(n):
        row = next(stream)
        prompt = [{"role": "user", "content": template.format(problem=row["problem"])}]
        rows.append({"messages": prompt + DEMONSTRATORS[task](row, rng, tools_for(row)),
                     "id": row["id"]})
    return rows


# ---------------------------------------------------------------------------------------------
# Hub datasets: where each keeps its problem and its answer.

def _last_boxed(solution: str) -> str | None:
    from reward import extract_boxed  # reward.py imports nothing from smolrl: no cycle
    return extract_boxed(solution)


def _after_hashes(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


# The datasets users ask for most: hub id -> (config, default split, problem field, answer of a row).
HUB_DATASETS = {
    "DigitalLearningGmbH/MATH-lighteval": (None, "train", "problem",
                                           lambda r: _last_boxed(r["solution"])),
    "HuggingFaceH4/MATH-500": (None, "test", "problem", lambda r: str(r["answer"])),
    "openai/gsm8k": ("main", "test", "question", lambda r: _after_hashes(r["answer"])),
    "HuggingFaceH4/aime_2024": (None, "train", "problem", lambda r: str(r["answer"])),
    "agentica-org/DeepScaleR-Preview-Dataset": (None, "train", "problem", lambda r: str(r["answer"])),
}


# ---------------------------------------------------------------------------------------------
# Tasks: a source of problems and the settings that go with it. grpo.py's --data names a task or a
# source; every setting left unset on the command line comes from the task's row here.

@dataclass(frozen=True)
class Task:
    data: str  # where the training problems come from
    split: str  # which split of it
    template: str  # prompt template (TEMPLATES), which also names the answer format
    max_new_tokens: int
    temperature: float
    eval_data: str  # held-out set; "" = the tail of the training data
    eval_size: int
    lr: float
    steps: int
    micro_batch_size: int  # sequences per forward/backward: a step's whole batch when they are short
    eval_every: int  # steps between held-out evaluations
    reward: str = "correctness"  # reward functions (grpo.Config.reward)
    tools: str = ""  # agentic tasks: the tools the model may call (env.py)
    env: str = ""  # agentic tasks: the environment class
    max_turns: int = 4  # agentic tasks: assistant turns per episode


TASKS = {
    # two-digit addition, offline: what `python grpo.py` runs on the offline default model. 16
    # steps and 128 held-out problems: the run fits ~5 minutes on a 2-core AVX2 CPU, which
    # computes in fp32 (held-out accuracy +60 points; --steps 30 goes on to ~73 %)
    "arith": Task("arith", "", "answer-is", 24, 0.7, "arith", 128, 1e-5, 16, 64, 8),
    # MATH's 7,500 training problems (the answer: the solution's last \boxed{}), tested on
    # MATH-500 (drawn from MATH's test split): the R1-Zero-style experiment for Qwen2.5-Math
    "math": Task("DigitalLearningGmbH/MATH-lighteval", "train", "boxed", 1024, 1.0,
                 "HuggingFaceH4/MATH-500", 500, 1e-6, 300, 16, 10),
    # grade-school word problems (the answer: after ####), tested on GSM8K's test split
    "gsm8k": Task("openai/gsm8k", "train", "boxed", 512, 1.0, "openai/gsm8k", 1319, 1e-6, 300,
                  16, 10),
    # your own file or hub dataset: `problem`/`prompt` and `answer` columns (--prompt-field, ...)
    "custom": Task("", "", "answer-is", 24, 0.7, "", 256, 1e-5, 30, 16, 10),
    # agentic, offline: a calculator for 3-digit multiplication; a guessing game over turns, with
    # room for four guesses and the final word (bisection finds 15 numbers of 16 in four guesses;
    # guessing at random among the numbers still possible, 58 % of them). Episodes run to 300-400
    # tokens: 8 a micro-batch (a token's activations for the backward were ~0.8 MB on SmolLM2,
    # about half since recompute.py; multiply's GRPO stage peaked at 4.0 GB resident with 8, 5.0 GB with 16, at the same speed;
    # 64 episodes a micro-batch took 24 GB for guess, 18.9 GB for multiply's PPO)
    "multiply": Task("multiply", "", "answer-is", 48, 0.7, "multiply", 128, 1e-5, 16, 8, 8,
                     tools="calculator"),
    "guess": Task("guess", "", "raw", 48, 0.7, "guess", 64, 1e-5, 16, 8, 8, reward="",
                  env="env:GuessTheNumber", max_turns=5),
}


def task_of(data: str, model: str) -> str:
    """The task --data names: `auto` is arith for the offline default model and math for any other;
    a file whose columns look like MATH's (problem + solution) or GSM8K's (question + answer with
    ####) gets that task's settings; anything else is custom."""
    if data == "auto":
        return "arith" if model == "SmolLM2-135M-Instruct-GGUF" else "math"
    if data in TASKS:
        return data
    for name, task in TASKS.items():
        if data == task.data:
            return name
    first = _first_row(data)
    if first and "solution" in first and "answer" not in first and "\\boxed" in str(first["solution"]):
        return "math"
    if first and "question" in first and "####" in str(first.get("answer", "")):
        return "gsm8k"
    return "custom"


def apply_task(cfg) -> None:
    """Fill the settings a grpo.Config left unset (None) from its task's row: explicit flags win."""
    cfg.task = cfg.task or task_of(cfg.data, cfg.model)
    task = TASKS[cfg.task]
    if cfg.data in ("auto", cfg.task) and task.data:
        cfg.data, cfg.split = task.data, cfg.split or task.split
    local = Path(cfg.data).exists()  # a local file: the held-out set is its tail
    cfg.eval_data = cfg.eval_data or ("" if local and cfg.task not in GENERATED else
                                      task.eval_data)
    for name in ("template", "max_new_tokens", "temperature", "eval_size", "lr", "steps",
                 "micro_batch_size", "eval_every", "reward", "tools", "env", "max_turns"):
        if getattr(cfg, name) is None:
            setattr(cfg, name, getattr(task, name))


def task_summary(cfg) -> str:
    """The resolved task and its settings, in one line printed before anything loads."""
    held_out = (f"{cfg.eval_data} ({cfg.eval_size})" if cfg.eval_data else
                f"the data's tail (a tenth, at most {cfg.eval_size} rows)")
    split = f" ({cfg.split})" if cfg.split else ""
    return (f"task {cfg.task}: train on {cfg.data}{split}, evaluate on {held_out} | template "
            f"{cfg.template}, max_new_tokens {cfg.max_new_tokens}, temperature {cfg.temperature}, "
            f"lr {cfg.lr}, steps {cfg.steps}, rollout {cfg.rollout}, dtype {cfg.dtype} "
            f"({cfg.dtype_reason})")


def _first_row(source: str) -> dict | None:
    """The first row of a local file, cheaply (None for a hub id)."""
    path = Path(source)
    if not source or not path.is_file():
        return None
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq
            rows = pq.ParquetFile(path).read_row_group(0).slice(0, 1).to_pylist()
        else:
            rows = load_table(source)[:1]
    except (SystemExit, Exception):
        return None  # load_problems names the problem properly
    return rows[0] if rows and isinstance(rows[0], dict) else None


def prepare_rows(rows: list[dict], task: str, source: str = "") -> list[dict]:
    """Rows of a file with a task's hub schema get their answers as the hub mapping would; a row
    without what the mapping reads is named in one line (the task was told from the first row)."""
    if task not in ("math", "gsm8k"):
        return rows
    need = ("solution",) if task == "math" else ("question", "answer")
    out = []
    for i, r in enumerate(rows, start=1):
        if not isinstance(r, dict):
            raise InputError(f"{source}: row {i} is not a JSON object")
        # (a MATH row may give its answer instead of a solution; a GSM8K row a problem instead
        # of a question)
        missing = [f for f in need if r.get(f) is None and not (f == "solution" and r.get(
            "answer") or f == "question" and r.get("problem"))]
        if missing:
            raise InputError(f"{source}: row {i} has no '{missing[0]}' field (its first row has "
                             f"{task.upper()}'s columns: {', '.join(need)})")
        if task == "math":
            answer = r.get("answer") or _last_boxed(str(r["solution"]))
            if not answer:
                raise InputError(f"{source}: row {i}: its solution has no \\boxed{{}} answer "
                                 f"(and the row no 'answer' field)")
            out.append({**r, "answer": answer})
        else:
            out.append({**r, "problem": r.get("problem") or r["question"],
                        "answer": _after_hashes(str(r["answer"]))})
    return out


# ---------------------------------------------------------------------------------------------
# Untrusted text as it is printed, and the one line that stops a run on bad input.

def escaped(text) -> str:
    """text as a terminal may print it: each character that is not printable -- ESC, which starts
    the terminal's own commands (ESC ] 52 writes the clipboard), the other control characters, a
    newline, a right-to-left override, a lone surrogate -- as its Python escape (\\x1b, \\n,
    \\u202e). A dataset's, a log's or a model's text reaches the terminal through it."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def printable(text: str) -> str:
    """text with each lone surrogate -- os.fsdecode's stand-in for a byte of a name that is not
    UTF-8 -- as U+FFFD, the mark of a character that could not be read: a page and a PNG's
    title are UTF-8 (they failed on it)."""
    return re.sub("[\ud800-\udfff]", "\ufffd", text)


class InputError(SystemExit):
    """Bad input (a data file, an option value): exits with one line that names the file, the row
    and the field, or the flag (whatever it quotes escaped: one line, printable)."""

    def __init__(self, message: str):
        super().__init__(f"error: {escaped(message)}")


# ---------------------------------------------------------------------------------------------
# Problems from a file or a hub dataset, checked row by row; the streams training draws from.

def check_rows(rows: list[dict], source: str, prompt_field: str = "",
               answer_field: str = "answer", need_answers: bool = False) -> list[dict]:
    """Problems with a `problem` string for the prompt template -- from `prompt_field` (default:
    `problem`, else `prompt`), or, for TRL's conversational format, from chat messages kept as
    `prompt` -- and `answer` from `answer_field`. Answers are optional when no row has one (a
    reward function may not need them) unless need_answers; once one row has one, every row must."""
    if not rows:
        raise InputError(f"{source}: no rows")
    prompt_fields = [prompt_field] if prompt_field else ["problem", "prompt"]
    need_answers = need_answers or any(isinstance(r, dict) and r.get(answer_field) is not None
                                       for r in rows)
    out = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise InputError(f"{source}: row {i} is not a JSON object")
        value = next((row[f] for f in prompt_fields if row.get(f) is not None), None)
        if isinstance(value, list):  # conversational: [{"role": ..., "content": ...}, ...]
            if not value or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                    and m.get("role") for m in value):
                raise InputError(f"{source}: row {i}: the prompt is a list but not of "
                                 f"{{'role', 'content'}} messages")
            row = {**row, "prompt": value, "problem": value[-1]["content"]}
        elif isinstance(value, str) and value.strip():
            row = {**row, "problem": value}
        else:
            raise InputError(f"{source}: row {i} has no '{' (or '.join(prompt_fields)}"
                             f"{')' * (len(prompt_fields) - 1)} field")
        answer = row.get(answer_field)
        if need_answers and (answer is None or (isinstance(answer, str) and not answer.strip())):
            raise InputError(f"{source}: row {i} has no '{answer_field}' field")
        if answer is not None:
            row["answer"] = str(answer)
        row.setdefault("id", str(i - 1))
        out.append(row)
    return out


def load_table(source: str, split: str = "") -> list[dict]:
    """Raw rows of a .jsonl/.json/.csv/.parquet file, or of a hub dataset (mapped by HUB_DATASETS;
    others take `split`, default train)."""
    path = Path(source)
    if not source.strip():  # (an unset shell variable, a trailing comma: Path("") is ".")
        raise InputError("an empty data path or name (an unset variable, a trailing comma?)")
    if path.suffix in (".jsonl", ".json", ".csv", ".parquet") or path.exists():
        if not path.exists():
            raise InputError(f"{source}: no such file")
        if path.is_dir():
            raise InputError(f"{source}: a folder, not a data file (.jsonl, .json, .csv or "
                             f".parquet; a dataset saved by save_to_disk: write it out with "
                             f"its .to_json())")
        if path.suffix == ".parquet":
            rows = _parquet_rows(path, source)
        elif path.suffix == ".csv":
            rows = _csv_rows(path, source)
        elif path.suffix == ".json" and _text(path, source).lstrip().startswith("["):
            try:
                rows = json.loads(_text(path, source))
            except (ValueError, RecursionError) as e:
                why = f"{e.msg}, line {e.lineno}" if isinstance(e, json.JSONDecodeError) else \
                    _unreadable(e)
                raise InputError(f"{source}: not valid JSON ({why})") from None
        else:
            rows = []
            # (lines end at "\n" alone: a string may hold U+2028 or NEL, where splitlines cuts)
            for i, line in enumerate(_text(path, source).split("\n"), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except (ValueError, RecursionError) as e:
                    why = e.msg if isinstance(e, json.JSONDecodeError) else _unreadable(e)
                    raise InputError(f"{source}: line {i} is not valid JSON ({why})") from None
        if not rows:
            raise InputError(f"{source}: no rows")
        return rows
    return _load_hub(source, split)


def _text(path: Path, source: str) -> str:
    """A data file's text, UTF-8 (a byte-order mark left out); one line naming the line where its
    bytes are not UTF-8 (a CSV saved as Latin-1)."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"{source}: line {line} is not UTF-8 (byte 0x{data[e.start]:02x}); save "
                         f"it as UTF-8") from None


def _unreadable(e: Exception) -> str:
    """Why json.loads could not read valid JSON: a number past Python's 4,300 digits, or arrays
    nested deeper than its recursion goes."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0]


def _parquet_rows(path: Path, source: str) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq
    try:
        return pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        why = (str(e).splitlines() or [""])[0].rpartition("': ")[2][:200]  # (not the path again)
        raise InputError(f"{source}: not a Parquet file that pyarrow can read ({why})") from None


def _csv_rows(path: Path, source: str) -> list[dict]:
    """A CSV file's rows; one line naming the row where csv cannot read one (a field longer than
    csv's limit -- often an unclosed quote that swallowed the rest of the file -- or a NUL byte)."""
    rows = []
    with io.StringIO(_text(path, source), newline="") as f:
        try:
            for row in csv.DictReader(f):
                rows.append(row)  # row i of the error messages is data row i
        except csv.Error as e:
            where = f"{source}: row {len(rows) + 1}"
            if "field larger than field limit" in str(e):
                raise InputError(f"{where}: a field is longer than csv's limit of "
                                 f"{csv.field_size_limit():,} characters (an unclosed quote? a "
                                 f"long text belongs in a .jsonl file)") from None
            raise InputError(f"{where}: not valid CSV ({e})") from None
    return rows


def load_rows(source: str, limit: int | None = None, prompt_field: str = "",
              answer_field: str = "answer", split: str = "",
              need_answers: bool = False) -> list[dict]:
    """Problems of a file or a hub dataset, validated (check_rows). `arith`: its held-out set."""
    if source in GENERATED:
        return GENERATED[source][1](limit or 256)
    rows = load_table(source, split)
    return check_rows(rows[:limit] if limit else rows, source, prompt_field, answer_field,
                      need_answers)


def _load_hub(name: str, split: str = "") -> list[dict]:
    import datasets
    from model import hub_reachable
    offline = not hub_reachable()  # datasets would retry for half a minute before failing
    if offline:
        datasets.config.HF_HUB_OFFLINE = True  # a dataset downloaded before still loads
    try:
        if name not in HUB_DATASETS:
            return list(datasets.load_dataset(name, split=split or "train"))
        config, default_split, field, answer = HUB_DATASETS[name]
        ds = datasets.load_dataset(name, config, split=split or default_split)
    except Exception as e:  # no network, unknown id, gated dataset ...
        if offline:
            raise InputError(f"--data {name}: the Hugging Face hub cannot be reached and the "
                             f"dataset is not in the local cache; pass a local file (.jsonl, "
                             f".csv, .parquet) or run where the hub is reachable") from None
        raise InputError(f"could not load {name!r} as a file or a Hugging Face dataset: {e}") from None
    return [{**r, "problem": r[field], "answer": answer(r)} for r in ds]


def dataset_name(source: str) -> str:
    return Path(source).stem if Path(source).suffix else source.split("/")[-1]


class RowStream:
    """Infinite stream over `rows`: a fresh seeded shuffle every epoch. `rows` stays readable (the
    prompts' lengths are checked against the GPU memory plan: rl.check_prompt_room)."""

    def __init__(self, rows: list[dict], seed: int):
        self.rows, self._rows = rows, self._shuffled(rows, seed)

    @staticmethod
    def _shuffled(rows, seed):
        rng = random.Random(seed)
        while True:
            order = list(range(len(rows)))
            rng.shuffle(order)
            for i in order:
                yield rows[i]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self._rows)


def load_problems(cfg):
    """(an endless stream of training problems, the held-out problems, the data's column names) for
    a resolved GRPO config (cfg.task, cfg.data, ...): `arith` and its held-out pairs, or a file / hub
    dataset whose tail is held out unless there is an eval set."""
    if cfg.data in GENERATED:
        stream, heldout = GENERATED[cfg.data]
        first = next(stream(cfg.seed))
        train_rows, eval_rows = stream(cfg.seed), heldout(cfg.eval_size)
    else:
        rows = prepare_rows(load_table(cfg.data, cfg.split), cfg.task, cfg.data)
        rows = check_rows(rows, cfg.data, cfg.prompt_field, cfg.answer_field)
        first, eval_rows = rows[0], []
        # Hold out the tail of the training data for evaluation -- if it has answers to check.
        if not cfg.eval_data and cfg.eval_every and "answer" in first:
            n_eval = min(cfg.eval_size, len(rows) // 10)
            rows, eval_rows = rows[:len(rows) - n_eval], rows[len(rows) - n_eval:]
        train_rows = RowStream(rows, cfg.seed)
    if cfg.eval_data:  # (a hub id's default split: gsm8k's is test)
        own = cfg.task == "custom"  # a custom eval set is read with the training data's columns
        eval_rows = load_rows(cfg.eval_data, limit=cfg.eval_size, need_answers=True,
                              prompt_field=cfg.prompt_field if own else "",
                              answer_field=cfg.answer_field if own else "answer")
    return train_rows, eval_rows, set(first)


class ProblemStream:
    """Hands out problems from an endless stream and counts them: a checkpoint's data position."""

    def __init__(self, rows, skip: int = 0):
        self.rows, self.taken = itertools.islice(rows, skip, None), skip

    def take(self, n: int) -> list[dict]:
        out = list(itertools.islice(self.rows, n))
        self.taken += len(out)
        return out

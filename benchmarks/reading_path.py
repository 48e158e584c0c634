"""How much code a reader follows through one default GRPO training step.

    python benchmarks/reading_path.py            # a tiny random Llama, the default configuration
    python benchmarks/reading_path.py --all-files

Runs `grpo.main` for two steps with the default configuration (a tiny random model with the SmolLM2
tokenizer instead of the 135M one, so it takes seconds; a reward that gives groups signal, so the
step really trains), records every function of grpo.py, logprobs.py, model.py and hardware.py that
the second step calls -- directly or through other modules -- and prints their lines: all of them,
and the code lines (without docstrings, comments and blank lines). A reader reads a whole function,
branches not taken included; of a class, its fields and the methods the step calls. --all-files
counts every smolrl module the step passes through (trainer.py, rollout.py, reward.py, ...).
"""

import ast
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parity_reward(prompts, completions, **_):
    """A random model earns it about half the time: groups have signal, the step trains."""
    return [float(len(c) % 2) for c in completions]


def tiny_model(folder: Path) -> str:
    """A 2-layer Llama from a config (random weights) with the default model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from model import GGUF_FILE, GGUF_PACKAGE
    gguf_dir = importlib.util.find_spec(GGUF_PACKAGE).submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def code_lines(source_lines: list[str], first: int, last: int, skip: set[int]) -> int:
    """Lines first..last (1-based) that are neither blank, a comment, nor in `skip`."""
    return sum(1 for i in range(first, last + 1) if i not in skip
               and source_lines[i - 1].strip() and not source_lines[i - 1].strip().startswith("#"))


def docstring_lines(tree) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines |= set(range(first.lineno, first.end_lineno + 1))
    return lines


def span(node) -> tuple[int, int]:
    first = node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
    return first, node.end_lineno


def main(all_files: bool):
    import grpo
    files = sorted(str(p) for p in ROOT.glob("*.py")) if all_files else \
        [str(ROOT / f) for f in ("grpo.py", "logprobs.py", "model.py", "hardware.py")]
    main_def = next(n for n in ast.parse(Path(grpo.__file__).read_text()).body
                    if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in main_def.body if isinstance(n, ast.For))  # the step loop
    called = {(grpo.__file__, main_def.lineno)}  # (file, first line of a code object it ran)
    state = {"main": None, "step": 0}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "main" and code.co_filename == grpo.__file__:
            state["main"] = frame
        main_frame = state["main"]
        if main_frame is None or not loop.lineno <= main_frame.f_lineno <= loop.end_lineno:
            return
        if main_frame.f_locals.get("step") != 2:
            return
        if code.co_filename in files:
            called.add((code.co_filename, frame.f_lineno))
        elif code.co_name == "__init__" and "self" in frame.f_locals:  # a dataclass's __init__
            cls = type(frame.f_locals["self"])
            file = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if file in files:
                called.add((file, inspect.getsourcelines(cls)[1]))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = grpo.Config(model=tiny_model(Path(tmp) / "model"), data="arith", steps=2, eval_every=0,
                          reward="reading_path:parity_reward", out=str(Path(tmp) / "out"))
        sys.setprofile(profile)
        try:
            history = grpo.main(cfg)
        finally:
            sys.setprofile(None)
    assert history[-1]["trained_frac"] > 0, "the traced step trained nothing"

    total_all = total_code = 0
    for file in files:
        source = Path(file).read_text()
        tree, source_lines = ast.parse(source), source.splitlines()
        docs = docstring_lines(tree)
        first_lines = {line for f, line in called if f == file}
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            first, last = span(node)
            if not any(first <= line <= last for line in first_lines):
                continue
            if isinstance(node, ast.ClassDef):  # its fields, and the methods the step called
                parts = [span(n) for n in node.body if not isinstance(n, ast.FunctionDef)
                         or any(span(n)[0] <= line <= span(n)[1] for line in first_lines)]
                parts.append((first, first))
            else:
                parts = [(first, last)]
            n_all = sum(b - a + 1 for a, b in parts)
            n_code = sum(code_lines(source_lines, a, b, docs) for a, b in parts)
            total_all, total_code = total_all + n_all, total_code + n_code
            print(f"{Path(file).name:14s} {node.name:26s} {n_all:4d} lines {n_code:4d} code")
    names = ", ".join(Path(f).name for f in files) if not all_files else "every module"
    print(f"one default training step reads {total_all} lines ({total_code} code lines) in {names}")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all-files", action="store_true",
                        help="count every smolrl module the step passes through")
    main(parser.parse_args().all_files)

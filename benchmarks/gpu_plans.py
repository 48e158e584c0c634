"""docs/gpu.md's table of memory plans: every algorithm at Qwen2.5-1.5B's shapes (the shape of
Qwen2.5-Math-1.5B) on a 24 and an 80 GB GPU, full fine-tuning and --lora-rank 16 -- what
`--dry-run --gpu-gb N` prints, from configs alone (no weights, no GPU), as markdown.

    python benchmarks/gpu_plans.py            # print the table (~40 s on a 2-core EPYC)
    python benchmarks/gpu_plans.py --write    # put it in docs/gpu.md in place of the one there
    python benchmarks/gpu_plans.py --check    # exit 1 if docs/gpu.md's table is another

grpo.py, ppo.py and distill.py with their defaults (the math task's 8 x 8 samples of up to 1,024
tokens; distill.py's teacher Qwen2.5-7B-shaped; ppo.py without a KL reference), sft.py on its
multiply warm start, dpo.py and rm.py on their builtin pairs.
"""

import argparse
import importlib
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "gpu.md"

ALGORITHMS = ("grpo", "ppo", "distill", "sft", "dpo", "rm")
SHAPES = {  # (hidden, intermediate, layers, heads, KV heads, vocabulary, tied embeddings)
    "1.5b": (1536, 8960, 28, 12, 2, 151936, True),  # Qwen2.5-1.5B
    "7b": (3584, 18944, 28, 28, 4, 152064, False),  # Qwen2.5-7B
}


def config_folders() -> dict:
    from transformers import Qwen2Config
    folders = {}
    for name, (hidden, inter, layers, heads, kv, vocab, tied) in SHAPES.items():
        folders[name] = tempfile.mkdtemp(prefix=f"shape-{name}-")
        Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                    tie_word_embeddings=tied, max_position_embeddings=4096
                    ).save_pretrained(folders[name])
    return folders


def cell(algorithm: str, gb: int, lora: bool, folders: dict) -> str:
    """One plan, as the table shows it: the resident models, the engine, the micro-batch and the
    peak; or what does not fit, by how much."""
    module = importlib.import_module(algorithm)
    kwargs = {"model": folders["1.5b"], "gpu_gb": gb, "lora_rank": 16 if lora else 0}
    if algorithm == "distill":
        kwargs["teacher"] = folders["7b"]
    try:
        plan = module.Config(**kwargs).memory_plan
    except SystemExit as stop:
        found = re.search(r"while (generating|training): (.*?)(; |$)", str(stop))
        return f"does not fit: {found.group(2)}" if found else str(stop)
    parts = [f"{r.name} {r.gb:.1f}" for r in plan.resident]
    if plan.gpu_memory_utilization:
        parts.append(f"vLLM {plan.engine_gb:.1f} ({plan.gpu_memory_utilization:.2f})")
    elif plan.engine_gb:
        parts.append(f"HF engine {plan.engine_gb:.1f}")
    parts.append(f"{plan.max_tokens_per_microbatch:,} tokens/mb"
                 + (" (ckpt)" if plan.gradient_checkpointing else ""))
    return ", ".join(parts) + f", **peak {plan.peak_gb():.1f}**"


def table(folders: dict | None = None) -> str:
    """The markdown table, from config folders of SHAPES' shapes (written here if not given)."""
    folders = folders or config_folders()
    columns = [(24, False), (24, True), (80, False), (80, True)]
    lines = ["| | " + " | ".join(f"{gb} GB, {'`--lora-rank 16`' if lora else 'full'}"
                                 for gb, lora in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for algorithm in ALGORITHMS:
        lines.append(f"| {algorithm}.py | " + " | ".join(
            cell(algorithm, gb, lora, folders) for gb, lora in columns) + " |")
    return "\n".join(lines)


def in_page(page: str, markdown: str) -> str:
    """The page with its table of plans -- the lines from this table's header to the first line
    that is no table row -- replaced by `markdown`."""
    lines = page.split("\n")
    header = markdown.split("\n")[0]
    if header not in lines:
        raise SystemExit(f"error: {PAGE} has no line {header!r}: where would the table go?")
    start = end = lines.index(header)
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + markdown.split("\n") + lines[end:])


if __name__ == "__main__":
    import contextlib
    import io
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/gpu.md's table")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/gpu.md's differs")
    args = parser.parse_args()
    with contextlib.redirect_stdout(io.StringIO()):  # (the settings' own lines)
        markdown = table()
    page = PAGE.read_text()
    if args.check:
        same = in_page(page, markdown) == page
        print("docs/gpu.md's table of plans is what the code prints" if same else
              f"docs/gpu.md's table of plans is out of date: run {Path(__file__).name} --write")
        sys.exit(0 if same else 1)
    if args.write:
        PAGE.write_text(in_page(page, markdown))
    print(markdown)

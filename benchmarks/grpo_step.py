"""Seconds per GRPO step, split into generation / scoring / training, on a fixed config.

    python benchmarks/grpo_step.py            # SmolLM2-135M-Instruct, 8 prompts x 4 samples,
                                              # <= 64 new tokens, bf16, 1 warm-up + 4 timed steps

Prints one row per timed step and the median. Training time depends on how many sequences carry
a non-zero advantage (grpo.py skips the others when beta = 0), so `trained` is printed beside it;
`--beta 1e-9` forces every sequence through forward and backward for a worst-case figure.
"""

import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import parse_config  # noqa: E402
from grpo import Config, main  # noqa: E402

BENCH = Config(prompts_per_step=8, num_generations=4, max_new_tokens=64, steps=5, eval_every=0,
               log_samples_every=0, temperature=1.0, micro_batch_size=32)

if __name__ == "__main__":
    cfg = parse_config(Config, sys.argv[1:])
    # Flags given on the command line win; everything else is the fixed benchmark config.
    given = {a.lstrip("-").replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}
    cfg = replace(BENCH, **{k: getattr(cfg, k) for k in given if hasattr(cfg, k)})
    with tempfile.TemporaryDirectory() as tmp:
        cfg = replace(cfg, out=tmp)
        main(cfg)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]  # the first step pays one-off costs (kernel selection, allocator warm-up)
    cols = ["step_seconds", "gen_seconds", "reward_seconds", "train_seconds", "gen_tokens_per_s",
            "train_tokens_per_s", "completion_len", "trained_frac"]
    print(f"\nconfig: {cfg.model}, {cfg.prompts_per_step} prompts x {cfg.num_generations} samples, "
          f"max_new_tokens {cfg.max_new_tokens}, bf16={cfg.bf16}, beta={cfg.beta}")
    print("step " + "".join(c.rjust(20) for c in cols))
    for r in timed:
        print(f"{r['step']:4d} " + "".join(f"{r.get(c, 0):20.2f}" for c in cols))
    print("med  " + "".join(f"{statistics.median(r.get(c, 0) for r in timed):20.2f}" for c in cols))

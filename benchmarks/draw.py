"""What drawing one token a row costs the HF engine's decoding loop: `sampling.draw` (the token and
its log-prob) on random bf16 logits, at the row counts and vocabularies a decoding step has.

    python benchmarks/draw.py                         # 64 rows; SmolLM2's 49,152 and Qwen's 151,936
    python benchmarks/draw.py --rows 32 --vocab 32000

At T = 0 (greedy: the held-out evaluation's draw) the token is the row's largest logit alone.

Each (B, V) tensor the draw makes costs its fill and, fresh from the allocator, as much again in
page faults; so medians are printed beside the fastest call: the median is what a decoding loop
sees. A decoding step of SmolLM2-135M at 64 rows takes ~100 ms on a 2-core Xeon.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from hardware import hardware_line
    from sampling import Sampling, draw

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", default="49152,151936")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    print(f"machine: {hardware_line()}")
    print(f"{'rows':>6s}{'vocab':>9s}{'T':>6s}{'fastest ms':>12s}{'median ms':>11s}")
    gen = torch.Generator().manual_seed(0)
    for vocab in map(int, args.vocab.split(",")):
        logits = (torch.randn(args.rows, vocab, generator=gen) * 3).to(torch.bfloat16)
        for temperature in (1.0, 0.7, 0.0):  # (0: greedy, an evaluation's)
            sampling = Sampling(temperature=temperature)
            draw(logits, sampling, logprobs=True)  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                draw(logits, sampling, logprobs=True)
                times.append(time.perf_counter() - t0)
            print(f"{args.rows:6d}{vocab:9d}{temperature:6.1f}{min(times) * 1e3:12.2f}"
                  f"{statistics.median(times) * 1e3:11.2f}")

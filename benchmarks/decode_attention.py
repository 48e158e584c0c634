"""One decoding step's attention in one layer, as the HF engine runs it and as SDPA's CPU flash
kernel would: which is cheaper, and what the cache's growth costs beside it.

    python benchmarks/decode_attention.py                  # 64 rows, 60 / 400 / 1,000 of context
    python benchmarks/decode_attention.py --rows 16 --contexts 1000

Today each step concatenates the layer's keys and values with the new token's (a copy of the whole
cache) and attention.decode_attention reads them contiguous. A cache with room to grow would skip
the copy, but its filled columns are a strided view that CPU bmm copies again before it multiplies;
SDPA's flash kernel reads such a view as it is (`enable_gqa`: the KV heads shared, not repeated).
Printed per context, in microseconds: decode_attention on contiguous keys, on the view, the
concatenation's copy, SDPA on the view and on contiguous keys, and how far SDPA's output is from
decode_attention's. SmolLM2-135M's heads (9 query heads on 3 KV heads of 64), in --dtype.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    import torch.nn.functional as F

    from attention import decode_attention
    from hardware import hardware_line

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--contexts", default="60,400,1000", help="tokens already in the cache")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"machine: {hardware_line()}, {args.dtype}, {args.rows} rows")
    KV, H, D, ROOM = 3, 9, 64, 40

    def microseconds(fn) -> float:
        """Median of 5 rounds of --repeats calls."""
        for _ in range(20):
            fn()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                fn()
            rounds.append((time.perf_counter() - t0) / args.repeats * 1e6)
        return statistics.median(rounds)

    print(f"{'context':>8s}{'decode_attention':>18s}{'on the view':>13s}{'cat':>8s}"
          f"{'SDPA view':>11s}{'SDPA':>8s}{'max |diff|':>12s}")
    for L in map(int, args.contexts.split(",")):
        B = args.rows
        keys, values = (torch.randn(B, KV, L + ROOM, D, dtype=dtype) for _ in range(2))
        k, v = keys[:, :, :L], values[:, :, :L]  # (a cache with ROOM columns to grow)
        kc, vc = k.contiguous(), v.contiguous()
        q = torch.randn(B, H, 1, D, dtype=dtype)
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
        mask[: B // 8, :, :, : L // 10] = False  # (some rows left-padded)
        scale = D ** -0.5
        ours = decode_attention(q, kc, vc, mask, scale)  # (B, 1, H, D)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True).transpose(1, 2)
        times = [microseconds(lambda: decode_attention(q, kc, vc, mask, scale)),
                 microseconds(lambda: decode_attention(q, k, v, mask, scale)),
                 microseconds(lambda: (torch.cat([kc, kc[:, :, :1]], 2),
                                       torch.cat([vc, vc[:, :, :1]], 2))),
                 microseconds(lambda: F.scaled_dot_product_attention(
                     q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)),
                 microseconds(lambda: F.scaled_dot_product_attention(
                     q, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True))]
        diff = (sdpa.float() - ours.float()).abs().max().item()
        print(f"{L:8d}{times[0]:18.1f}{times[1]:13.1f}{times[2]:8.1f}{times[3]:11.1f}"
              f"{times[4]:8.1f}{diff:12.2g}")

"""Generation tokens/s of the HF and vLLM backends side by side, and the vLLM weight-sync time.

    python benchmarks/rollout_speed.py                  # default model, 8 prompts x 8, 64 tokens
    python benchmarks/rollout_speed.py --model Qwen/Qwen2.5-1.5B-Instruct --prompts 64 --n 8

Both engines generate the same prompts with the same sampling settings (T = 1.0, so lengths are
similar); each is run once to warm up and then timed over --repeats calls.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from data import arith_stream, encode_prompts
    from hardware import hardware_line, pick_device
    from model import DEFAULT_MODEL, load_model
    print(f"machine: {hardware_line()}")
    from rollout import make_rollout
    from sampling import Sampling

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--backends", default="hf,vllm")
    args = parser.parse_args()

    device = pick_device()
    model, tokenizer = load_model(args.model, device)
    stream = arith_stream(0)
    prompts = encode_prompts(tokenizer, [next(stream) for _ in range(args.prompts)], "answer-is")
    sampling = Sampling(args.max_new_tokens, temperature=1.0, seed=0)
    rows = []
    for backend in args.backends.split(","):
        engine = make_rollout(backend, model, tokenizer, device=device,
                              max_new_tokens=args.max_new_tokens,
                              gpu_memory_utilization=args.gpu_memory_utilization)
        engine.generate(prompts, args.n, sampling)  # warm-up
        speeds, syncs = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.generate(prompts, args.n, sampling)
            seconds = time.perf_counter() - t0
            speeds.append(sum(len(c) for c in out.completion_ids) / seconds)
            syncs.append(engine.update_weights(model.state_dict()))
        rows.append((backend, statistics.median(speeds), statistics.median(syncs)))
        del engine
    print(f"\n{args.model}: {args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} "
          f"new tokens, T=1.0, device {device}, median of {args.repeats}")
    print(f"{'backend':10s}{'gen tokens/s':>15s}{'sync seconds':>15s}")
    for backend, speed, sync in rows:
        print(f"{backend:10s}{speed:15.1f}{sync:15.3f}")

"""A training micro-batch's forward and backward, three ways: each sample in its own row, groups
packed one row per prompt under SDPA's mask, and packed under smolrl's attention (attention.py:
each completion against its prompt's keys and its own).

    python benchmarks/shared_rows.py                        # arith's shape: 8 groups of 8, a
                                                            # 55-token prompt, ~15-token answers
    python benchmarks/shared_rows.py --prompt 209 --completion 200 --groups 1
                                                            # guess's episodes (8 a micro-batch)

The offline default model in the dtype `--dtype auto` picks here, random tokens (the time does not
depend on them), completion lengths drawn within +-30 % of --completion. Printed per way: the best
of --repeats timed passes (after one warm-up), completion_logprobs then backward of their sum.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hardware import choose_dtype, hardware_line, pick_device  # noqa: E402
from logprobs import check_head_logits, completion_logprobs, right_pad  # noqa: E402
from model import default_model_path, load_model  # noqa: E402


def batch(prompt: int, completion: int, groups: int, size: int, seed: int = 0):
    """(input_ids, prompt_lens, completion_lens): `groups` prompts of `prompt` random tokens, each
    followed by `size` completions of about `completion` tokens."""
    rng = random.Random(seed)
    rows, prompt_lens, completion_lens = [], [], []
    for _ in range(groups):
        shared = [rng.randrange(1000, 40000) for _ in range(prompt)]
        for _ in range(size):
            n = rng.randint(int(completion * 0.7), int(completion * 1.3))
            rows.append(shared + [rng.randrange(1000, 40000) for _ in range(n)])
            prompt_lens.append(prompt)
            completion_lens.append(n)
    return right_pad(rows, 0), torch.tensor(prompt_lens), torch.tensor(completion_lens)


def timed(model, ids, prompt_lens, completion_lens, repeats: int) -> float:
    """The best seconds of `repeats` forward + backward passes, after one untimed."""
    best = float("inf")
    for k in range(repeats + 1):
        t0 = time.perf_counter()
        logprobs, _ = completion_logprobs(model, ids, prompt_lens, completion_lens)
        logprobs.sum().backward()
        model.zero_grad(set_to_none=True)
        if k:
            best = min(best, time.perf_counter() - t0)
    return best


def main(args):
    dtype = choose_dtype("auto", pick_device())
    print(f"machine: {hardware_line()}; dtype {dtype.name} ({dtype.reason})")
    model, _ = load_model(default_model_path(), "cpu", dtype.torch)
    ids, prompt_lens, completion_lens = batch(args.prompt, args.completion, args.groups,
                                              args.group_size)
    tokens = int((prompt_lens + completion_lens).sum())
    print(f"{args.groups} groups of {args.group_size}: {args.prompt}-token prompts, "
          f"~{args.completion}-token completions, {tokens} tokens unshared")
    attention = model.config.get_text_config()._attn_implementation
    for name, implementation, share in (("each sample in its own row", attention, False),
                                        ("packed, SDPA's mask", "sdpa", True),
                                        ("packed, smolrl's attention", attention, True)):
        model.set_attn_implementation(implementation)
        check_head_logits(model)  # (the verdict on sharing, under this attention)
        model.smolrl_shares_prompts = model.smolrl_shares_prompts and share
        seconds = timed(model, ids, prompt_lens, completion_lens, args.repeats)
        print(f"{name:30s} {seconds:7.2f} s", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=55, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=15, help="completion tokens, about")
    parser.add_argument("--groups", type=int, default=8, help="prompts in the micro-batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per way")
    main(parser.parse_args())

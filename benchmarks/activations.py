"""What the update's forward leaves for its backward, and the time of both, with and without
recompute.keep_less (element-wise activations made again in the backward instead of kept).

    python benchmarks/activations.py                       # the default run's shapes (32 sequences)
    python benchmarks/activations.py --sequences 64 --rounds 10 --dtype bf16

A GRPO update's micro-batch as the default run makes it: groups of 8 completions (8-24 random
tokens) after a shared 55-token prompt, through logprobs.completion_logprobs (one packed row, the
chunked LM head), on two copies of the model -- as loaded, and given keep_less. The first figure
is the bytes of every tensor the forward made that is still alive when it returns (recompute.Made:
the saved activations and the output); then forward and backward timed, the two copies
interleaved, the medians printed.
"""

import copy
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from benchmarks.model_options import measured_on, model_parser
    from hardware import hardware_line
    from logprobs import check_head_logits, completion_logprobs
    from model import load_model
    from recompute import Made, keep_less

    parser = model_parser(__doc__)
    parser.add_argument("--sequences", type=int, default=32, help="completions, 8 a prompt")
    parser.add_argument("--rounds", type=int, default=5, help="timed forward+backward each")
    args = parser.parse_args()

    device, dtype = measured_on(args)
    torch.manual_seed(0)
    plain, _ = load_model(args.model, device, dtype.torch)
    check_head_logits(plain)  # (what lets completion_logprobs share the prompts, as a run does)
    ours = copy.deepcopy(plain)
    changed = keep_less(ours)
    G, P = 8, 55
    prompts = [torch.randint(100, 20000, (P,)) for _ in range(max(1, args.sequences // G))]
    B = len(prompts) * G
    lens = torch.randint(8, 25, (B,))
    ids = torch.zeros(B, P + int(lens.max()), dtype=torch.long)
    for b in range(B):
        ids[b, :P] = prompts[b // G]
        ids[b, P:P + lens[b]] = torch.randint(100, 20000, (int(lens[b]),))
    ids, lens, prompt_lens = ids.to(device), lens.to(device), torch.full((B,), P, device=device)
    tokens = len(prompts) * P + int(lens.sum())
    layers = plain.config.num_hidden_layers

    def step(model):
        t0 = time.perf_counter()
        logprobs, _ = completion_logprobs(model, ids, prompt_lens, lens, temperature=0.7)
        t1 = time.perf_counter()
        logprobs.sum().backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1

    print(f"{hardware_line()}; {args.model} in {dtype.name}; {B} sequences, {tokens} tokens "
          f"packed; keep_less changed {changed} modules")
    copies = {"as loaded": plain, "keep_less": ours}
    for name, model in copies.items():
        made = Made()
        with made:
            logprobs, _ = completion_logprobs(model, ids, prompt_lens, lens, temperature=0.7)
        held = made.held_bytes()
        del logprobs
        print(f"{name:>10}: {held / 2**30:.3f} GB held for the backward "
              f"({held / tokens / layers / dtype.torch.itemsize:,.0f} values a token a layer)")
    times = {name: [] for name in copies}
    for _ in range(args.rounds):
        for name, model in copies.items():
            times[name].append(step(model))
    for name, ts in times.items():
        print(f"{name:>10}: forward {statistics.median(t[0] for t in ts):.3f} s, backward "
              f"{statistics.median(t[1] for t in ts):.3f} s (medians of {args.rounds})")

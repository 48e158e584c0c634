"""How close a decoding step can come to its roofline here: the model's own matmuls at decoding's
row counts against the machine's peak, then one decoding step split into its parts.

    python benchmarks/decode_floor.py                      # default model, 64 rows, 60 of context
    python benchmarks/decode_floor.py --rows 32 --context 120

A decoding step of R rows does 2 x R x (the model's parameters) FLOPs and reads every weight once
(and its context's keys and values): its roofline bound is the longer of those FLOPs over the
peak hardware.py measures (a 512 x 2048 x 2048 matmul; a small one where the dtype is emulated)
and those bytes over the bandwidth it measures (a 256 MB copy) -- on a CPU that multiplies bf16
with AMX, the bytes bind. But a step's matmuls have only R rows, and their weights come from
memory once a step: the first table is what such matmuls reach here -- the model's linear layers
and LM head run in sequence as a step runs them, in the run's dtype -- and so the highest fraction
of the bound any decoding loop of these kernels could reach (F.linear, the plain layers). The
second splits one step of the HF engine's forward (hidden states, then the LM head), with its
weights packed as the engine packs them where it does (packed_linear.py), then with the plain
layers: "the rest" is the decoder's time less its matmuls timed alone -- attention, norms, rotary
embeddings, the cache's concatenation, the embedding, the mask, Python -- assuming the matmuls run
inside the forward as fast as alone. The third takes the same step's operators' own time from
torch.profiler: eager's floor, what the same ops take with no Python between them -- below it
only fused (compiled) kernels go. The loop's sampling (sampling.draw) is not in it.
"""

import contextlib
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    import torch.nn.functional as F
    from transformers.cache_utils import DynamicCache

    from benchmarks.model_options import measured_on, model_parser
    from hardware import decode_bytes, decode_cost, hardware_line, memory_bandwidth, peak_flops
    from model import load_model
    from packed_linear import packed_linears
    from rollout import make_rollout

    parser = model_parser(__doc__)
    parser.add_argument("--rows", type=int, default=64, help="rows of the decoding step")
    parser.add_argument("--context", type=int, default=60, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    print(f"machine: {hardware_line()}")
    device, choice = measured_on(args)
    dtype = choice.torch
    model, tokenizer = load_model(args.model, device)
    engine = make_rollout("hf", model, tokenizer, device=device, dtype=dtype)
    net = engine.model
    head = net.get_output_embeddings().weight
    linears = [m.weight for m in net.modules()
               if isinstance(m, torch.nn.Linear) and m.weight is not head]
    peak, where = peak_flops(torch.device(device).type, dtype)
    bandwidth, read_where = memory_bandwidth(torch.device(device).type)
    cost = decode_cost(net, dtype)

    def bound(rows: int, context: int) -> float:
        """A decoding step's roofline: its FLOPs at the peak or its bytes at the bandwidth."""
        flops = 2 * rows * (sum(w.numel() for w in linears) + head.numel())
        return max(flops / peak, decode_bytes(cost, 1, rows * context) / bandwidth)

    def seconds(run) -> float:
        """The median of --repeats timed calls, after one untimed."""
        run()
        times = []
        for _ in range(args.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def matmul_seconds(rows: int, weights: list) -> float:
        """x @ W^T for each of `weights` in turn, x of `rows` rows: as a decoding step runs them."""
        inputs = {n: torch.randn(rows, n, device=device, dtype=dtype)
                  for n in {w.shape[1] for w in weights}}

        @torch.no_grad()
        def matmuls():
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
        return seconds(matmuls)

    print(f"\n{args.model} in {choice.name} ({choice.reason}); peak {peak / 1e9:.0f} GFLOP/s "
          f"({where}), bandwidth {bandwidth / 1e9:.1f} GB/s ({read_where})")
    print(f"its {len(linears)} linear layers + LM head in sequence, x @ W^T (the roofline: of a "
          f"step with no context):")
    print(f"{'rows':>6s}{'GFLOP':>8s}{'ms':>8s}{'GFLOP/s':>9s}{'of peak':>9s}{'roofline':>10s}")
    for rows in sorted({args.rows, 64, 32, 16}, reverse=True):
        flops = 2 * rows * sum(w.numel() for w in linears + [head])
        t = matmul_seconds(rows, linears + [head])
        print(f"{rows:6d}{flops / 1e9:8.2f}{t * 1e3:8.1f}{flops / t / 1e9:9.0f}"
              f"{flops / t / peak:9.0%}{bound(rows, 0) / t:10.0%}")

    # One decoding step: `rows` rows, each with `context` tokens in the cache, feed one token.
    R, C = args.rows, args.context
    with torch.no_grad():
        prefill = net(input_ids=torch.randint(0, 1000, (R, C), device=device), use_cache=True)
    kept = [(layer.keys, layer.values) for layer in prefill.past_key_values.layers]
    step_in = dict(input_ids=torch.randint(0, 1000, (R, 1), device=device),
                   attention_mask=torch.ones(R, C + 1, dtype=torch.long, device=device),
                   position_ids=torch.full((R, 1), C, device=device), use_cache=True)

    @torch.no_grad()
    def decoder():  # a fresh cache of the same keys and values each time (no copy)
        net.model(**step_in, past_key_values=DynamicCache(ddp_cache_data=kept))

    modules = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    head_module = net.get_output_embeddings()
    inputs = {n: torch.randn(R, n, device=device, dtype=dtype)
              for n in {w.shape[1] for w in linears}}

    @torch.no_grad()
    def layers_matmuls():  # the modules themselves: their weights packed where the engine packs
        for m in modules:
            if m is not head_module:
                m(inputs[m.in_features])

    floor = bound(R, C)
    # The HF engine packs its weights for oneDNN where that gives F.linear's numbers here
    # (packed_linear.py): the step as it decodes, and as it would with the plain layers.
    for packed in ([True, False] if engine.packs else [False]):
        with packed_linears(net, R, dtype) if packed else contextlib.nullcontext():
            body, mm = seconds(decoder), seconds(layers_matmuls)
            head_s = seconds(torch.no_grad()(lambda: head_module(inputs[head.shape[1]])))
        how = "weights packed (as the engine decodes)" if packed else "plain layers" + \
            (" (the engine packs: this is without)" if engine.packs else "")
        print(f"\none decoding step, {R} rows, {C} tokens of context, {how}: "
              f"{(body + head_s) * 1e3:.0f} ms, its bound {floor * 1e3:.1f} ms "
              f"({floor / (body + head_s):.0%} of it)")
        for name, t in [("the layers' matmuls", mm), ("the LM head", head_s),
                        ("the rest (the decoder less its matmuls alone)", body - mm)]:
            print(f"  {name:50s}{t * 1e3:8.1f} ms")

    # What eager execution can reach: the same step's operators' own time (each op's self time on
    # this thread, under torch.profiler: the matmuls, the cache's concatenation, every other op)
    # against the step's wall time without the profiler. What is left is Python and dispatch
    # between the ops: all a leaner forward of the same ops could remove. Running the ops faster
    # than their own time takes fusing them (a compiled step), and that computes other numbers in
    # bf16 than the trainer's eager forward does (docs/benchmarks.md).
    # (On a CPU only: on a GPU an op's CPU time is its launch, not its work.)
    if device != "cpu":
        sys.exit(0)
    from torch.profiler import profile

    def op_seconds(run, repeats: int = 5) -> dict[str, float]:
        """Seconds a call of `run` spends in its ops, by kind (the profiler's cost inside each)."""
        run()
        with profile() as prof:
            for _ in range(repeats):
                run()
        kinds = {"matmuls": 0.0, "aten::cat (the cache; rotary halves)": 0.0, "other ops": 0.0}
        for event in prof.key_averages():
            name = event.key
            kind = ("matmuls" if "linear" in name or name in ("aten::mm", "aten::addmm",
                                                               "aten::bmm", "aten::baddbmm")
                    else "aten::cat (the cache; rotary halves)" if name == "aten::cat"
                    else "other ops")
            kinds[kind] += event.self_cpu_time_total / 1e6 / repeats
        return kinds

    step = torch.no_grad()(lambda: (decoder(), head_module(inputs[head.shape[1]])))
    with packed_linears(net, R, dtype) if engine.packs else contextlib.nullcontext():
        wall, kinds = seconds(step), op_seconds(step)
    ops = sum(kinds.values())
    print(f"\nthe same step's operators (torch.profiler's self times), {R} rows: "
          f"{wall * 1e3:.0f} ms a step unprofiled")
    for name, t in kinds.items():
        print(f"  {name:50s}{t * 1e3:8.1f} ms")
    print(f"  {'Python and dispatch (the step less its ops)':50s}{(wall - ops) * 1e3:8.1f} ms")
    print(f"eager's floor, the ops alone with nothing between them: {ops * 1e3:.0f} ms, "
          f"{floor / ops:.0%} of the roofline (the step itself: {floor / wall:.0%})")

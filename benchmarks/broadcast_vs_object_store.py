"""Weight sync after a step, trainer rank 0 -> 2 engines on Ray: a collective broadcast (bf16
buckets in a process group of their own) against Ray's object store (rank 0 puts a bf16 state
dict there, every engine pulls a copy).

    python benchmarks/broadcast_vs_object_store.py                  # the offline default model (135M)
    python benchmarks/broadcast_vs_object_store.py --qwen2-1.5b     # a random Qwen2.5-1.5B-shaped model

Prints, per method, the seconds of a sync (mean of --repeats after a warm-up) and the host memory
it takes: the peak of the machine's used memory (MemTotal - MemAvailable, sampled every 5 ms)
during the sync, above what was used just before it. On CPU both paths go through host memory;
on GPUs the collective is NCCL and never touches it.
"""

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def used_bytes() -> int:
    info = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    kb = lambda key: int(info[key].split()[0]) * 1024  # noqa: E731
    return kb("MemTotal") - kb("MemAvailable")


def measured(sync, step: int) -> tuple[float, float]:
    """(seconds, extra GB at the peak) of one sync."""
    before, peak, done = used_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], used_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        seconds = sync(step)
    finally:
        done.set()
        sampler.join()
    return seconds, max(0, peak[0] - before) / 2**30


def bf16_engine(model_dir: str):
    """An HF engine loaded straight in bf16 (the engines' dtype; no fp32 copy on the way)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rollout import HFRollout
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return HFRollout(model, AutoTokenizer.from_pretrained(model_dir), dtype=torch.bfloat16)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--qwen2-1.5b", dest="qwen", action="store_true",
                        help="a random-weight Qwen2.5-1.5B-shaped model instead of the default")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import ray
    from distributed import Cluster, EngineGroup, Worker
    from hardware import hardware_line
    print(f"machine: {hardware_line()}")
    from grpo import Config
    from model import DEFAULT_MODEL, default_model_path
    from trainer import setup_trainer
    from weight_sync import weight_sync_by_collective, weight_sync_by_object_store

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = default_model_path(), DEFAULT_MODEL
        if args.qwen:  # Qwen2.5-1.5B: 28 layers, 1536 wide, 12 heads / 2 KV heads, 151,936 vocab
            import torch
            from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
            model = Qwen2ForCausalLM(Qwen2Config(
                vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                tie_word_embeddings=True)).to(torch.bfloat16)
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(tmp)
            del model
            model_dir, name = tmp, "Qwen2.5-1.5B-shaped (random)"
        cfg = Config(model=model_dir, data="arith", num_trainers=1, num_engines=args.engines,
                     colocate=True)
        cluster = Cluster(1, args.engines, colocate=True)
        trainers = cluster.trainers(setup_trainer, cfg)
        # One engine at a time (loading them side by side would add up their loading peaks),
        # engine i on bundle i (engine 0 beside trainer 0).
        workers = []
        for i in range(args.engines):
            workers.append(Worker.options(**cluster._options(i)).remote())
            ray.get(workers[-1].setup.remote(bf16_engine, model_dir))
        engines = EngineGroup(workers)
        params = ray.get(trainers.workers[0].run.remote(
            lambda t: sum(p.numel() for p in t.model.parameters())))
        print(f"{name}: {params / 1e9:.2f} B parameters, {params * 2 / 2**30:.2f} GB in bf16; "
              f"trainer rank 0 -> {args.engines} engines (Ray, this machine, gloo on CPU)")
        print(f"{'method':<14s} {'s/sync':>8s} {'extra host GB at peak':>22s}")
        # The collective first: on a machine too small for the object store's extra copies Ray
        # kills a worker, and nothing can be measured after that.
        for method in ("collective", "object-store"):
            sync = (weight_sync_by_object_store(trainers, engines) if method == "object-store"
                    else weight_sync_by_collective(trainers, engines, nccl=False))
            try:
                sync(0)  # warm-up: first allocations, connections
                runs = [measured(sync, step) for step in range(1, args.repeats + 1)]
            except SystemExit as e:  # a worker died: on this machine, Ray's memory monitor
                print(f"{method:<14s} failed: {str(e).splitlines()[0][:200]}")
                break
            print(f"{method:<14s} {statistics.mean(s for s, _ in runs):8.2f} "
                  f"{max(gb for _, gb in runs):22.2f}", flush=True)
        cluster.shutdown()


if __name__ == "__main__":
    main()

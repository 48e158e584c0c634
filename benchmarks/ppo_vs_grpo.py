"""What the critic costs: PPO's update beside GRPO's on one batch, and the two runs' curves.

    python benchmarks/ppo_vs_grpo.py step                    # one batch, both updates, timed
    python benchmarks/ppo_vs_grpo.py curves out/grpo out/ppo --labels grpo.py,ppo.py --out docs/ppo_vs_grpo.png

`step` builds one rollout batch shaped like the default run's (8 prompts x 8 samples, 55-token
prompts, 16-token completions, random tokens, every sample's reward and advantage non-zero so both
train every sequence) and times grpo.train_on_rollout and ppo.train_on_rollout on it in this one
process, the default configs of each (one warm-up, then the median of --repeats). The critic's
share is PPO's step less GRPO's: its old values (a forward), its forward and backward, its
optimizer step. It also counts what each trainer holds: parameters trained, and the bytes of
weights, gradients and AdamW moments (the training state, exact from the tensors; activations
come on top and scale with the batch).

`curves` reads two run folders (a grpo.py run and a ppo.py run, --eval-every 2 each) and draws
held-out greedy accuracy against the step and against the wall-clock seconds; it prints both per
evaluation step, and each run's median step time.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def rollout_batch(vocab: int, seed: int = 0):
    """An rl.TrainBatch like the default run's: 8 prompts x 8 samples, (55 + 16) tokens."""
    from dataclasses import replace
    from rl import TrainBatch, loss_denominator
    N, G, P, T = 8, 8, 55, 16
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(3, vocab, (N, P), generator=g).repeat_interleave(G, 0),
                     torch.randint(3, vocab, (N * G, T), generator=g)], dim=1)
    lens = torch.full((N * G,), T)
    rewards = torch.randint(0, 2, (N * G,), generator=g).float()
    batch = TrainBatch(ids, torch.full((N * G,), P), lens, rewards * 2 - 1,
                       torch.ones(N * G, dtype=torch.bool), None, loss_denominator("token-mean",
                                                                                   lens, T))
    return replace(batch, rewards=rewards)


def state_bytes(trainer) -> tuple[int, int]:
    """(parameters trained, bytes of weights + their gradients + AdamW's two moments)."""
    params = [p for p in trainer.model.parameters()]
    trained = [p for p in params if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    return sum(p.numel() for p in trained), weights + 3 * sum(p.numel() * 4 for p in trained)


def time_update(train_on_rollout, trainer, batch, repeats: int) -> list[float]:
    train_on_rollout(trainer, batch)  # warm-up (kernel choice, allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        train_on_rollout(trainer, batch)
        times.append(time.perf_counter() - t0)
    return times


def step(repeats: int, dtype: str):
    import grpo
    import ppo
    from hardware import hardware_line
    rows = {}
    for name, module in (("GRPO", grpo), ("PPO", ppo)):
        cfg = module.Config(dtype=dtype, updates_per_rollout=1)
        trainer = cfg.setup()
        batch = rollout_batch(trainer.model.config.vocab_size)
        times = time_update(module.train_on_rollout, trainer, batch, repeats)
        trained, held = state_bytes(trainer)
        if trainer.critic is not None:
            critic_trained, critic_held = state_bytes(trainer.critic)
            trained, held = trained + critic_trained, held + critic_held
        rows[name] = (statistics.median(times), times, trained, held)
        print(f"{name}: {cfg.model}, dtype {cfg.dtype}, micro-batch size {cfg.micro_batch_size}, "
              f"tokens {cfg.max_tokens_per_microbatch or '-'}", flush=True)
        del trainer
    print(f"\nmachine: {hardware_line()}; {torch.get_num_threads()} threads; one batch of 8 "
          f"prompts x 8 samples, (55 + 16) tokens, every sequence trained")
    print(f"{'':6}{'update s (median)':>20}{'trained params':>18}{'training state':>18}  runs")
    for name, (median, times, trained, held) in rows.items():
        print(f"{name:6}{median:20.2f}{trained / 1e6:17.1f}M{held / 2**20:14.0f} MiB  "
              + ", ".join(f"{t:.2f}" for t in times))
    (g, *_, g_params, g_held), (p, *_, p_params, p_held) = rows["GRPO"], rows["PPO"]
    print(f"the critic: +{p - g:.2f} s a step ({p / g:.2f}x GRPO's update), "
          f"x{p_params / g_params:.1f} the trained parameters, +{(p_held - g_held) / 2**20:.0f} MiB "
          f"of training state")


def read(folder: str) -> list[dict]:
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def curves(folders: list[str], out: str, labels: list[str]):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for k, folder in enumerate(folders):
        rows, label = read(folder), labels[k] if k < len(labels) else folder
        clock, seconds = {0: 0.0}, 0.0
        for r in rows[1:]:
            seconds += r.get("step_seconds", 0.0)
            clock[r["step"]] = seconds
        held = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
        steps, accuracy = zip(*held)
        by_step.plot(steps, accuracy, "o-", color=f"C{k}", label=label)
        by_time.plot([clock[s] / 60 for s in steps], accuracy, "o-", color=f"C{k}", label=label)
        step_times = [r["step_seconds"] for r in rows[1:] if "step_seconds" in r]
        print(f"{folder}: held-out " + " -> ".join(f"{a:.3f}" for a in accuracy)
              + f" at steps {', '.join(map(str, steps))}; median step "
              f"{statistics.median(step_times):.1f} s, train "
              f"{statistics.median(r['train_seconds'] for r in rows[1:]):.1f} s")
    by_step.set(xlabel="step", ylabel="held-out greedy accuracy", title="per step")
    by_time.set(xlabel="minutes of training steps", title="per minute")
    by_step.legend()
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("step", help="one batch, both updates, timed")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--dtype", default="auto")
    c = sub.add_parser("curves", help="two run folders' held-out accuracy")
    c.add_argument("folders", nargs="+")
    c.add_argument("--out", default="ppo_vs_grpo.png")
    c.add_argument("--labels", default="", help="comma-separated, one per folder (default: the "
                   "folders)")
    args = parser.parse_args()
    if args.what == "step":
        step(args.repeats, args.dtype)
    else:
        curves(args.folders, args.out, [x for x in args.labels.split(",") if x])

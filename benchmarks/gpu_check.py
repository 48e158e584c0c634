"""GPU check: 3 GRPO steps with a colocated vLLM engine on a random-weight Qwen2.5-1.5B-shaped model.

    python benchmarks/gpu_check.py            # one H200-class GPU, no network, <= 10 min
    python benchmarks/gpu_check.py --tiny     # the same path, CPU-sized (2-layer model)
    python benchmarks/gpu_check.py --ray      # 2 steps, 1 trainer + 1 engine colocated, via Ray

Builds the model from its config (no download is possible on the GPU machines), saves it in HF
format with the SmolLM2 tokenizer (its ids fit Qwen's larger vocabulary), runs grpo.py's main with
--rollout vllm, and prints which vLLM model runner ran (the engine prints it at start: on a GPU
vLLM 0.32 takes its V2 runner whenever Triton is importable), s/step, generation tokens/s,
weight-sync seconds, a memory budget (trainer resident, trainer peak, engine share) and the
trainer/engine mismatch metrics with a verdict: after every sync the engine must sample from the
trainer's policy. Random weights never emit a stop token, so every sample runs to max_new_tokens:
that is the worst case for generation time.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path



def parity_reward(prompts, completions, **_):
    """Random weights never answer anything: reward the parity of the text's length instead, so
    groups have signal, every step moves the weights, and the sync check means something."""
    return [float(len(c) % 2) for c in completions]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from grpo import Config, main
    from model import DEFAULT_MODEL, default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer model, CPU-sized batch")
    parser.add_argument("--ray", action="store_true", help="through distributed.py: 1 trainer + "
                        "1 engine colocated on one device, 2 steps")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    shape = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2)  # Qwen2.5-1.5B
    if args.tiny:
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)  # head_dim 64, as 1.5B
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **shape)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen2.5-1.5b-random"
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        ray_args = dict(ray_address="local", colocate=True) if args.ray else {}
        cfg = Config(data="arith", model=str(model_dir), rollout="vllm", steps=2 if args.ray else 3, eval_every=0,
                     **ray_args,
                     log_samples_every=0, prompts_per_step=2 if args.tiny else 32,
                     num_generations=4 if args.tiny else 8,
                     max_new_tokens=16 if args.tiny else 1024,
                     micro_batch_size=4 if args.tiny else 16,
                     gpu_memory_utilization=0.2 if args.tiny else 0.35,
                     # one Ray trainer trains ~17K tokens per micro-batch: keep activations small
                     gradient_checkpointing=args.ray,
                     reward="benchmarks.gpu_check:parity_reward",
                     beta=0.001, out=str(Path(tmp) / "run"))  # beta > 0: every sequence trains
        main(cfg)
        rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    keys = ["step_seconds", "gen_seconds", "gen_tokens_per_s", "train_seconds", "sync_seconds",
            "resident_memory_gb", "peak_memory_gb",
            "token_mult_prob_error", "gen_kl_error", "logprob_max_abs_diff"]
    print(f"\nQwen2.5-1.5B-shaped ({'tiny' if args.tiny else 'full'}), random weights, "
          f"{cfg.prompts_per_step} prompts x {cfg.num_generations} samples x {cfg.max_new_tokens} tokens")
    for key in keys:
        values = [r[key] for r in rows if key in r]
        if not values:
            continue
        print(f"  {key:24s} " + "  ".join(f"{v:10.4f}" for v in values)
              + (f"   median {statistics.median(values):.4f}" if values else ""))
    print("  (peak_memory_gb: the trainer's peak GPU memory allocated by PyTorch, or its peak\n"
          "   resident host memory on CPU; a colocated vLLM engine's own pool is not included)")
    last = rows[-1]
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        print(f"  memory budget (GB of {total:.0f}): trainer resident "
              f"{last.get('resident_memory_gb', 0):.1f}, trainer peak {last['peak_memory_gb']:.1f}, "
              f"engine {cfg.gpu_memory_utilization} x {total:.0f} = "
              f"{cfg.gpu_memory_utilization * total:.1f} (weights + KV cache; asleep while "
              f"the trainer trains)")
    synced = last["logprob_max_abs_diff"] < 0.5 and last["token_mult_prob_error"] < 1.05
    print(f"  weight sync: {'OK' if synced else 'MISMATCH'} -- the engine's log-probs "
          f"{'match' if synced else 'do not match'} the trainer's after the last sync "
          f"(max |dlogp| {last['logprob_max_abs_diff']:.3f}, token_mult_prob_error "
          f"{last['token_mult_prob_error']:.4f})")

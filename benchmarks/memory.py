"""Peak memory and seconds per training step against response length, gradient checkpointing on/off.

    python benchmarks/memory.py                       # CPU: tiny Llama, 256 / 1K / 4K tokens
    python benchmarks/memory.py --qwen2-1.5b   # GPU: Qwen2.5-1.5B shape at 8K / 16K / 24K,
                                               # and whether each fits one 141 GB GPU
    python benchmarks/memory.py --qwen2-1.5b --lora-rank 16 --lengths 1024 --gpu-gb 24
                                               # LoRA against full fine-tuning (checkpointing on)

Each configuration runs in its own process (peak resident memory only grows within a process):
a random-weight Llama built from a config, 4 sequences of a 64-token prompt plus L response
tokens, micro-batches by a token budget, one warm-up step and one timed step of train_on_rollout.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(model_dir, length, checkpointing, budget, lora_rank=0):
    sys.path.insert(0, str(ROOT))
    import torch
    from grpo import Config, train_on_rollout
    from rl import TrainBatch, loss_denominator
    from logprobs import pack
    from hardware import peak_memory_gb
    from trainer import setup_trainer
    cfg = Config(data="arith", model=model_dir, beta=0.0, gradient_checkpointing=checkpointing,
                 max_tokens_per_microbatch=budget, max_new_tokens=length, lora_rank=lora_rank)
    trainer = setup_trainer(cfg)
    torch.manual_seed(0)
    prompts = [torch.randint(100, 1000, (64,)).tolist() for _ in range(4)]
    completions = [torch.randint(100, 1000, (length,)).tolist() for _ in range(4)]
    ids, prompt_lens, completion_lens = pack(prompts, completions, pad_id=2)
    batch = TrainBatch(ids, prompt_lens, completion_lens, torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       torch.ones(4, dtype=torch.bool), None,
                       loss_denominator("token-mean", completion_lens, length))
    train_on_rollout(trainer, batch)  # warm-up
    t0 = time.perf_counter()
    train_on_rollout(trainer, batch)
    print(json.dumps({"seconds": time.perf_counter() - t0,
                      "peak_gb": peak_memory_gb(trainer.device)}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--budget", type=int, default=8192, help="max tokens per micro-batch")
    parser.add_argument("--qwen2-1.5b", dest="qwen", action="store_true",
                        help="a random Qwen2.5-1.5B-shaped model at 8K/16K/24K response tokens")
    parser.add_argument("--gpu-gb", type=float, default=141.0, help="memory of one GPU, for 'fits'")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="also measure LoRA of this rank (with checkpointing) against full")
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)  # internal: a single config
    args = parser.parse_args()
    if args.one:
        one(args.one[0], int(args.one[1]), args.one[2] == "1", int(args.one[3]), int(args.one[4]))
        sys.exit()
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config
    from transformers import Qwen2ForCausalLM
    from hardware import hardware_line
    from model import default_model_path
    print(f"machine: {hardware_line()}")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        heads = max(1, args.hidden // 64)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden,
                             intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=heads, num_key_value_heads=heads,
                             max_position_embeddings=32768, tie_word_embeddings=True)
        model = LlamaForCausalLM(config)
        name = f"Llama {args.layers} layers x {args.hidden}"
        if args.qwen:  # Qwen2.5-1.5B: 28 layers, 1536 wide, 12 heads / 2 KV heads, 151,936 vocab
            if args.lengths == parser.get_default("lengths"):
                args.lengths = "8192,16384,24576"
            args.budget = max(args.budget, max(map(int, args.lengths.split(","))) + 64)
            model = Qwen2ForCausalLM(Qwen2Config(
                vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                tie_word_embeddings=True))
            name = "Qwen2.5-1.5B-shaped"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        print(f"{name}, random weights, 4 sequences of 64 + L tokens, token budget {args.budget}")
        print(f"{'L':>7s} {'training':>10s} {'checkpointing':>14s} {'peak GB':>9s} "
              f"{'s/step':>8s} {'fits ' + str(int(args.gpu_gb)) + ' GB':>12s}", flush=True)
        # With --lora-rank: LoRA first, then full fine-tuning, both with checkpointing.
        variants = ([(args.lora_rank, True), (0, True)] if args.lora_rank else
                    [(0, False), (0, True)])
        for length in map(int, args.lengths.split(",")):
            for rank, ckpt in variants:
                what = f"LoRA {rank}" if rank else "full"
                out = subprocess.run([sys.executable, __file__, "--one", tmp, str(length),
                                      "1" if ckpt else "0", str(args.budget), str(rank)],
                                     capture_output=True, text=True)
                if out.returncode != 0:  # -9: killed by the kernel, out of memory
                    reason = ("killed (SIGKILL): out of memory" if out.returncode == -9 else
                              f"exit code {out.returncode}: {out.stderr.strip()[-200:]}")
                    print(f"{length:7d} {what:>10s} {str(ckpt):>14s}   failed: {reason}",
                          flush=True)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                fits = "yes" if r["peak_gb"] < args.gpu_gb else "no"
                print(f"{length:7d} {what:>10s} {str(ckpt):>14s} {r['peak_gb']:9.2f} "
                      f"{r['seconds']:8.2f} {fits:>12s}", flush=True)

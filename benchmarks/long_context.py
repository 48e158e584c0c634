"""The GPU memory plan at long context (issue 69): what grows with a sequence's square, measured on
the CPU with every GPU branch taken by pretending the device (attention.on_cuda, logprobs.on_cuda).

    python benchmarks/long_context.py        # ~1 minute on a 2-core EPYC

1. shared prompts: the bytes one layer's attention keeps for backward, CPU path and CUDA path
   (a 2,048-token prompt and 8 completions of 256, Qwen2.5-1.5B's 12 / 2 heads of 128, bf16)
2. Gemma 2's soft-capped attention: the bytes a token keeps for backward at 256 to 2,048 tokens
   (a bf16 Gemma 2 of 2 layers, 4 heads of 32, a sliding window of 1,024)
3. a log-prob chunk at its peak, bytes per (token, vocabulary entry), with a GPU's row blocks
4. the plan's activations per token and layer against what the trained copy keeps (bf16,
   smolrl's attention, recompute.keep_less), at Qwen2.5-1.5B's and SmolLM2-135M's widths
5. the largest boolean tensor (a mask's entries) of the HF engine's prefill of 16 left-padded
   prompts of up to 1,024 and 2,048 tokens, and of sft.py's packed rows of 2,048 tokens

The CPU's SDPA kernels keep for backward what CUDA's keep for the same call (inputs, output,
log-sum-exp, and a mask where one is given), so 1's CUDA figure is what its calls would keep there.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import attention  # noqa: E402
import gpu_memory  # noqa: E402
import logprobs as logprobs_module  # noqa: E402
from recompute import Made, Remade, keep_less  # noqa: E402

MiB, KiB = 2**20, 2**10


class Largest(TorchDispatchMode):
    """The largest boolean tensor (entries) and the most new bytes alive at once, while on."""

    def __init__(self):
        super().__init__()
        self.bools, self.alive, self.peak = 0, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {}))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if t.dtype == torch.bool:
                    self.bools = max(self.bools, t.numel())
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes():
                    self.alive[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))
        return out


def pretend(cuda: bool):
    for module in (attention, logprobs_module):
        module.on_cuda = (lambda device: True) if cuda else \
            (lambda device: torch.device(device).type == "cuda")


def shared_prompt(cuda: bool, P=2048, G=8, n=256, H=12, KV=2, D=128) -> float:
    pretend(cuda)
    torch.manual_seed(0)
    L = P + G * n
    layout = attention.prefix_layout([(0, P)], [(0, P + i * n, n) for i in range(G)], L, "cpu",
                                     heads=H)
    q, k, v = (torch.randn(1, h, L, D, dtype=torch.bfloat16, requires_grad=True)
               for h in (H, KV, KV))
    made = Made()
    with Remade(), made:
        out = attention.prefix_shared_attention(q, k, v, layout, D ** -0.5, 0.0)
    held = made.held_bytes() - out.untyped_storage().nbytes()
    pretend(False)
    return held / MiB


def gemma2_per_token(lengths=(256, 512, 1024, 2048)) -> list[float]:
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=1024,
        query_pre_attn_scalar=32, max_position_embeddings=4096)).to(torch.bfloat16)
    attention.use_smolrl_attention(model)
    keep_less(model)
    model.train()
    out = []
    for T in lengths:
        made = Made()
        with made:
            hidden = model.get_decoder()(input_ids=torch.randint(3, 256, (1, T)),
                                         use_cache=False).last_hidden_state
        out.append((made.held_bytes() - hidden.untyped_storage().nbytes()) / T / KiB)
        del hidden
    return out


def logprob_chunk(n=512, V=32768, H=64) -> tuple[float, float]:
    pretend(True)
    torch.manual_seed(0)
    hidden = torch.randn(n, H, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H) * 0.02).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (n,))
    with Largest() as forward:
        logp, _ = logprobs_module.LinearHeadLogprobs.apply(hidden, weight, targets, 1.0, 0.0, 1.0)
    with Largest() as backward:
        logp.sum().backward()
    pretend(False)
    head_gradient = 2 * V * H  # (planned apart: gpu_memory)
    return forward.peak / (n * V), (backward.peak - head_gradient) / (n * V)


def activations(name: str) -> tuple[float, float]:
    import tempfile

    import transformers
    widths = {"Qwen2.5-1.5B": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960,
                                                   num_attention_heads=12, num_key_value_heads=2)),
              "SmolLM2-135M": ("LlamaConfig", dict(hidden_size=576, intermediate_size=1536,
                                                   num_attention_heads=9,
                                                   num_key_value_heads=3))}[name]
    config = getattr(transformers, widths[0])(vocab_size=256, num_hidden_layers=2,
                                              max_position_embeddings=4096, **widths[1])
    folder = tempfile.mkdtemp()
    config.save_pretrained(folder)
    planned = gpu_memory.activation_bytes(folder)[0]
    torch.manual_seed(0)
    trained = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    attention.use_smolrl_attention(trained)
    keep_less(trained)
    trained.train()
    held = []
    for T in (128, 256):
        made = Made()
        with made:
            out = trained.get_decoder()(input_ids=torch.randint(3, 256, (1, T)),
                                        use_cache=False).last_hidden_state
        held.append(made.held_bytes() - out.untyped_storage().nbytes())
        del out
    return planned / 2 / KiB, (held[1] - held[0]) / 128 / 2 / KiB


def prefill_mask(prompts=16, longest=1024) -> int:
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout import HFRollout
    from sampling import Sampling
    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, max_position_embeddings=2048))
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2,
                          batch_decode=lambda ids, skip_special_tokens: [""] * len(ids))
    engine = HFRollout(net, tok, dtype=torch.float32)
    lengths = torch.linspace(longest // 2, longest, prompts).int().tolist()
    with Largest() as seen:
        engine.generate([torch.randint(3, 300, (n,)).tolist() for n in lengths], 1,
                        Sampling(max_new_tokens=2))
    return seen.bools


def packed_mask(row=2048) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sft import Example, pack_rows, token_logprobs
    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, max_position_embeddings=4096))
    attention.use_smolrl_attention(net)
    examples = [Example(torch.randint(3, 300, (n,)).tolist(), [False] + [True] * (n - 1))
                for n in (300, 500, 700, 400, 600, 800, 200, 900)]
    with Largest() as seen:
        token_logprobs(net, pack_rows(examples, row, 0), "cpu", bf16=False)
    return seen.bools


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"1. shared prompt, one layer's attention kept for backward: CPU path "
          f"{shared_prompt(False):.1f} MiB, CUDA path {shared_prompt(True):.1f} MiB")
    print("2. Gemma 2 soft-capped, kept per token: " + ", ".join(
        f"{b:.1f} KiB at {T}" for T, b in zip((256, 512, 1024, 2048), gemma2_per_token())))
    f, b = logprob_chunk()
    print(f"3. log-prob chunk at its peak (a GPU's row blocks): forward {f:.2f}, backward {b:.2f} "
          f"bytes an entry (+ the head's gradient); planned {gpu_memory.LOGITS_BYTES}")
    for name in ("Qwen2.5-1.5B", "SmolLM2-135M"):
        planned, kept = activations(name)
        print(f"4. {name}: the plan's activations {planned:.1f} KiB a token and layer, the "
              f"trained copy keeps {kept:.1f} ({planned / kept:.2f}x)")
    for longest in (1024, 2048):
        print(f"5. largest mask of a prefill of 16 prompts of up to {longest:,} tokens: "
              f"{prefill_mask(longest=longest):,} entries (in one call: 16 x {longest:,}^2 = "
              f"{16 * longest**2:,})")
    print(f"5. largest mask of sft.py's rows packed to 2,048 tokens: {packed_mask():,} entries "
          f"(the rows' dense mask: 12,000,000)")

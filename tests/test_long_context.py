"""The GPU plan at long context (issue 69): no buffer that grows with the square of the sequence
unless the plan counts it, and none a kernel can avoid. Measured on the CPU -- the bytes a forward
leaves for its backward (recompute.Made), the most the ops hold at once (NewStorages) -- with every
CUDA branch taken by pretending the device (attention.on_cuda, logprobs.on_cuda): the CPU's SDPA
kernels keep for backward what CUDA's keep for the same call (the inputs, the output, the
log-sum-exp, and a mask when one is given). Each new kernel is checked against the one it
replaced, outputs and gradients, fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F

import attention
import gpu_memory
import logprobs as logprobs_module
from recompute import Made, Remade, keep_less
from test_gpu_memory import NewStorages


@pytest.fixture
def pretend_cuda(monkeypatch):
    """Every device choice of attention.py and logprobs.py answered as on a CUDA GPU."""
    for module in (attention, logprobs_module):
        monkeypatch.setattr(module, "on_cuda", lambda device: True)


class BoolTensors:
    """The largest boolean tensor (entries) the ops make while it is on: a mask's footprint."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        tracker = self
        self.largest = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                        tracker.largest = max(tracker.largest, t.numel())
                return out
        self.mode = Mode()


# ---------------------------------------------------------------------------------------------
# 1. Shared prompts: what a layer keeps for backward, on CUDA as on a CPU


def _kept_by_shared_attention(P: int, G: int, n: int, H=4, KV=2, D=16) -> tuple[int, int]:
    """(bytes, largest storage) one layer's prefix_shared_attention leaves for backward, in bf16,
    as the trained copy runs it (a recompute.Remade scope): a prompt of P tokens and G
    completions of n after it."""
    torch.manual_seed(0)
    L = P + G * n
    layout = attention.prefix_layout([(0, P)], [(0, P + i * n, n) for i in range(G)], L, "cpu")
    q, k, v = (torch.randn(1, h, L, D, dtype=torch.bfloat16, requires_grad=True)
               for h in (H, KV, KV))
    made = Made()
    with Remade(), made:
        out = attention.prefix_shared_attention(q, k, v, layout, D ** -0.5, 0.0)
    alive = [t for t in (ref() for ref in made.made) if t is not None]
    largest = max(t.untyped_storage().nbytes() for t in alive)
    held = made.held_bytes()
    del out
    return held, largest


def test_a_shared_prompt_keeps_as_little_on_cuda_as_on_a_cpu_and_nothing_square(monkeypatch):
    """Issue 69: on CUDA the prompt part ran with a mask and its KV heads repeated, the
    completions with their keys and values repeated: SDPA kept those and a bias from the mask for
    backward (161 MiB a layer at a 2,048-token prompt and 8 completions of 256, Qwen's heads,
    where the CPU path kept 43). Long rows (SDPA's kernels) keep at most 1.25x the CPU path's
    bytes with the device pretended, and neither path keeps a buffer of the prompt's square."""
    monkeypatch.setattr(attention, "SMALL_SCORES", 0)  # (every row a long one: SDPA)
    P, G, n = 512, 4, 64
    cpu, cpu_largest = _kept_by_shared_attention(P, G, n)
    monkeypatch.setattr(attention, "on_cuda", lambda device: True)
    cuda, cuda_largest = _kept_by_shared_attention(P, G, n)
    assert cuda <= 1.25 * cpu, (cuda / 2**20, cpu / 2**20)
    assert max(cpu_largest, cuda_largest) < P * P, (cpu_largest, cuda_largest)


# ---------------------------------------------------------------------------------------------
# 2. Gemma 2's soft-capped attention: linear in the length, exact, and decoding from the cache


def _gemma2(window: int, layers: int = 2):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=window, query_pre_attn_scalar=16,
        max_position_embeddings=4096, eos_token_id=2, bos_token_id=1, pad_token_id=0))


def test_soft_capped_attention_keeps_bytes_per_token_flat_in_the_length():
    """Issue 69: softcapped_attention kept ~10 bytes per fp32 score for backward (tanh, softmax,
    bf16 probabilities): quadratic, where the plan keeps a flat figure per token. A bf16 Gemma 2
    (a sliding window of 1,024 and a global layer) as the trained copy runs it: the bytes its
    forward leaves for backward per token, at 2,048 tokens within 25 % of those at 512."""
    from attention import use_smolrl_attention
    model = _gemma2(window=1024).to(torch.bfloat16)
    assert use_smolrl_attention(model)
    keep_less(model)
    model.train()
    per_token = {}
    for T in (512, 2048):
        ids = torch.randint(3, 256, (1, T))
        made = Made()
        with made:
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        per_token[T] = made.held_bytes() / T
        del hidden
    assert per_token[2048] <= 1.25 * per_token[512], per_token


def _softcapped_reference(q, k, v, mask, scaling, cap, window=None):
    """Gemma 2's eager attention as it defines it, in the inputs' dtype: q (B, H, n, D), k and v
    (B, KV, m, D), mask bool (True: attend) or additive, or None: causal, the n queries the last
    n of the m positions, within `window` of each other where given."""
    H, KV, n, m = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(H // KV, dim=1) for x in (k, v))
    scores = torch.tanh(q @ k.transpose(-1, -2) * scaling / cap) * cap
    if mask is None:
        i, j = torch.arange(n)[:, None] + m - n, torch.arange(m)[None]
        mask = (j <= i) & ((i - j < window) if window else True)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masking", ["causal", "window", "left-padded", "additive"])
def test_soft_capped_attention_in_chunks_is_the_models_own(dtype, masking, monkeypatch):
    """The chunked soft-capped attention (its backward remakes each chunk's probabilities) against
    the model's definition in fp64: outputs and gradients, over many query chunks (a few scores a
    chunk), with no mask (causal; and within a sliding window), a left-padded bool mask whose
    padding queries attend to nothing, and an additive one."""
    monkeypatch.setattr(attention, "SOFTCAP_SCORES", 64)
    torch.manual_seed(0)
    B, H, KV, n, m, D = 2, 4, 2, 7, 9, 8
    q, k, v = (torch.randn(B, h, length, D).mul(3).to(dtype).requires_grad_()
               for h, length in ((H, n), (KV, m), (KV, m)))
    window, mask = (3 if masking == "window" else None), None
    if masking == "left-padded":
        mask = torch.ones(B, 1, n, m, dtype=torch.bool).tril(m - n)
        mask[1, :, :, :4] = False  # the second row's first four keys are padding
    elif masking == "additive":
        mask = torch.randn(B, 1, n, m)
    d_out = torch.randn(B, n, H, D)
    got = attention.softcapped_attention(q, k, v, mask, 0.4, 5.0, 0.0, True, window=window)
    got.backward(d_out.to(dtype))
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _softcapped_reference(*ref, None if mask is None else mask.double()
                                 if mask.dtype != torch.bool else mask, 0.4, 5.0, window)
    want.backward(d_out.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    assert got.dtype == dtype and all(t.grad.dtype == dtype for t in (q, k, v))
    torch.testing.assert_close(got.double(), want, **tol)
    for mine, theirs, name in zip((q, k, v), ref, "qkv"):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_soft_capped_decoding_step_reads_the_cache_as_it_is(dtype):
    """Issue 69: a decoding step of a soft-capped layer repeated the whole KV cache for every
    query head and copied it to fp32 (a layer's cache x 2 heads-per-KV-head x 2, every layer,
    every step). Now as the other layers decode (decode_attention): the step allocates less than
    one layer's keys, and gives the model's attention."""
    torch.manual_seed(0)
    B, H, KV, m, D = 4, 8, 2, 512, 32
    q = torch.randn(B, H, 1, D).to(dtype)
    k, v = (torch.randn(B, KV, m, D).to(dtype) for _ in range(2))
    mask = torch.ones(B, 1, 1, m, dtype=torch.bool)
    mask[0, ..., :100] = False  # a left-padded row
    new = NewStorages()
    with new.mode, torch.no_grad():
        out, _ = attention.attention(torch.nn.Module(), q, k, v, mask, scaling=0.2, softcap=5.0,
                                     sliding_window=None)
    assert new.peak < k.nbytes, (new.peak, k.nbytes)
    want = _softcapped_reference(q.double(), k.double(), v.double(), mask, 0.2, 5.0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 3e-2}
    torch.testing.assert_close(out.double(), want, **tol)


# ---------------------------------------------------------------------------------------------
# 3. A log-prob chunk at its peak, against the plan


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("cap", [0.0, 30.0])
def test_a_log_prob_chunk_peaks_within_what_the_plan_assumes(cap, keep, pretend_cuda):
    """Issue 69: on a GPU all of a chunk's rows went through the fp32 softmax at once -- bf16
    logits, fp32 z, fp32 e and the product linalg.vecdot made: 14 bytes per (token, vocabulary
    entry) against the plan's 8 (and Gemma's soft-capped head went through autograd: ~20). The
    most LinearHeadLogprobs holds at once, forward and backward, with the device pretended, is
    within what the plan counts: LOGITS_BYTES an entry, and the head's bf16 gradient -- also where
    the chunk keeps its logits for the backward (a batch of one chunk), counted while they wait."""
    torch.manual_seed(0)
    n, V, H = 512, 32768, 64
    hidden = torch.randn(n, H, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H) * 0.02).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (n,))
    held = NewStorages()  # forward and backward: what the forward keeps counts in the backward
    with held.mode:
        logp, _ = logprobs_module.LinearHeadLogprobs.apply(hidden, weight, targets, 1.0, cap, 0.7,
                                                           keep)
    with held.mode:
        logp.sum().backward()
    planned = gpu_memory.LOGITS_BYTES * n * V + 2 * V * H
    assert held.peak <= planned, held.peak / (n * V)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("run", ["lora-bf16", "full-fp32"])
def test_a_log_prob_chunk_of_lora_or_fp32_peaks_within_what_the_plan_assumes(run, keep,
                                                                             pretend_cuda):
    """(found by review) Under LoRA the head is the frozen fp32 base, and LinearHeadLogprobs casts
    it to bf16 for its matmul, forward and backward: vocabulary x hidden x 2 bytes beside the
    chunk's logits, which the plan counted only under full fine-tuning (as the head's gradient):
    6 bytes an entry here against the plan's 3, ~1.4 GiB at Qwen2.5-7B's head. And an fp32 run's
    logits are fp32. The peak, forward and backward, within gpu_memory.logits_bytes."""
    torch.manual_seed(0)
    n, V, H = 256, 16384, 512
    lora = run.startswith("lora")
    hidden = torch.randn(n, H, dtype=torch.bfloat16 if lora else torch.float32,
                         requires_grad=True)
    weight = (torch.randn(V, H) * 0.02).requires_grad_(not lora)  # fp32 either way
    targets = torch.randint(0, V, (n,))
    held = NewStorages()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=lora), held.mode:
        logp, _ = logprobs_module.LinearHeadLogprobs.apply(hidden, weight, targets, 1.0, 0.0, 0.7,
                                                           keep)
    with held.mode:
        logp.sum().backward()
    planned = gpu_memory.logits_bytes(n, V, H, lora_rank=16 if lora else 0, bf16=lora)
    assert held.peak <= planned, (held.peak / (n * V), planned / (n * V))


# ---------------------------------------------------------------------------------------------
# 5. No square mask in the HF engine's prefill or sft.py's packed rows


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_long_prefill_runs_in_chunks_without_a_square_mask(arch, tiny_model, monkeypatch):
    """Issue 69: the HF engine prefilled a batch of left-padded prompts in one call, with a
    (B, 1, P, P) mask (on CUDA SDPA makes a bf16 bias of it in every layer): tens of GB for 32
    prompts of 16K. Now a batch's prompts go through in chunks of at most PREFILL_TOKENS tokens:
    no boolean tensor larger than a chunk's rows x the row's length, and the same tokens and
    log-probs as one call (a tiny Llama; a tiny Gemma 2 whose sliding window the prompts pass)."""
    from types import SimpleNamespace

    import rollout as rollout_module
    import sampling as sampling_module
    from rollout import HFRollout
    from sampling import Sampling
    from test_rollout import _tiny_gemma2
    model = _tiny_gemma2(window=6) if arch == "gemma2" else tiny_model[0]
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2,
                          batch_decode=lambda ids, skip_special_tokens: [""] * len(ids))
    engine = HFRollout(model, tok, dtype=torch.float32, logprobs=True)
    engine.stop_ids = {-1}  # every sample to the limit
    monkeypatch.setattr(sampling_module, "inverse_cdf", lambda probs, r: probs.argmax(-1))
    prompts = [list(range(10, 50)), list(range(60, 73)), list(range(80, 107))]  # 40, 13, 27
    sampling = Sampling(max_new_tokens=4, temperature=1.0)
    whole = engine.generate(prompts, 2, sampling)
    monkeypatch.setattr(rollout_module, "PREFILL_TOKENS", 12)  # 4 columns of 3 prompts a chunk
    masks = BoolTensors()
    with masks.mode:
        chunked = engine.generate(prompts, 2, sampling)
    assert masks.largest <= 12 * (40 + 4), masks.largest
    assert chunked.completion_ids == whole.completion_ids
    for got, want in zip(chunked.engine_logprobs, whole.engine_logprobs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("blocks", ["short", "long"])
def test_packed_rows_attend_within_their_sequences_without_a_square_mask(blocks, tiny_model,
                                                                         monkeypatch):
    """Issue 69: sft.py's --packing built a (rows, 1, L, L) mask for the whole step (on CUDA SDPA
    keeps a bf16 bias of it for every layer's backward). Packed rows now reach smolrl's attention
    as where their sequences are (attention.PrefixLayout): every sequence's log-probs are those
    it gets in a row of its own -- as matmuls over its own tokens (short), or through SDPA's
    causal kernel (long: no mask at all, not even a sequence's square)."""
    from sft import Example, best_fit, pack_rows, token_logprobs
    if blocks == "long":
        monkeypatch.setattr(attention, "SMALL_SCORES", 0)
    model = tiny_model[0]
    torch.manual_seed(0)
    lengths = [30, 50, 20, 60, 40]
    examples = [Example(torch.randint(3, 200, (n,)).tolist(), [False] + [True] * (n - 1))
                for n in lengths]
    L = 128
    masks = BoolTensors()
    with masks.mode:
        packed = pack_rows(examples, L, 0)
        logprobs, _ = token_logprobs(model, packed, "cpu", bf16=False)
    if blocks == "long":
        assert masks.largest < L * len(lengths), masks.largest
    alone = pack_rows(examples, None, 0)
    apart, _ = token_logprobs(model, alone, "cpu", bf16=False)
    rows = best_fit(lengths, L)  # (pack_rows' own packing)
    assert len(rows) < len(examples)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            torch.testing.assert_close(logprobs[r, at:at + lengths[i]], apart[i, :lengths[i]],
                                       rtol=1e-5, atol=1e-5)
            at += lengths[i]

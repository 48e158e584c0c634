"""smolrl's attention: SDPA, except in the two places where smolrl knows the layout better than a
mask can say it.

    a decoding step (one query a row)      each KV head's keys and values read once for the query
                                           heads that share it, the softmax in fp32 (the engine);
                                           SDPA's flash kernel where timed faster (choose_decode)
    a packed row of a shared prompt        each completion against its prompt's keys and its own,
    (logprobs.share_prompts)                  never against the other completions of the row

The second is what makes prompt sharing pay on long rows. A GRPO group packed as one row -- its
prompt once, then its G completions -- is P + G n tokens long; SDPA given the row's mask still
computes every query against every key of the row, (P + G n)^2 pairs, and its masked kernel runs
slower than its causal one. Its keys are few and known: the prompt's and the completion's own.
So the completions are gathered into a batch of their own, each row the completion's n queries
against its prompt's P keys followed by its own n keys, and run through one attention call:
G n (P + n) pairs; the prompts likewise, each causal over its own P tokens. (Prefix-shared or
"cascade" attention: Hydragen, Juravsky et al. 2024; FlashInfer's.) Since no position attends
by its place in a row, every group of a micro-batch goes into one row, end to end: the layers'
matmuls see no padding (rows of one group each, as long as the longest group, were ~20 % padding
in the default run's update). Short rows run as matmuls whose backward recomputes the probabilities
(SmallAttention), long ones through SDPA's causal kernels with no mask -- FlashAttention on a GPU,
nothing kept that grows with the square of a row (issue 69). And one case SDPA cannot compute:
scores soft-capped by tanh (Gemma 2's layers) are computed as the model defines them, a chunk of
queries at a time, the backward making the probabilities again (softcapped_attention).

    python -c "import attention"      # registers "smolrl" with transformers' AttentionInterface

A model takes it with use_smolrl_attention(model) (load_model and the HF engine call it). A model
whose attention is not pluggable keeps SDPA, and share_prompts hands its packed rows SDPA's mask --
as it does for a model with a sliding window or soft-capping (takes_layouts).
"""

import functools
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from hardware import DECODE_ENV, DECODE_PINS, decode_pin
from recompute import remake

NAME = "smolrl"
# The score a masked key gets, in the fp32 scores of every function below: the lowest finite one,
# as transformers' eager attention masks, not -inf. A query that may attend to nothing -- a
# left-padding column of a batch of prompts -- then averages every value instead of turning NaN;
# with -inf its NaN reached every real token through the next layer's values (0 x NaN) --
# issue 67: Gemma 2's greedy evaluation scored 0. Where a row has a key it may attend to, the
# two give the same probabilities (exp of either, less the row's maximum, is exactly 0).
MASKED = torch.finfo(torch.float32).min


class Block(NamedTuple):
    """One attention call of a packed batch: B rows of n queries, each row against its m keys,
    all found by flat position in the batch (row * L + position). A row shorter than its block
    repeats one of its real positions, whose outputs there are never read."""
    queries: torch.Tensor  # (B, n)
    keys: torch.Tensor  # (B, m)
    mask: object  # who sees whom, as SDPA takes it: (B, 1, n, m) bool in a small block; in a
    #               long one causal -- query i sees the keys up to m - n + i --, None where n == m
    #               (is_causal), else torch's lower-right CausalBias on CUDA (FlashAttention's own
    #               causal option: no mask is made) or the (n, m) bool on a CPU
    small: bool  # run as matmuls (SmallAttention)


class PrefixLayout(NamedTuple):
    """Where a packed batch's prompts and completions sit (logprobs.share_prompts builds it; sft.py
    too, for packed sequences: prompts without completions), said as the attention calls that
    compute it."""
    blocks: tuple  # Block: the prompts, then the completions (one block, or one a prompt)
    source: torch.Tensor  # (positions,) each position's output in cat(the blocks' outputs,
    #                       flattened, one zero row); padding's the zero row


def prefix_layout(prompt_at: list[tuple[int, int]], completion_at: list[tuple[int, int, int]],
                  positions: int, device, heads: int = 1) -> PrefixLayout:
    """The layout of `positions` packed positions that hold prompt r at prompt_at[r] = (start,
    length) and completion s at completion_at[s] = (its prompt, start, length); `heads`: the
    query heads, which size each block. Built on the host, handed over on `device`.

    A block too large for matmuls gets no mask where causal attention is exact, and goes to
    SDPA's causal kernels (FlashAttention on a GPU: no mask, no (P, P) anything): each prompt is
    causal over its own tokens, all that a real query of it sees (a prompt shorter than the
    block's longest is padded after its end, which only padding queries see); each completion
    sees its prompt's P keys, then its own n causally -- causal attention aligned to the lower
    right, exact where the block's completions all have that one prompt: long completions go a
    prompt a block."""
    blocks = [_prompt_block(prompt_at, heads)]  # (each with its rows' (start, length))
    if completion_at:
        P = max(prompt_at[r][1] for r, _, _ in completion_at)
        n = max(m for _, _, m in completion_at)
        groups = [completion_at] if len(completion_at) * heads * n * (P + n) <= SMALL_SCORES \
            else [[c for c in completion_at if c[0] == r]
                  for r in dict.fromkeys(r for r, _, _ in completion_at)]
        blocks += [_completion_block(prompt_at, group, heads, on_cuda(device)) for group in groups]
    total = sum(block.queries.numel() for block, _ in blocks)
    source, offset = torch.full((positions,), total), 0  # (total: the zero row)
    for block, rows in blocks:
        width = block.queries.shape[1]
        for b, (start, length) in enumerate(rows):
            source[start:start + length] = offset + b * width + torch.arange(length)
        offset += block.queries.numel()
    to = lambda x: x.to(device) if type(x) is torch.Tensor else x  # noqa: E731
    return PrefixLayout(tuple(Block(*map(to, block)) for block, _ in blocks), source.to(device))


def _prompt_block(prompt_at: list[tuple[int, int]], heads: int) -> tuple[Block, list]:
    """Each prompt causal over its own tokens, (R, P) queries and keys; and the rows' (start,
    length)."""
    R, P = len(prompt_at), max(m for _, m in prompt_at)
    i = torch.arange(P)
    start, P_of = (torch.tensor(x) for x in zip(*prompt_at))  # (R,) each
    tokens = start[:, None] + torch.where(i < P_of[:, None], i, 0)  # (R, P)
    small, mask = R * heads * P * P <= SMALL_SCORES, None
    if small:
        mask = ((i[None, :] <= i[:, None])[None] & (i < P_of[:, None])[:, None, :])[:, None]
    return Block(tokens, tokens, mask, small), list(prompt_at)


def _completion_block(prompt_at: list[tuple[int, int]], completions: list[tuple[int, int, int]],
                      heads: int, cuda: bool) -> tuple[Block, list]:
    """Each completion against its prompt's keys, then its own: (S, n) queries, (S, P + n) keys,
    P the longest of their prompts; and the rows' (start, length). Masked where small, or where
    a prompt is shorter than P (its padding keys would be seen)."""
    S, n = len(completions), max(m for _, _, m in completions)
    of, c_start, n_of = (torch.tensor(x) for x in zip(*completions))  # (S,) each
    p_start, P_of = (torch.tensor(x)[of] for x in zip(*prompt_at))  # (S,) each
    P = int(P_of.max())
    i, j = torch.arange(P), torch.arange(n)
    prompts = p_start[:, None] + torch.where(i < P_of[:, None], i, 0)  # (S, P)
    own = c_start[:, None] + torch.where(j < n_of[:, None], j, 0)  # (S, n)
    keys = torch.cat([prompts, own], dim=1)  # (S, P + n)
    if S * heads * n * (P + n) > SMALL_SCORES and bool((P_of == P).all()):
        causal = causal_lower_right(n, P + n) if cuda else \
            torch.ones(n, P + n, dtype=torch.bool).tril(P)
        return Block(own, keys, causal, False), [(s, m) for _, s, m in completions]
    sees_prompt = (i[None, None, :] < P_of[:, None, None]).expand(S, n, P)
    sees_own = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] < n_of[:, None, None])
    mask = torch.cat([sees_prompt, sees_own], dim=-1)[:, None]  # (S, 1, n, P + n)
    return Block(own, keys, mask, True), [(s, m) for _, s, m in completions]


def _gather(x, index):
    """The rows of x at `index`, any shape: (*index.shape, *x.shape[1:]). By index_select, whose
    backward sums the gradients of a row that several read with index_add_ (x[index]'s backward,
    index_put_, took ~4x as long on a CPU)."""
    return x.index_select(0, index.flatten()).view(*index.shape, *x.shape[1:])


def prefix_shared_attention(query, key, value, layout: PrefixLayout, scaling, dropout: float):
    """Attention over packed rows of shared prompts (see the module docstring), a block at a time.

    query (R, H, L, D), key and value (R, KV, L, D) -> (R, L, H, D)."""
    R, H, L, D = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(R * L, x.shape[1], D)  # noqa: E731 (R L, heads, D)
    query, key, value = flat(query), flat(key), flat(value)
    outputs = [block_attention(query, key, value, block, scaling, dropout).reshape(-1, H, D)
               for block in layout.blocks]
    return _gather(torch.cat(outputs + [outputs[0].new_zeros(1, H, D)]), layout.source).view(
        R, L, H, D)


SMALL_SCORES = 2**22  # attention scores a block may compute as matmuls (~16 MB in fp32 a layer)


def block_attention(query, key, value, block: Block, scaling, dropout: float):
    """One block's attention, from the batch's flat query (positions, H, D), key and value
    (positions, KV, D) -> (B, n, H, D). A masked block -- a prompt, a completion against it --
    runs as two matmuls and a softmax (SmallAttention): SDPA's CPU kernel pays per row block, and
    its backward took 2-4x as long as the matmuls' in bf16 at such sizes (a 2-core EPYC Zen 4).
    A long one goes to SDPA's causal kernels. Its keys and values (a prompt's copied once for
    each completion) the backward gathers again (recompute.py), and so it repeats them where a
    kernel needs one KV head per query head."""
    H, KV = query.shape[1], key.shape[1]
    q = _gather(query, block.queries).transpose(1, 2)  # (B, H, n, D)
    small = block.small and not dropout
    gqa = small or sdpa_takes_gqa(q, masked=block.small)

    index, copies = block.keys, 1 if gqa else H // KV  # (what the recipe below holds)

    def keys(x):  # (B, KV, m, D), or (B, H, m, D): each query head its own copy
        x = _gather(x, index).transpose(1, 2)
        return x if copies == 1 else x.repeat_interleave(copies, dim=1)

    k, v = (remake(keys(x), keys, x) for x in (key, value))
    if small:
        return SmallAttention.apply(q, k, v, block.mask, scaling).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block.mask,
                                          is_causal=block.mask is None, scale=scaling,
                                          dropout_p=dropout, enable_gqa=gqa).transpose(1, 2)


def on_cuda(device) -> bool:
    """Whether tensors on `device` run CUDA's kernels: every choice below that depends on the
    device asks this (the tests pretend a GPU by answering it)."""
    return torch.device(device).type == "cuda"


def sdpa_takes_gqa(query, masked: bool) -> bool:
    """Whether SDPA is handed the KV heads as they are (enable_gqa), or one per query head. On a
    CPU always. On CUDA only FlashAttention takes grouped heads (torch 2.13's sdp_utils: the
    memory-efficient kernel wants as many KV heads as query heads), and it takes no mask, no fp32
    and no head over 256 wide: otherwise SDPA given grouped heads falls back to its math kernel,
    which keeps the fp32 scores for backward (~9.9 GB a layer at 8K tokens, 12 heads);
    transformers' use_gqa_in_sdpa decides alike."""
    return not on_cuda(query.device) or (not masked and query.shape[-1] <= 256
                                         and query.dtype in (torch.float16, torch.bfloat16))


def _probs(q, k, mask, scaling):
    """softmax(q k^T scaling) where `mask` allows, in fp32 throughout as SDPA's kernel accumulates
    (scores rounded to bf16 would be off by ~0.4 % of their size). Each KV head's keys are read
    once for its g query heads: q (B, KV, g n, D), k (B, KV, m, D), mask (B, 1, n, m) bool -> (B,
    KV, g n, m). The scaling and the mask go in place -- a fresh tensor the scores' size costs a
    pass and its page faults on a CPU -- and the mask is added, 0 or fp32's lowest, as masked_fill
    with a broadcast mask ran ~14x slower than the add. lowest + s is lowest for |s| < 2^103, so
    the probabilities are masked_fill's bit for bit in any row with a key to see (every layout here
    has one): a NaN or +inf score where the mask hides it is no longer hidden, and a row with no
    key to see comes out uniform as before unless a score in it is below about -2^103 (lowest + s
    overflows to -inf: NaN). The product takes q and k laid out as the plain formula gave them: the
    CPU's fp32 matmul sums in another order for another layout of the same numbers."""
    B, KV, gn, _ = q.shape
    n, m = mask.shape[-2], k.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)).mul_(scaling)
    # (MASKED's value written out: torch.compile cannot trace a module global inside the
    # autograd.Function SmallAttention whose forward this is)
    hidden = torch.where(mask, 0.0, torch.finfo(torch.float32).min).float()[:, :, None]
    scores = scores.view(B, KV, gn // n, n, m).add_(hidden)  # (B, KV, g, n, m)
    return torch.softmax(scores, dim=-1).view(B, KV, gn, m)


def _softmax_backward(p, dp, scaling):
    """p (dp - rowsum(dp p)) scaling, in place on dp where no graph is recorded: the formula's
    bits without two fresh tensors the scores' size. A double backward (create_graph) records
    this, and dp * p keeps dp for it: there, out of place."""
    rowsum = (dp * p).sum(-1, keepdim=True)
    if torch.is_grad_enabled():
        return p * (dp - rowsum) * scaling
    return dp.sub_(rowsum).mul_(p).mul_(scaling)


def outside_autocast(fn):
    """fn with autocast off on a CPU and a GPU: its products run in the dtypes it writes, under a
    caller's bf16 autocast too (an autograd.Function's backward runs outside it anyway)."""
    return torch.autocast("cpu", enabled=False)(torch.autocast("cuda", enabled=False)(fn))


class SmallAttention(torch.autograd.Function):
    """Attention as matmuls whose backward recomputes the probabilities from q and k, as
    FlashAttention's does, instead of keeping them: autograd would keep the B H n m fp32
    probabilities and fp32 copies of q, k and v -- ~20 MB a layer for 16 multiply episodes, where
    all the rest of the layer's activations are ~40 MB. It keeps q, k and v as they came. The
    backward of o = p v, p = softmax(s), s = q k^T scaling:

        dv = p^T do      dp = do v^T      ds = p * (dp - rowsum(dp * p))
        dq = ds k scaling                 dk = ds^T q scaling

    The scores and the softmax are fp32 (_probs); the other products take their operands in the
    queries' dtype and sum in fp32 inside the matmul, as a CPU's and a GPU's bf16 matmuls do. In
    a bf16 model that rounds p and ds to bf16 before their products, as FlashAttention-2 does,
    and dp as it comes out of its product (FlashAttention-2 keeps dp in fp32). The gradients of
    q and k then err against fp64 by ~2.9e-3 of their size (at 64 to 512 keys; 2.4e-3 with dp in
    fp32, and about two thirds of that with every product in fp32, as before). The engine's
    decode_attention rounds p alike. In bf16 on a CPU those products run ~2.5x faster than in
    fp32 (a 2-core Zen 4, at the default run's shapes: one layer's forward and backward 17-19 ->
    12 ms), and the fp32 copies of v and d_out go. An fp32 model computes all of it in fp32, and
    so does one under bf16 autocast (LoRA, FSDP2), whose rotary embedding hands over q and k in
    fp32 beside a bf16 v: their numbers are what they were before (tests/test_model.py)."""

    @staticmethod
    @outside_autocast
    def forward(ctx, q, k, v, mask, scaling):
        B, H, n, D = q.shape
        KV = k.shape[1]
        ctx.save_for_backward(q, k, v, mask)
        ctx.scaling = scaling
        p = _probs(q.reshape(B, KV, H // KV * n, D), k, mask, scaling)  # (B, KV, g n, m) fp32
        return (p.to(q.dtype) @ v.to(q.dtype)).view(B, H, n, D).to(v.dtype)

    @staticmethod
    @outside_autocast
    def backward(ctx, d_out):
        q, k, v, mask = ctx.saved_tensors
        B, H, n, D = q.shape
        KV = k.shape[1]
        dtype = q.dtype  # the products'
        q = q.reshape(B, KV, H // KV * n, D)  # (B, KV, g n, D)
        p = _probs(q, k, mask, ctx.scaling)  # (B, KV, g n, m) fp32, recomputed
        d_out = d_out.to(dtype).reshape(B, KV, H // KV * n, D)
        dv = p.to(dtype).transpose(-1, -2) @ d_out  # (B, KV, m, D)
        dp = (d_out @ v.to(dtype).transpose(-1, -2)).float()  # (B, KV, g n, m)
        ds = _softmax_backward(p, dp, ctx.scaling).to(dtype)
        dq = (ds @ k.to(dtype)).view(B, H, n, D)
        dk = ds.transpose(-1, -2) @ q  # (B, KV, m, D): summed over each head's g queries
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def decode_attention(query, key, value, attention_mask, scaling, softcap: float | None = None):
    """A decoding step. Its cost is reading the keys and values: here each KV head's are read
    once for the query heads that share it (grouped-query attention), as they are in the cache,
    with the softmax in fp32 -- and the scores soft-capped where the model caps them (Gemma 2).
    transformers' SDPA call took 17 ms a layer for 64 rows of 400 tokens in bf16 (ca8979e) -- 70 %
    of a SmolLM2 decoding step: given a padding mask on a CPU it repeats each KV head for the query
    heads that share it, a copy of the cache 3x its size. (SDPA's flash kernel told the KV heads
    are shared, enable_gqa, is flash_decode_attention.)

    query (B, H, 1, D), key and value (B, KV, L, D), attention_mask (B, 1, 1, L) bool (True:
    attend) or additive, or None -> (B, 1, H, D)."""
    B, H, _, D = query.shape
    KV, L = key.shape[1], key.shape[2]
    q = query.reshape(B, KV, H // KV, D)  # the query heads of each KV head
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scaling  # (B, KV, H/KV, L)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, -L:]  # (B, 1, 1, L)
        scores = scores.masked_fill(~mask, MASKED) if mask.dtype == torch.bool \
            else scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # (B, KV, H/KV, D)
    return out.reshape(B, 1, H, D)


class DecodeChoice(NamedTuple):
    flash: bool  # decoding steps run SDPA's flash kernel (flash_decode_attention)
    grows: bool  # the engine's cache grows in place (rollout.GrowingLayer): attention reads views
    line: str  # one line for the log: what was chosen, why, with the measured times
    mode: str = ""  # as SMOLRL_DECODE says it (flash, grow, concat) where a CPU chose, timed or
    # pinned: what a run records for its resumption to decode alike; "" where it decodes as before


class DecodeTimes(NamedTuple):
    """Microseconds of one layer's decoding attention at DECODE_PROBE."""
    flash: float  # flash_decode_attention on a growing cache's view
    view: float  # decode_attention on that view
    copied: float  # decode_attention on contiguous keys, plus the concatenation that made them


FLASH_MARGIN = 0.8  # flash is chosen at no more than this share of the matmuls' time: nearer
# timings are noise, and the choice changes the samples' last bits
DECODE_PROBE = (32, 128)  # rows, cached tokens: a GRPO batch's decoding steps


def choose_decode(config, dtype: torch.dtype, device, own_attention: bool = False,
                  recorded: str = "") -> DecodeChoice:
    """How the HF engine decodes a model with this (text) config, timed here once per process and
    head shape. transformers' cache concatenates each step's keys and values onto the layer's: a
    copy of the whole cache, every layer, every step (~a third of a SmolLM2 decoding step in bf16
    on the AMX Xeon). A cache with room grows in place instead (rollout.GrowingLayer), but then
    attention reads its filled columns as a strided view: CPU bmm takes it as it is in fp32 (within
    10 % of contiguous keys on that Xeon) but copies it first in bf16 (2.2x), and keys just
    concatenated are in the CPU's cache when attention reads them (on an AVX2 EPYC in fp32 a
    cache written in place made a generate call slower, 8.05 -> 9.05 s). decode_attention gives
    the same numbers on the view and on a copy, so the cache grows where that timed faster. SDPA's
    flash kernel reads the view as it is but sums in another order: in bf16 only (fp32 keeps its
    samples bit for bit), where it takes at most FLASH_MARGIN of the matmuls' best time; the engine
    then asks for it in each decoding step's forward (`flash_decode=True`, which transformers hands
    to attention()). Soft-capped scores (Gemma 2: no flash kernel computes them), CUDA (not
    measured) and a model on its own attention (`own_attention`: use_smolrl_attention could not
    switch it) decode as before. SMOLRL_DECODE=flash, grow or concat (DECODE_ENV) skips the timing:
    the choice is timed on one thread, as hardware.cpu_dtype times the dtype, but it is still a
    timing, and flash or not changes a bf16 run's samples. So the engines of one run decode alike,
    untimed, as the run chose (`recorded`, one of those three: its first engine's choice, which a
    resumed run reads back from its config's "decoding"), unless SMOLRL_DECODE says otherwise."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    forced = decode_pin()
    said = f"{DECODE_ENV}={forced}"
    if not forced and recorded in DECODE_PINS:
        forced, said = recorded, f"as the run chose: {recorded}"
    before = "the model's own attention" if own_attention else \
        "soft-capped scores" if getattr(config, "attn_logit_softcapping", None) else \
        "on CUDA" if on_cuda(device) else ""
    if before:
        ignored = f"; {said} ignored" if forced else ""
        return DecodeChoice(False, False, f"decoding as before, on a concatenated cache ({before}"
                                          f"{ignored})")
    if forced:
        flash, grows = forced == "flash" and dtype != torch.float32, forced != "concat"
        fp32 = " (fp32 is never flash)" if forced == "flash" and not flash else ""
        return DecodeChoice(flash, grows, f"decoding: {_how(flash, grows)} ({said}{fp32})",
                            _mode(flash, grows))
    t = decode_times(heads, kv, dim, dtype)
    flash = dtype != torch.float32 and t.flash <= FLASH_MARGIN * min(t.view, t.copied)
    grows = flash or t.view <= t.copied
    rows, context = DECODE_PROBE
    odd = f"; the run's config records {recorded[:32]!r}, none of {', '.join(DECODE_PINS)}" \
        if recorded else ""  # (a valid one was taken above)
    return DecodeChoice(flash, grows, (
        f"decoding: {_how(flash, grows)} ({str(dtype).removeprefix('torch.')}; one layer's "
        f"attention for {rows} rows of {context} tokens, timed here on one thread: flash "
        f"{t.flash:.0f} us, matmuls on a growing cache {t.view:.0f} us, on a concatenated one "
        f"{t.copied:.0f} us{odd})"), _mode(flash, grows))


def _mode(flash: bool, grows: bool) -> str:
    return "flash" if flash else "grow" if grows else "concat"


def _how(flash: bool, grows: bool) -> str:
    return ("SDPA's flash kernel" if flash else "matmuls") + \
        (" on a cache grown in place" if grows else " on a concatenated cache")


@functools.cache
def decode_times(heads: int, kv: int, dim: int, dtype: torch.dtype) -> DecodeTimes:
    """One layer's decoding attention at DECODE_PROBE, each way the fastest of 5 rounds, on one
    thread (~0.2 s, once a process): timed on all threads beside a busy core, flash's share of
    the matmuls' time ranged from 0.22 to 12 between calls; on one it held at 0.4-0.7."""
    rows, context = DECODE_PROBE
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(rows, kv, context + 64, dim, generator=gen).to(dtype)
                    for _ in range(2))
    k, v = keys[:, :, :context], values[:, :, :context]  # (a growing cache's filled columns)
    kc, vc = k.contiguous(), v.contiguous()
    q = torch.randn(rows, heads, 1, dim, generator=gen).to(dtype)
    mask = torch.ones(rows, 1, 1, context, dtype=torch.bool)
    scaling = dim ** -0.5

    def copied():
        torch.cat([kc[:, :, 1:], kc[:, :, :1]], 2), torch.cat([vc[:, :, 1:], vc[:, :, :1]], 2)
        decode_attention(q, kc, vc, mask, scaling)

    def microseconds(fn) -> float:
        fn()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(4):
                fn()
            rounds.append((time.perf_counter() - t0) / 4 * 1e6)
        return min(rounds)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return DecodeTimes(microseconds(lambda: flash_decode_attention(q, k, v, mask, scaling)),
                           microseconds(lambda: decode_attention(q, k, v, mask, scaling)),
                           microseconds(copied))
    finally:
        torch.set_num_threads(threads)


def flash_decode_attention(query, key, value, attention_mask, scaling):
    """A decoding step by SDPA's CPU flash kernel, each KV head read once for the query heads that
    share it (enable_gqa), in blocks with an fp32 running softmax: 1.0 ms against
    decode_attention's 1.2 ms plus the concatenation's 0.8 ms (64 rows of 400 tokens, bf16, AMX
    Xeon; decode_attention on the view: 2.8 ms). Its sums run in another order than
    decode_attention's: outputs ~0.003 apart in bf16.

    query (B, H, 1, D), key and value (B, KV, L, D), a view is fine, attention_mask (B, 1, 1, L)
    bool (True: attend) or additive, or None -> (B, 1, H, D). (A row that may attend to nothing
    comes out 0 where decode_attention averages the values; a decoding query sees its own key.)"""
    mask = attention_mask[..., -key.shape[2]:] if attention_mask is not None else None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=True)  # (B, H, 1, D)
    return out.transpose(1, 2)


SOFTCAP_SCORES = 2**22  # scores softcapped_attention computes at once (~16 MB in fp32 each)


# (Outside autocast: under a caller's bf16 autocast the scores' product ran in bf16, which cannot
# hold MASKED.)
@outside_autocast
def softcapped_attention(query, key, value, attention_mask, scaling, softcap: float,
                         dropout: float, training: bool, window: int | None = None):
    """Attention whose scores are soft-capped, s -> cap tanh(s / cap) (Gemma 2's layers), which
    SDPA cannot do: handed to SDPA the cap was dropped (0.29 nats a token from the model's own
    definition on a small Gemma 2). As the model's eager attention computes it, with the scores in
    fp32 (SDPA's kernels accumulate so) -- a chunk of queries at a time, and the backward makes
    each chunk's probabilities again (SoftcappedAttention): it keeps q, k and v, where autograd
    kept ~10 bytes a score (issue 69: 93 -> 205 KiB a token from 256 to 1,024 tokens, ~130 GiB
    of scores for an 8K sequence at Gemma-2-2B's shapes). With dropout, autograd keeps them.

    query (B, H, n, D), key and value (B, KV, m, D); attention_mask (B or 1, 1, n, m) bool (True:
    attend) or additive, or None: causal, the n queries the last n of the m positions, within
    `window` positions of each other where given (a sliding layer) -> (B, n, H, D)."""
    if dropout and training:  # (the backward would need the same random draws)
        out = _softcapped_chunks(query, key, value, attention_mask, scaling, softcap, window,
                                 dropout)
    else:
        out = SoftcappedAttention.apply(query, key, value, attention_mask, scaling, softcap,
                                        window)
    return out.transpose(1, 2)


def _chunks(query, m: int) -> list[slice]:
    """Slices of the n queries, each with at most SOFTCAP_SCORES scores over m keys."""
    B, H, n, _ = query.shape
    rows = max(1, SOFTCAP_SCORES // (B * H * m))
    return [slice(s, min(s + rows, n)) for s in range(0, n, rows)]


def _chunk_mask(mask, rows: slice, n: int, m: int, window: int | None, device):
    """The mask of queries `rows`: the given one's rows (B or 1, 1, c, m), or (1, 1, c, m) bool:
    causal, query i the position m - n + i, within `window` of it where given."""
    if mask is not None:
        return mask[:, :, rows, :m]
    i = torch.arange(rows.start, rows.stop, device=device)[:, None] + m - n  # (c, 1)
    j = torch.arange(m, device=device)  # (m,)
    sees = j <= i
    if window:
        sees &= i - j < window
    return sees[None, None]


def _capped_probs(q, k, mask, scaling, cap):
    """(tanh(s / cap), softmax of cap tanh(s / cap) where `mask` allows), s = q k^T scaling, all
    fp32: q (B, KV, g, c, D) a chunk of the g query heads of each KV head, k (B, KV, m, D), mask
    (B or 1, 1, c, m) -> (B, KV, g, c, m) each."""
    t = torch.tanh((q @ k[:, :, None].transpose(-1, -2)) * scaling / cap)
    capped = t * cap
    if mask.dtype == torch.bool:
        # (MASKED's value written out, as in _probs: traced inside an autograd.Function)
        capped = capped.masked_fill(~mask[:, :, None], torch.finfo(torch.float32).min)
    else:
        capped = capped + mask[:, :, None].float()
    return t, torch.softmax(capped, dim=-1)


def _softcapped_chunks(q, k, v, mask, scaling, cap, window, dropout: float = 0.0):
    """The soft-capped attention, chunk by chunk, as autograd differentiates it: q (B, H, n, D),
    k and v (B, KV, m, D) -> (B, H, n, D)."""
    B, H, n, D = q.shape
    KV, m = k.shape[1], k.shape[2]
    k32, out = k.float(), []
    for rows in _chunks(q, m):
        q32 = q[:, :, rows].float().reshape(B, KV, H // KV, -1, D)
        _, p = _capped_probs(q32, k32, _chunk_mask(mask, rows, n, m, window, q.device), scaling,
                             cap)
        p = F.dropout(p, p=dropout, training=True) if dropout else p
        out.append((p.to(v.dtype) @ v[:, :, None]).reshape(B, H, -1, D))
    return torch.cat(out, dim=2)


class SoftcappedAttention(torch.autograd.Function):
    """softcapped_attention's chunks, whose backward makes each chunk's probabilities again from q
    and k, as SmallAttention's does, instead of keeping them. The backward of o = p v,
    p = softmax(c), c = cap tanh(s / cap), s = q k^T scaling:

        dv = p^T do      dp = do v^T      dc = p * (dp - rowsum(dp * p))
        ds = dc (1 - tanh(s / cap)^2) scaling        dq = ds k      dk = ds^T q

    and a masked score's ds is 0 -- masked_fill passes it no gradient, also in a row whose every
    key is masked (a left-padding query), where p is uniform."""

    @staticmethod
    @outside_autocast
    def forward(ctx, q, k, v, mask, scaling, cap, window):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scaling, ctx.cap, ctx.window = scaling, cap, window
        with torch.no_grad():
            return _softcapped_chunks(q, k, v, mask, scaling, cap, window)

    @staticmethod
    @outside_autocast
    def backward(ctx, d_out):
        q, k, v, mask = ctx.saved_tensors
        B, H, n, D = q.shape
        KV, m = k.shape[1], k.shape[2]
        k32, v32 = k.float(), v.float()
        dq = torch.empty(B, H, n, D, device=q.device)
        dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
        for rows in _chunks(q, m):
            q32 = q[:, :, rows].float().reshape(B, KV, H // KV, -1, D)  # (B, KV, g, c, D)
            sees = _chunk_mask(mask, rows, n, m, ctx.window, q.device)
            t, p = _capped_probs(q32, k32, sees, ctx.scaling, ctx.cap)  # (B, KV, g, c, m)
            do = d_out[:, :, rows].float().reshape(q32.shape)
            dv += (p.transpose(-1, -2) @ do).sum(2)  # (B, KV, m, D): the g heads' sum
            dp = do @ v32[:, :, None].transpose(-1, -2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * (1 - t * t) * ctx.scaling
            if sees.dtype == torch.bool:
                ds = ds.masked_fill(~sees[:, :, None], 0)
            dq[:, :, rows] = (ds @ k32[:, :, None]).reshape(B, H, -1, D)
            dk += (ds.transpose(-1, -2) @ q32).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def takes_layouts(config) -> bool:
    """Whether every layer of a model with this (text) config attends to all earlier tokens,
    plainly: no sliding window, no soft-capping, no layer of another type (Qwen2's and Gemma's
    sliding layers). Packed rows of other models carry SDPA's mask instead (share_prompts)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return not getattr(config, "sliding_window", None) \
        and not getattr(config, "attn_logit_softcapping", None) \
        and all(t == "full_attention" for t in layer_types)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0,
              scaling: float | None = None, prefix_layout: PrefixLayout | None = None, **kwargs):
    """The attention function transformers calls in each layer ("smolrl"): the two cases above,
    soft-capped scores (softcapped_attention), and SDPA for everything else -- and for sliding
    windows (in the mask) and attention sinks, which neither case handles."""
    special = kwargs.get("sliding_window") or kwargs.get("softcap") \
        or getattr(module, "sinks", None) is not None
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if prefix_layout is not None:
        if special:  # (share_prompts hands a layout only where takes_layouts says so)
            raise ValueError("a packed row's layout reached a layer with a sliding window, "
                             "soft-capping or sinks: it needs SDPA's mask")
        return prefix_shared_attention(query, key, value, prefix_layout, scaling, dropout), None
    if query.shape[2] == 1 and key.shape[2] > 1 and getattr(module, "sinks", None) is None:
        # (a sliding window is in the mask: transformers skips it only within the window)
        if kwargs.get("flash_decode") and not kwargs.get("softcap"):
            return flash_decode_attention(query, key, value, attention_mask, scaling), None
        return decode_attention(query, key, value, attention_mask, scaling,
                                kwargs.get("softcap")), None
    if kwargs.get("softcap"):
        return softcapped_attention(query, key, value, attention_mask, scaling, kwargs["softcap"],
                                    dropout, module.training, kwargs.get("sliding_window")), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def attention_mask(*, config=None, **kwargs):
    """The masks smolrl's attention is given: SDPA's (transformers' sdpa_mask) -- but none for a
    soft-capped model's rows that start with no cache and hold no padding (a training forward),
    where softcapped_attention makes each chunk's causal and sliding-window mask itself: past
    the window transformers would make a (T, T) one for the sliding layers."""
    padding = kwargs.get("attention_mask")
    if getattr(config, "attn_logit_softcapping", None) and kwargs.get("allow_is_causal_skip") \
            and kwargs.get("q_offset", 0) == kwargs.get("kv_offset", 0) == 0 \
            and kwargs["q_length"] == kwargs["kv_length"] \
            and (padding is None or bool(padding.all())):
        return None
    return sdpa_mask(config=config, **kwargs)


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, attention_mask)


def use_smolrl_attention(model) -> bool:
    """Switch a model that runs SDPA to smolrl's attention; False where it cannot take it (a model
    that runs another attention, or whose attention is not pluggable, keeps its own)."""
    if model.config.get_text_config()._attn_implementation == NAME:
        return True
    if model.config.get_text_config()._attn_implementation != "sdpa":
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError):
        return False
    return model.config.get_text_config()._attn_implementation == NAME

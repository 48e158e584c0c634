"""smolrl's attention: SDPA, except in the two places where smolrl knows the layout better than a
mask can say it.

    a decoding step (one query a row)      each KV head's keys and values read once for the query
                                           heads that share it, the softmax in fp32 (the engine)
    a packed row of a shared prompt        each completion against its prompt's keys and its own,
    (model.share_prompts)                  never against the other completions of the row

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
(SmallAttention), long ones through SDPA. And one case SDPA cannot compute: scores soft-capped by
tanh (Gemma 2's layers) are computed as the model defines them (softcapped_attention).

    python -c "import attention"      # registers "smolrl" with transformers' AttentionInterface

A model takes it with use_smolrl_attention(model) (load_model and the HF engine call it). A model
whose attention is not pluggable keeps SDPA, and share_prompts hands its packed rows SDPA's mask --
as it does for a model with a sliding window or soft-capping (takes_layouts).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from recompute import remake

NAME = "smolrl"
# The score a masked key gets, in the fp32 scores of every function below: the lowest finite one,
# as transformers' eager attention masks, not -inf. A query that may attend to nothing -- a
# left-padding column of a batch of prompts -- then averages every value instead of turning NaN;
# with -inf its NaN reached every real token through the next layer's values (0 x NaN) --
# issue 67: Gemma 2's greedy evaluation scored 0. Where a row has a key it may attend to, the
# two give the same probabilities (exp of either, less the row's maximum, is exactly 0).
MASKED = torch.finfo(torch.float32).min


class PrefixLayout(NamedTuple):
    """Where a packed batch's prompts and completions sit (model.share_prompts builds it): R
    prompts of at most P tokens and S completions of at most n tokens, at flat positions
    (row * L + position; share_prompts packs them all into one row, without padding)."""
    prompts: torch.Tensor  # (R, P) each prompt's tokens (past its end: its first again)
    prompt_mask: torch.Tensor  # (R, 1, P, P) bool: causal, within the prompt
    queries: torch.Tensor  # (S, n) each completion's tokens (padding repeats its first)
    keys: torch.Tensor  # (S, P + n) the keys it sees: its prompt's, then its own
    mask: torch.Tensor  # (S, 1, n, P + n) bool: the real prompt keys, its own earlier tokens
    source: torch.Tensor  # (positions,) each position's output in cat(prompt outputs,
    #                       completion outputs, one zero row); padding's the zero row


def prefix_layout(prompt_at: list[tuple[int, int]], completion_at: list[tuple[int, int, int]],
                  positions: int, device) -> PrefixLayout:
    """The layout of `positions` packed positions that hold prompt r at prompt_at[r] = (start,
    length) and completion s at completion_at[s] = (its prompt, start, length). Built on the
    host, handed over on `device`."""
    R, S = len(prompt_at), len(completion_at)
    P, n = max(m for _, m in prompt_at), max(m for _, _, m in completion_at)
    i, j = torch.arange(P), torch.arange(n)
    start, P_of = (torch.tensor(x) for x in zip(*prompt_at))  # (R,) each
    of, c_start, n_of = (torch.tensor(x) for x in zip(*completion_at))  # (S,) each
    prompts = start[:, None] + torch.where(i < P_of[:, None], i, 0)  # (R, P)
    own = c_start[:, None] + torch.where(j < n_of[:, None], j, 0)  # (S, n)
    prompt_mask = (i[None, None, :] <= i[None, :, None]) \
        & (i[None, None, :] < P_of[:, None, None])  # (R, P, P)
    sees_prompt = (i[None, None, :] < P_of[of][:, None, None]).expand(S, n, P)
    sees_own = (j[None, None, :] <= j[None, :, None]) \
        & (j[None, None, :] < n_of[:, None, None])  # (S, n, n)
    mask = torch.cat([sees_prompt, sees_own], dim=-1)[:, None]  # (S, 1, n, P + n)
    source = torch.full((positions,), R * P + S * n)  # the zero row
    for r, (s0, m) in enumerate(prompt_at):
        source[s0:s0 + m] = r * P + torch.arange(m)
    for s, (_, s0, m) in enumerate(completion_at):
        source[s0:s0 + m] = R * P + s * n + torch.arange(m)
    return PrefixLayout(prompts.to(device), prompt_mask[:, None].to(device), own.to(device),
                        torch.cat([prompts[of], own], dim=1).to(device), mask.to(device),
                        source.to(device))


def prefix_shared_attention(query, key, value, layout: PrefixLayout, scaling, dropout: float):
    """Attention over packed rows of shared prompts (see the module docstring).

    query (R, H, L, D), key and value (R, KV, L, D) -> (R, L, H, D)."""
    R, H, L, D = query.shape
    # Gathered by index_select, whose backward sums the gradients of a key that several
    # completions read with index_add_ (x[index]'s backward, index_put_, took ~4x as long on a CPU)
    gather = lambda x, index: x.index_select(0, index.flatten()).view(  # noqa: E731
        *index.shape, *x.shape[1:])
    flat = lambda x: x.transpose(1, 2).reshape(R * L, x.shape[1], D)  # noqa: E731 (R L, heads, D)
    query, key, value = flat(query), flat(key), flat(value)
    # The prompts, causal among their own tokens: (prompts, H, P, D)
    head = small_attention(*(gather(x, layout.prompts).transpose(1, 2) for x in (query, key, value)),
                           layout.prompt_mask, scaling, dropout)
    # Each completion against its prompt's keys and its own: (S, H, n, D). Its keys and values
    # (the prompt's copied once for each completion) the backward gathers again (recompute.py).
    k, v = (remake(gather(x, layout.keys), gather, x, layout.keys) for x in (key, value))
    tail = small_attention(gather(query, layout.queries).transpose(1, 2), k.transpose(1, 2),
                           v.transpose(1, 2), layout.mask, scaling, dropout)
    outputs = torch.cat([head.transpose(1, 2).reshape(-1, H, D),
                         tail.transpose(1, 2).reshape(-1, H, D), head.new_zeros(1, H, D)])
    return gather(outputs, layout.source).view(R, L, H, D)


SMALL_SCORES = 2**22  # attention scores a call may compute (~16 MB in fp32 a layer)


def small_attention(q, k, v, mask, scaling, dropout: float):
    """SDPA's result for q (B, H, n, D), k and v (B, KV, m, D), mask (B or 1, 1, n, m) bool.
    Short rows -- a prompt, a completion against it -- run as two matmuls and a softmax
    (SmallAttention): SDPA's CPU kernel pays per row block, and its backward took 2-4x as long as
    the matmuls' in bf16 at such sizes (a 2-core EPYC Zen 4). Long rows keep SDPA."""
    B, H, n, D = q.shape
    if B * H * n * k.shape[2] > SMALL_SCORES or dropout:
        gqa = sdpa_takes_gqa(q.device)
        if not gqa:  # each query head its own copy of its KV head's keys and values
            k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))  # (B, H, m, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                              enable_gqa=gqa, dropout_p=dropout)
    return SmallAttention.apply(q, k, v, mask, scaling)


def on_cuda(device) -> bool:
    """Whether tensors on `device` run CUDA's kernels: every choice below that depends on the
    device asks this (the tests pretend a GPU by answering it)."""
    return torch.device(device).type == "cuda"


def sdpa_takes_gqa(device) -> bool:
    """Whether SDPA with a mask is handed the KV heads as they are (enable_gqa), or one per query
    head. Not on CUDA: FlashAttention takes no mask and the memory-efficient kernel no grouped
    heads, so SDPA would fall back to its math kernel, which keeps the fp32 scores for backward
    (~9.9 GB a layer at 8K tokens, 12 heads); transformers' use_gqa_in_sdpa decides alike."""
    return not on_cuda(device)


def _probs(q, k, mask, scaling):
    """softmax(q k^T scaling) where `mask` allows, in fp32 throughout as SDPA's kernel accumulates
    (scores rounded to bf16 would be off by ~0.4 % of their size). Each KV head's keys are read
    once for its g query heads: q (B, KV, g n, D), k (B, KV, m, D) -> (B, KV, g n, m)."""
    B, KV, gn, _ = q.shape
    n, m = mask.shape[-2], k.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scaling
    # (MASKED's value written out: torch.compile cannot trace a module global inside the
    # autograd.Function SmallAttention whose forward this is)
    lowest = torch.finfo(torch.float32).min
    scores = scores.view(B, KV, gn // n, n, m).masked_fill(~mask[:, :, None], lowest)
    return torch.softmax(scores, dim=-1).view(B, KV, gn, m)


class SmallAttention(torch.autograd.Function):
    """Attention as matmuls whose backward recomputes the probabilities from q and k, as
    FlashAttention's does, instead of keeping them: autograd would keep the B H n m fp32
    probabilities and fp32 copies of q, k and v -- ~20 MB a layer for 16 multiply episodes, where
    all the rest of the layer's activations are ~40 MB. It keeps q, k and v as they came. The
    backward of o = p v, p = softmax(s), s = q k^T scaling:

        dv = p^T do      dp = do v^T      ds = p * (dp - rowsum(dp * p))
        dq = ds k scaling                 dk = ds^T q scaling"""

    @staticmethod
    @torch.autocast("cpu", enabled=False)  # (fp32 as written, under a caller's autocast too:
    @torch.autocast("cuda", enabled=False)  # the backward runs outside it)
    def forward(ctx, q, k, v, mask, scaling):
        B, H, n, D = q.shape
        KV = k.shape[1]
        ctx.save_for_backward(q, k, v, mask)
        ctx.scaling = scaling
        p = _probs(q.reshape(B, KV, H // KV * n, D), k, mask, scaling)
        return (p @ v.float()).view(B, H, n, D).to(v.dtype)

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx, d_out):
        q, k, v, mask = ctx.saved_tensors
        B, H, n, D = q.shape
        KV = k.shape[1]
        q = q.reshape(B, KV, H // KV * n, D)  # (B, KV, g n, D)
        p = _probs(q, k, mask, ctx.scaling)  # (B, KV, g n, m), recomputed
        d_out = d_out.float().reshape(B, KV, H // KV * n, D)
        dv = p.transpose(-1, -2) @ d_out  # (B, KV, m, D)
        dp = d_out @ v.float().transpose(-1, -2)  # (B, KV, g n, m)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scaling
        dq = (ds @ k.float()).view(B, H, n, D)
        dk = ds.transpose(-1, -2) @ q.float()  # (B, KV, m, D): summed over each head's g queries
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def decode_attention(query, key, value, attention_mask, scaling):
    """A decoding step. Its cost is reading the keys and values: here each KV head's are read
    once for the query heads that share it (grouped-query attention), with the softmax in fp32.
    SDPA's CPU kernel took 17 ms a layer for 64 rows of 400 tokens in bf16 -- 70 % of a SmolLM2
    decoding step, ~18x its bytes' time at the measured bandwidth.

    query (B, H, 1, D), key and value (B, KV, L, D), attention_mask (B, 1, 1, L) bool (True:
    attend) or None -> (B, 1, H, D)."""
    B, H, _, D = query.shape
    KV, L = key.shape[1], key.shape[2]
    q = query.reshape(B, KV, H // KV, D)  # the query heads of each KV head
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scaling  # (B, KV, H/KV, L)
    if attention_mask is not None:
        mask = attention_mask[:, :, :, -L:]  # (B, 1, 1, L)
        scores = scores.masked_fill(~mask, MASKED) if mask.dtype == torch.bool \
            else scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # (B, KV, H/KV, D)
    return out.reshape(B, 1, H, D)


@torch.autocast("cpu", enabled=False)  # (fp32 scores under a caller's bf16 autocast too: there
@torch.autocast("cuda", enabled=False)  # the product ran in bf16, which cannot hold MASKED)
def softcapped_attention(query, key, value, attention_mask, scaling, softcap: float,
                         dropout: float, training: bool):
    """Attention whose scores are soft-capped, s -> cap tanh(s / cap) (Gemma 2's layers), which
    SDPA cannot do: handed to SDPA the cap was dropped (0.29 nats a token from the model's own
    definition on a small Gemma 2). As the model's eager attention computes it, with the scores in
    fp32 (SDPA's kernels accumulate so).

    query (B, H, n, D), key and value (B, KV, m, D); attention_mask (B or 1, 1, n, m) bool (True:
    attend) or additive, or None: causal, the n queries the last n of the m positions
    -> (B, n, H, D)."""
    B, H, n, D = query.shape
    KV, m = key.shape[1], key.shape[2]
    key, value = (x.repeat_interleave(H // KV, dim=1) for x in (key, value))  # (B, H, m, D)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scaling  # (B, H, n, m)
    scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:
        attention_mask = torch.ones(n, m, dtype=torch.bool, device=query.device).tril(m - n)
    if attention_mask.dtype == torch.bool:  # (not -inf: see MASKED)
        scores = scores.masked_fill(~attention_mask[..., :m], MASKED)
    else:
        scores = scores + attention_mask[..., :m].float()
    probs = F.dropout(torch.softmax(scores, dim=-1), p=dropout, training=training)
    return (probs.to(value.dtype) @ value).transpose(1, 2)  # (B, n, H, D)


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
    if kwargs.get("softcap"):
        return softcapped_attention(query, key, value, attention_mask, scaling, kwargs["softcap"],
                                    dropout, module.training), None
    if query.shape[2] == 1 and key.shape[2] > 1 and not special:
        return decode_attention(query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # (the masks SDPA is given)


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

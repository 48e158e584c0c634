"""Log-probs of sampled tokens: what every loss starts from. grpo_loss, dpo_loss, ppo's and
distill's take the log-probability the model gives each token it sampled, and the policy's entropy
there; this module computes them, and packs the rows they are computed on (pack, length_mask).

    completion_logprobs(model, input_ids, prompt_lens, completion_lens, temperature=...)
        -> (logprobs, entropy), (B, T) each, 0 past a completion's length

Chunks. The logits of a batch are never built: a (B, T, V) fp32 tensor is 8 x 8192 x 151936 x 4
bytes = 40 GB for a Qwen batch. The decoder runs once; the hidden states that predict completion
tokens are picked, and pushed through the LM head a chunk of tokens at a time (chunk_logprobs);
backward recomputes a chunk's logits instead of keeping every chunk's (chunk, V) alive
(LinearHeadLogprobs writes that backward out, for the bias-free linear heads of most models) --
except where the batch is one chunk: then its logits are kept, since the head's backward, which
comes next, would hold as much again anyway.

fp32. The softmax runs in fp32 whatever dtype the matmuls run in: bf16 keeps under three
significant digits, too few for log-probs whose differences the losses weigh. Logits are divided
by the sampling temperature, so these are the log-probs of the distribution the engine sampled
from.

Shared prompts. A GRPO group's G samples have one prompt: share_prompts runs it through the
decoder once, followed by its completions, each seeing only the prompt and itself
(attention.PrefixLayout, or SDPA's mask), with the same positions it would have alone.
check_head_logits verifies, per architecture, that head_logits reproduces the model's own logits
and that sharing changes no log-prob (decoder_shares_prompts: the same verdict for a scalar head).

Packed rows. Prompt + completion right-padded to (B, L), with the two length vectors every mask
comes from (pack, length_mask): masks are never inferred from token values, where pad == eos.
"""

import copy
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from attention import NAME as ATTENTION, PrefixLayout, on_cuda, prefix_layout, takes_layouts
from attention import use_smolrl_attention


# ---------------------------------------------------------------------------------------------
# A chunk of hidden states -> the log-probs of its tokens, in fp32.


def head_logits(model, hidden):
    """The model's own logits from final hidden states (n, H) -> (n, V) fp32: its LM head module
    (with a bias, as Phi has), then what the architecture does after the head -- Cohere multiplies
    by logit_scale, Granite divides by logits_scaling, Gemma-2/3 soft-cap at
    final_logit_softcapping. check_head_logits verifies this against model(ids).logits."""
    config = model.config.get_text_config()
    logits = model.get_output_embeddings()(hidden).float()  # (n, V)
    if getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        cap = config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def chunk_logprobs(model, hidden, targets, temperature, only_chunk: bool = False):
    """(n,) log-probs of `targets` and (n,) entropies (detached) from final hidden states (n, H).
    A bias-free linear head -- most models, and Gemma's soft-capped one -- goes through
    LinearHeadLogprobs (which keeps its logits for the backward where this is the batch's
    `only_chunk`); any other head through head_logits under autograd, checkpointed so that
    backward recomputes its logits."""
    head, scale, cap = linear_head(model)
    if head is not None:
        return LinearHeadLogprobs.apply(hidden, head.weight, targets, scale, cap, temperature,
                                        only_chunk)
    if torch.is_grad_enabled():
        return checkpoint(_logprobs_by_autograd, model, hidden, targets, temperature,
                          use_reentrant=False)
    return _logprobs_by_autograd(model, hidden, targets, temperature)


def _logprobs_by_autograd(model, hidden, targets, temperature):
    logits = head_logits(model, hidden) / temperature  # (n, V) fp32
    logp = torch.log_softmax(logits, dim=-1)  # (n, V)
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)  # (n,)
    entropy = -(logp.exp() * logp).sum(-1)  # (n,)
    return token_logp, entropy.detach()


def linear_head(model):
    """(the LM head, the factor its logits are multiplied by, the soft cap after it or 0) when
    the head is one bias-free nn.Linear followed at most by a constant scale and a soft cap
    (Gemma 2's final_logit_softcapping); (None, 1.0, 0.0) otherwise (a bias, adapters on the
    head)."""
    config, head = model.config.get_text_config(), model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None, 1.0, 0.0
    return head, (getattr(config, "logit_scale", None) or 1.0) / \
        (getattr(config, "logits_scaling", None) or 1.0), \
        float(getattr(config, "final_logit_softcapping", None) or 0.0)


def _sampled_logits(z, scale: float, cap: float, temperature: float):
    """The logits sampled from, in place on fp32 rows z of h W^T: scale z, soft-capped where the
    model caps them (cap tanh(z / cap)), over the temperature."""
    if cap:
        return z.mul_(scale / cap).tanh_().mul_(cap / temperature)
    return z.mul_(scale / temperature)


def _softmax_stats(logits, targets, scale, cap, temperature):
    """(log-prob of each row's target, log-sum-exp, entropy), (r,) each, of rows of h W^T (r, V)
    in the matmul dtype, in fp32 -- two fp32 copies of the rows at a time."""
    z = _sampled_logits(logits.to(torch.float32, copy=True), scale, cap, temperature)  # (r, V)
    top = z.amax(-1, keepdim=True)  # (r, 1)
    target = z.gather(-1, targets[:, None])  # (r, 1)
    e = z.sub_(top).exp()  # (r, V): z is now logits - max, e = exp of it
    total = e.sum(-1)  # (r,): log-sum-exp = max + log(total)
    log_total = total.log()
    # H = -sum p log p with p = e / total, log p = z - log(total); e z in e's own memory
    # (linalg.vecdot made the product: a third fp32 copy of the rows)
    entropy = log_total - e.mul_(z).sum(-1) / total
    return (target - top).squeeze(-1) - log_total, top.squeeze(-1) + log_total, entropy


class LinearHeadLogprobs(torch.autograd.Function):
    """log softmax(logits)[target] and the entropy, logits = scale * h W^T (soft-capped, cap
    tanh(. / cap), where the model caps them) over the temperature, with the backward written out.

    Autograd would keep or recompute a chain of (n, V) tensors (the cast logits, their scaled
    copy, log_softmax, its exp for the entropy, a zero-filled gather gradient): on a CPU those
    memory-bound passes cost more than the head's matmul, and on any device they held ~20 bytes
    per (token, vocabulary entry) for Gemma's soft-capped head. The derivative needs one of them:
    d log p_y / d logits = onehot(y) - softmax(logits), so backward recomputes the logits from
    the saved (n, H) states and subtracts their saved log-sum-exp (and multiplies by the cap's
    derivative, 1 - tanh^2). The matmuls run in the autocast dtype (bf16), the softmax in fp32, as
    under autograd; the fp32 work goes a few rows at a time (_row_blocks).

    `keep_logits`: keep the (n, V) logits for the backward instead, which overwrites them with
    their gradient -- for a batch that is one chunk, whose backward begins with this one: the
    memory at its peak is the same (the recomputed logits were the same tensor's size), and the
    head's (n, H) x (H, V) product is not run a second time (~3 % of a GRPO update on a CPU at
    SmolLM2's 49,152 entries: a fifth of the model's FLOPs a token are the head's). Such a graph
    takes one backward (a second, after retain_graph, raises torch's error about a tensor
    modified in place), and a forward with grad that no backward follows holds the logits as
    long as its outputs live."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, cap, temperature, keep_logits=False):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else weight.dtype
        n = len(targets)
        token_logp, lse, entropy = (torch.empty(n, device=hidden.device) for _ in range(3))
        with torch.autocast(device, enabled=False):
            logits = hidden.to(dtype) @ weight.to(dtype).T  # (n, V) in the matmul dtype
            for b in _row_blocks(logits):
                token_logp[b], lse[b], entropy[b] = _softmax_stats(logits[b], targets[b], scale,
                                                                   cap, temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, logits if keep_logits else None)
        ctx.scale, ctx.cap, ctx.temperature, ctx.dtype = scale, cap, temperature, dtype
        ctx.mark_non_differentiable(entropy)
        return token_logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse, kept = ctx.saved_tensors
        g = grad_logp * ctx.scale / ctx.temperature  # (n,) and through logits = scale h W^T / T
        # (n, V): the logits, kept or made again as the forward made them, then overwritten
        grad = kept if kept is not None else hidden.to(ctx.dtype) @ weight.to(ctx.dtype).T
        for b in _row_blocks(grad):
            grad[b] = _logits_gradient(grad[b], targets[b], lse[b], g[b], ctx.scale, ctx.cap,
                                       ctx.temperature)
        need_hidden, need_weight = ctx.needs_input_grad[:2]  # (LoRA: the head is frozen)
        grad_hidden = (grad @ weight.to(ctx.dtype)).to(hidden.dtype) if need_hidden else None
        grad_weight = (grad.T @ hidden.to(ctx.dtype)).to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None, None  # (n, H), (V, H)


def _logits_gradient(logits, targets, lse, g, scale: float, cap: float, temperature: float):
    """d (g . log p_target) / d logits for rows of h W^T (r, V), fp32: (onehot - softmax) g,
    times the cap's derivative, 1 - tanh^2, where the model caps -- two fp32 copies of the rows."""
    probs = _sampled_logits(logits.to(torch.float32, copy=True), scale, cap, temperature)
    # (from the capped logits z = cap tanh(.) / T: tanh = z T / cap)
    slope = (probs * (temperature / cap)).square_().neg_().add_(1) if cap else None
    probs.sub_(lse[:, None]).exp_()  # (r, V) softmax
    probs.mul_(-g[:, None])  # (onehot - softmax) * g ...
    probs[torch.arange(len(probs), device=probs.device), targets] += g  # ... onehot
    return probs if slope is None else probs.mul_(slope)


GPU_ROW_BLOCKS = 8  # a chunk's rows go through the fp32 softmax on a GPU in this many blocks


def _row_blocks(logits, cache_bytes=2**21):
    """Slices of rows of (n, V) logits: on a CPU, as many rows as fit ~2 MB in fp32 (a core's L2
    cache), so that each row block's chain of element-wise ops reads it from cache (1.8x faster
    for SmolLM2's head than whole (n, V) passes); on a GPU, whose memory is fast and whose kernel
    launches are not free, an eighth of the rows at a time: their two fp32 copies then add a byte
    per (row, entry) to the bf16 logits' two -- all rows at once, the forward held 14 (issue 69:
    4.06 GiB per 2,048-token chunk at Qwen's vocabulary, where the plan counted 2.32)."""
    n, V = logits.shape
    rows = -(-n // GPU_ROW_BLOCKS) if on_cuda(logits.device) else max(1, cache_bytes // (4 * V))
    return [slice(s, s + rows) for s in range(0, n, rows)]


# ---------------------------------------------------------------------------------------------
# A batch of completions -> their tokens' log-probs.


def completion_logprobs(model, input_ids, prompt_lens, completion_lens, *, temperature=1.0,
                        chunk_tokens=2048):
    """Log-probs of completion tokens under `model`, and the policy entropy at each of them.

    input_ids (B, L): prompt followed by completion, right-padded. prompt_lens, completion_lens (B,).
    Returns (logprobs, entropy), both (B, T) with T = max completion length; entries past a
    completion's length are 0. Logits are divided by the sampling temperature, so these are the
    log-probs of the distribution the rollout actually sampled from.
    """
    B = input_ids.shape[0]
    T = int(completion_lens.max())
    mask = length_mask(completion_lens, T)  # (B, T)
    rows, cols = mask.nonzero(as_tuple=True)  # (n,), (n,) one entry per completion token
    pos = prompt_lens[rows] + cols  # (n,) position of each completion token in input_ids
    targets = input_ids[rows, pos]  # (n,)
    shared = share_prompts(model, input_ids, prompt_lens, completion_lens)
    if shared is None:
        # Right padding needs no attention mask: causal attention never looks at later (pad)
        # positions, and position ids 0..L-1 are already right. This keeps the fast SDPA causal
        # path. No KV cache: nothing is decoded after this forward.
        hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        hidden = hidden[rows, pos - 1]  # (n, H): the state at t-1 predicts token t
    else:  # a group's prompt once, followed by each of its completions (share_prompts)
        hidden = shared.hidden(model.get_decoder())
        hidden = hidden[shared.row[rows], shared.state[rows, cols]]  # (n, H)
    lp_chunks, ent_chunks = [], []
    for s in range(0, hidden.shape[0], chunk_tokens):
        lp, ent = chunk_logprobs(model, hidden[s:s + chunk_tokens], targets[s:s + chunk_tokens],
                                 temperature, only_chunk=hidden.shape[0] <= chunk_tokens)
        lp_chunks.append(lp)
        ent_chunks.append(ent)
    logprobs = torch.zeros(B, T, device=input_ids.device, dtype=torch.float32)
    entropy = torch.zeros(B, T, device=input_ids.device, dtype=torch.float32)
    logprobs = logprobs.index_put((rows, cols), torch.cat(lp_chunks))  # (B, T), differentiable
    entropy[rows, cols] = torch.cat(ent_chunks)
    return logprobs, entropy


# ---------------------------------------------------------------------------------------------
# Shared prompts: a group's prompt through the decoder once.


class SharedPrompts(NamedTuple):
    input_ids: torch.Tensor  # (R, L') each distinct prompt once, then its completions: under
    # smolrl's attention all in one row (R = 1), under SDPA's mask a row a prompt
    positions: torch.Tensor  # (R, L') each completion's positions continue from its prompt's end
    mask: torch.Tensor  # (R, 1, L', L') bool: who attends to whom (SDPA's way); beside a layout,
    # (R, L') ones: nothing to say, and it keeps transformers from building an (L', L') mask of
    # its own from the positions that restart
    layout: PrefixLayout | None  # who attends to whom, said as where the completions are
    row: torch.Tensor  # (B,) the packed row of each input row
    state: torch.Tensor  # (B, T) where the state that predicts completion token t of row b is

    def hidden(self, decoder) -> torch.Tensor:
        """(R, L', H) the decoder's last hidden states of the packed rows."""
        layout = {} if self.layout is None else {"prefix_layout": self.layout}
        return decoder(input_ids=self.input_ids, position_ids=self.positions,
                       attention_mask=self.mask, use_cache=False, **layout).last_hidden_state


# Under SDPA a packed row's attention is (L', L') whatever its mask: beyond this it costs more
# than sharing saves. smolrl's attention (attention.py) needs no such limit.
MAX_SHARED_LEN = 2048


def share_prompts(model, input_ids, prompt_lens, completion_lens) -> SharedPrompts | None:
    """The G samples of a GRPO group have one prompt, so the training forward need not run it G
    times: each distinct prompt goes through the decoder once, followed by all of its completions,
    in one row where a completion sees the prompt and its own earlier tokens -- never another
    completion -- and whose position ids restart at the prompt's end for each completion (said to
    smolrl's attention as where the completions are, attention.PrefixLayout; to SDPA as a mask).
    Every completion token gets exactly the state it would get in its own row (the same keys, the
    same positions), for a fraction of the tokens when prompts are long next to completions
    (arith: 55-token prompts, <= 24-token answers). None -- run the rows as they are -- when
    sharing saves less than a fifth of the tokens, when a packed row under SDPA's mask would be
    longer than MAX_SHARED_LEN or the model's sliding window, and for models not verified to give
    every completion the same log-probs shared as alone (check_head_logits sets
    smolrl_shares_prompts: hybrid Mamba / linear-attention decoders run a packed row as one
    sequence, and some models cannot take a custom mask at all)."""
    config = model.config.get_text_config()
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", ATTENTION) \
            or not getattr(model, "smolrl_shares_prompts", False):  # see check_head_logits
        return None
    by_layout = attention == ATTENTION and takes_layouts(config)  # (else SDPA's mask)
    # On the host once: the packing below is a Python loop over rows (no device sync per row).
    input_ids, prompt_lens = input_ids.cpu(), prompt_lens.cpu()
    completion_lens = completion_lens.cpu()
    B, T = input_ids.shape[0], int(completion_lens.max())
    if T == 0:
        return None  # (no completion token to predict)
    members: dict[tuple, list[int]] = {}  # prompt tokens -> the rows that have it
    for b in range(B):
        members.setdefault(tuple(input_ids[b, :prompt_lens[b]].tolist()), []).append(b)
    lengths = [len(p) + sum(int(completion_lens[b]) for b in bs) for p, bs in members.items()]
    window = getattr(config, "sliding_window", None)
    longest = max(lengths)
    unshared = B * int((prompt_lens + completion_lens).max())  # tokens of the rows as they are
    if len(members) * longest > 0.8 * unshared or \
            (not by_layout and longest > min(MAX_SHARED_LEN, window or MAX_SHARED_LEN)):
        return None  # (few prompts repeat, or completions dwarf prompts: nothing to gain)
    # Under smolrl's attention every group goes into one row, end to end: it finds each token's
    # keys by index (attention.PrefixLayout), so the layers' matmuls run no padding. Under SDPA's
    # mask, a row a group, as long as the longest.
    R, L = (1, sum(lengths)) if by_layout else (len(members), longest)
    device = model.device
    ids = torch.zeros(R, L, dtype=input_ids.dtype)
    positions = torch.zeros(R, L, dtype=torch.long)
    segment = torch.full((R, L), -1)  # 0: a prompt, i: the i-th completion after it, -1: padding
    row, state = torch.zeros(B, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    prompt_at, completion_at = [], []  # (flat start, length); (its prompt, flat start, length)
    start = 0  # where the group starts in its row
    for g, (prompt, bs) in enumerate(members.items()):
        r, P = (0 if by_layout else g), len(prompt)
        span = slice(start, start + P)
        ids[r, span], positions[r, span], segment[r, span] = torch.tensor(prompt), \
            torch.arange(P), 0
        prompt_at.append((r * L + start, P))
        at = start + P
        for i, b in enumerate(bs, start=1):
            n = int(completion_lens[b])
            ids[r, at:at + n] = input_ids[b, P:P + n]
            positions[r, at:at + n] = torch.arange(P, P + n)
            segment[r, at:at + n] = i
            row[b] = r
            state[b, :n] = torch.arange(at - 1, at + n - 1)
            state[b, :min(n, 1)] = start + P - 1  # the first token: the prompt's last state
            if n:
                completion_at.append((g, r * L + at, n))
            at += n
        start = at if by_layout else 0
    if by_layout:  # each completion against its prompt and itself (attention.py)
        layout = prefix_layout(prompt_at, completion_at, R * L, device,
                               heads=config.num_attention_heads)
        return SharedPrompts(ids.to(device), positions.to(device),
                             torch.ones(R, L, dtype=torch.long, device=device), layout,
                             row.to(device), state.to(device))
    q, k = segment[:, :, None], segment[:, None, :]  # (R, L, 1), (R, 1, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    # Padding attends to itself only: a query that attends to nothing gives NaN in SDPA.
    mask = (causal & (q >= 0) & ((k == 0) | (k == q))) | torch.eye(L, dtype=torch.bool)
    return SharedPrompts(ids.to(device), positions.to(device), mask[:, None].to(device), None,
                         row.to(device), state.to(device))


# ---------------------------------------------------------------------------------------------
# Verdicts on an architecture before it trains: its log-probs are its own, sharing changes none.


@torch.no_grad()
def check_head_logits(model, atol: float = 1e-3):
    """Stop if completion_logprobs would not reproduce this model's own log-probs: an architecture
    whose head does something head_logits does not know would otherwise train on wrong numbers.
    Sets model.smolrl_shares_prompts. Both are verdicts on the architecture, made in fp32 (bf16's
    rounding would blur them): a model loaded in bf16 (a frozen teacher) is judged by a one-layer
    fp32 copy of its architecture, with random weights and a small vocabulary."""
    if next(model.parameters()).dtype != torch.float32:
        probe = _fp32_probe(model.config)
        check_head_logits(probe, atol)
        model.smolrl_shares_prompts = probe.smolrl_shares_prompts
        return
    V = model.config.get_text_config().vocab_size
    ids = torch.arange(3, 19, device=model.device)[None] * 7919 % V  # (1, 16) arbitrary tokens
    one, fifteen = torch.tensor([1], device=ids.device), torch.tensor([15], device=ids.device)
    ours, _ = completion_logprobs(model, ids, one, fifteen)  # (1, 15)
    full = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)  # (1, 16, V)
    theirs = full[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)  # (15,)
    diff = float((ours[0] - theirs).abs().max())
    if diff > atol:
        raise SystemExit(f"error: {type(model).__name__}: smolrl's log-probs differ from the "
                         f"model's own by {diff:.3g} nats (its head does something "
                         f"logprobs.head_logits does not know); add it there")
    model.smolrl_shares_prompts = _sharing_changes_nothing(model, ids[0], atol)


def _fp32_probe(config):
    """A one-layer, 256-token-vocabulary fp32 model of `config`'s architecture, on the CPU."""
    from transformers import AutoModelForCausalLM
    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.num_hidden_layers, text.vocab_size = 1, 256
    if isinstance(getattr(text, "layer_types", None), list):  # (one entry per layer)
        text.layer_types = text.layer_types[:1]
    torch.manual_seed(0)
    probe = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             trust_remote_code=False).eval()
    if text._attn_implementation == ATTENTION:  # (the verdict is on the attention it runs)
        use_smolrl_attention(probe)
    return probe


@torch.no_grad()
def decoder_shares_prompts(config, atol: float = 1e-3) -> bool:
    """check_head_logits' prompt-sharing verdict for a model with a scalar head instead of an LM
    head (a reward model, a critic), made as a bf16 model's is: on a one-layer fp32 causal LM of
    its architecture -- the verdict is on the decoder, whose states either head reads. False for
    an architecture that has no causal LM (an encoder reward model such as DeBERTa)."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):  # (the probe seeds its weights: not the run's RNG)
        try:
            probe = _fp32_probe(config)
        except ValueError:  # (no AutoModelForCausalLM for this config)
            return False
    ids = torch.arange(3, 19) * 7919 % 256  # (16,) arbitrary tokens of the probe's vocabulary
    return _sharing_changes_nothing(probe, ids, atol)


def _sharing_changes_nothing(model, ids, atol: float) -> bool:
    """Three samples of one prompt, log-probs with the prompt shared (share_prompts) and with each
    sample in its own row: True when they agree, False when they differ or sharing fails."""
    prompt, rest = ids[:4].tolist(), ids[4:].tolist()
    batch = pack([prompt] * 3, [rest[:12], rest[3:12], rest[6:12]], pad_id=0, device=ids.device)
    model.smolrl_shares_prompts = False
    apart, _ = completion_logprobs(model, *batch)
    model.smolrl_shares_prompts = True
    try:
        shared, _ = completion_logprobs(model, *batch)
    except Exception:  # e.g. a model that builds its own 2D mask (Falcon's alibi)
        return False
    return float((shared - apart).abs().max()) <= atol


# ---------------------------------------------------------------------------------------------
# Packed rows: prompt + completion right-padded, and the lengths every mask comes from.


class Packed(NamedTuple):
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    prompt_lens: torch.Tensor  # (B,)
    completion_lens: torch.Tensor  # (B,)


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device="cpu"):
    """Right-padded (B, L) prompt+completion ids and the two length vectors that define the masks."""
    input_ids = right_pad([p + c for p, c in zip(prompts, completions)], pad_id)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    completion_lens = torch.tensor([len(c) for c in completions])
    return Packed(input_ids.to(device), prompt_lens.to(device), completion_lens.to(device))


def right_pad(rows: list[list], value, dtype=torch.long) -> torch.Tensor:
    """(B, longest row) tensor of the rows, right-padded with `value`."""
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out


def length_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) bool mask, True for the first lengths[b] positions of row b."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]

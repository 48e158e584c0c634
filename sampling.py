"""What a rollout engine is asked and what it gives back, and how it draws each token -- the part
every engine shares (rollout.py's HFRollout and VLLMRollout, env.py's turn loop, distributed.py's
engine groups).

    Sampling      max_new_tokens, temperature (0: greedy), top_p, seed
    Completions   n samples a prompt, prompt-major, each with its tokens (the stop token
                  included), truncated flag, text, the sampler's log-probs and the weights'
                  version; Ready: ones already generated, behind the interface of ones on their way
    draw          a token per row from the logits and nothing else: argmax, or a draw from
                  softmax(logits / T) cut to the top-p nucleus (inverse_cdf: one uniform a row),
                  and its log-prob; sample_next: the tokens alone
    cut_at_stop   a completion ends at its first stop token, which it keeps (the model must learn to
                  stop), or at max_new_tokens, truncated
    policy_lag    how many steps behind the trainer a batch's weights are (--async-steps)

The trainer's log-probs must describe exactly this distribution: the same temperature and top-p,
nothing else (no penalties from a generation_config the trainer cannot see).
"""

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    keep_cache: bool = False  # the HF engine keeps each sample's keys and values for a next call
    # whose prompts continue these (an episode's next turn, env.Agent): it then prefills only the
    # new tokens. (vLLM finds such prefixes itself: prefix caching.)


@dataclass
class Completions:
    """n completions per prompt, prompt-major: sample k of prompt i is at index i * n + k."""
    prompt_ids: list[list[int]]  # the prompt of each sample (repeated n times)
    completion_ids: list[list[int]]  # sampled tokens, stop token included when there was one
    truncated: list[bool]  # True when the sample hit max_new_tokens without a stop token
    text: list[str]  # decoded completion, special tokens removed
    engine_logprobs: list[list[float]] | None = None  # the sampling policy's log-prob per token
    policy_version: int = 0  # the trainer step whose weights sampled these
    seconds: float = 0.0  # the engine's time generating them (engines side by side: the longest)
    mask: list[list[bool]] | None = None  # episodes (env.py): True where the model sampled the
    # token, False for the environment's; None: every completion token is the model's
    prompt_tokens: int = 0  # prompt tokens the engine was given (each distinct prompt once) ...
    cached_tokens: int = 0  # ... and how many of them it took from a cache, not a forward
    # The seconds the call would take at the machine's peak FLOP/s and at its memory bandwidth
    # (hardware.py's roofline): over `seconds`, how close the engine came to its bound
    compute_floor: float = 0.0
    memory_floor: float = 0.0

    def __len__(self):
        return len(self.completion_ids)

    def select(self, indices: list[int]) -> "Completions":
        pick = lambda xs: None if xs is None else [xs[i] for i in indices]  # noqa: E731
        return Completions(pick(self.prompt_ids), pick(self.completion_ids), pick(self.truncated),
                           pick(self.text), pick(self.engine_logprobs), self.policy_version,
                           self.seconds, pick(self.mask), self.prompt_tokens, self.cached_tokens,
                           self.compute_floor, self.memory_floor)

    @staticmethod
    def concat(parts: list["Completions"]) -> "Completions":
        join = lambda name: None if getattr(parts[0], name) is None else [  # noqa: E731
            x for p in parts for x in getattr(p, name)]
        return Completions(join("prompt_ids"), join("completion_ids"), join("truncated"),
                           join("text"), join("engine_logprobs"),
                           min(p.policy_version for p in parts),  # the stalest part's
                           max(p.seconds for p in parts),  # (engines generate side by side)
                           join("mask"), sum(p.prompt_tokens for p in parts),
                           sum(p.cached_tokens for p in parts),
                           max(p.compute_floor for p in parts),  # (as `seconds`)
                           max(p.memory_floor for p in parts))


class Ready:
    """Completions already generated, behind the interface of ones still on their way."""

    def __init__(self, completions: Completions):
        self.completions = completions

    def result(self) -> Completions:
        return self.completions


def policy_lag(comps: Completions, step: int, allowed: int) -> int:
    """Updates between the weights that sampled step `step`'s batch and the trainers' (0 on-policy,
    1 with --async-steps 1). More than `allowed` means a weight sync went missing: stop."""
    lag = step - 1 - comps.policy_version
    if not 0 <= lag <= allowed:
        raise SystemExit(f"error: step {step}'s batch was sampled with the weights of step "
                         f"{comps.policy_version}, {lag} updates behind the trainers (allowed: "
                         f"{allowed}): a weight sync was skipped or failed")
    return lag


# ---------------------------------------------------------------------------------------------
# How an engine draws a token, and where a completion ends.


def request_seed(seed: int, index: int) -> int:
    """The seed of prompt `index` of a call seeded with `seed`: a 31-bit hash of both, so that no
    two prompts (and no two engines' shards, see distributed.EngineGroup) share a random stream."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


def cut_at_stop(tokens: list[int], stop_ids: set[int], max_new_tokens: int):
    """(completion up to and including the first stop token, truncated?)."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i + 1], False
    return tokens[:max_new_tokens], True


class Drawn(NamedTuple):
    tokens: torch.Tensor  # (B,) token ids
    logprobs: torch.Tensor | None  # (B,) fp32 log softmax(logits / T)[token], or None (greedy)


NO_MASS = "sampling: the logits hold NaN or +inf, or are all -inf, in some row"


def draw(logits: torch.Tensor, sampling: Sampling, logprobs: bool = False) -> Drawn:
    """One token per row of (B, V) logits: the argmax when greedy, else a draw from
    softmax(logits / T), cut to the top-p nucleus when top_p < 1; with logprobs, each drawn token's
    log softmax(logits / T) from the very logits it was drawn from (in fp32, as the trainer
    computes its own).

    The draw inverts the CDF with one uniform number per row. torch.multinomial draws an
    exponential random number for every vocabulary entry instead: a quarter of generation here.
    Every (B, V) tensor made here costs a decoding step its fill and, fresh from the allocator, as
    much again in page faults (docs/benchmarks.md): logits / T is made once, for the draw and its
    log-probs, and not at all at T = 1 (x / 1 is x)."""
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"sampling: top_p {sampling.top_p} must be in (0, 1]")
    if sampling.temperature == 0:
        # max's indices, not argmax: the same first index of a row's largest (a NaN's, if any:
        # checked below on B values, not B V), in a quarter of the time on a CPU in bf16
        token = logits.max(-1).indices
        if not torch.isfinite(logits.gather(-1, token[:, None])).all():
            raise ValueError(NO_MASS)
        return Drawn(token, None)
    T = sampling.temperature
    copied = logits.dtype != torch.float32  # .float() copies bf16 logits, returns fp32 ones
    scaled = logits.float()  # (B, V) fp32
    if T != 1:  # in place only on a copy of our own, never on the caller's logits
        scaled = scaled.div_(T) if copied else scaled / T
    probs = torch.softmax(scaled, dim=-1)  # (B, V)
    if sampling.top_p < 1:  # the smallest set of likeliest tokens holding top_p of the mass
        sorted_probs, order = probs.sort(-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (B, V)
        probs = probs.scatter(-1, order, sorted_probs * (mass_before < sampling.top_p))
    r = torch.rand(len(probs), device=probs.device, dtype=torch.float64)  # (B,) in [0, 1)
    token = inverse_cdf(probs, r)  # (raises NO_MASS where a row's probabilities are NaN)
    if not logprobs:
        return Drawn(token, None)
    logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
    return Drawn(token, logp.gather(-1, token[:, None]).squeeze(-1))


def sample_next(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """draw's tokens alone -> (B,)."""
    return draw(logits, sampling).tokens


CDF_BLOCK = 256  # vocabulary entries a block of inverse_cdf's coarse running sum


SUM_BYTES = 2**21  # how large an fp64 copy block_sums makes: a few rows at a time


def block_sums(probs: torch.Tensor) -> torch.Tensor:
    """The fp64 sum of each CDF_BLOCK entries of a row of (B, V) probabilities -> (B, nb); where V
    is not whole blocks, the last block holds the rest. A sum in fp64 first copies what it adds to
    fp64: a few rows at a time, that copy is ~2 MB, where all 64 rows of 49,152 made a fresh 25 MB
    tensor that cost a decoding step 6 ms in page faults, 4x the sum (2-core Xeon)."""
    V = probs.shape[1]
    whole = V - V % CDF_BLOCK
    sums = []
    for rows in probs.split(max(1, SUM_BYTES // (8 * V))):  # (8 bytes an fp64 number)
        part = [rows[:, :whole].view(len(rows), -1, CDF_BLOCK).sum(-1, dtype=torch.float64)]
        if whole < V:
            part.append(rows[:, whole:].sum(-1, keepdim=True, dtype=torch.float64))
        sums.append(torch.cat(part, 1))
    return torch.cat(sums)


def last_nonzero(x: torch.Tensor) -> torch.Tensor:
    """The index of the last non-zero entry along x's last dimension (0 where there is none)."""
    return x.shape[-1] - 1 - (x != 0).flip(-1).to(torch.uint8).argmax(-1)


def inverse_cdf(probs: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The first token whose running sum of (B, V) probabilities exceeds u = r (B,) times the
    row's total, in fp64 -> (B,): r uniform in [0, 1) draws a token with its probability over the
    total (which need not be 1: a top-p nucleus is less).

    In two passes, as a vocabulary of 49,152 makes it pay: the running sum of blocks' totals finds
    each row's block, then the running sum inside that block alone finds the token. A running sum
    over the whole row is sequential in each row: 42 ms a draw of 64 rows against 6 ms so (fp32,
    a 2-core EPYC; a decoding step of 64 rows is ~300 ms). Block totals are a vectorised sum, in
    fp64: past 0.5 an fp32 running sum no longer grows by probabilities below ~3e-8, and those
    tokens could never be drawn. The sums are added in another order than one running sum: the
    draw differs only where u falls within ~1e-16 of a boundary."""
    V = probs.shape[1]
    sums = block_sums(probs)  # (B, nb)
    coarse = sums.cumsum(-1)  # (B, nb); coarse[:, -1] is the row's total
    if not (coarse[:, -1] > 0).all():  # (NaN anywhere makes the total NaN; 0: nothing to draw)
        raise ValueError(NO_MASS)
    u = r[:, None] * coarse[:, -1:]  # (B, 1)
    # u at or past a sum it should be below, by a rounding: the last block or token that can be
    # drawn, never one of probability 0 or past the vocabulary
    k = torch.minimum(torch.searchsorted(coarse, u, right=True), last_nonzero(sums)[:, None])
    before = torch.where(k > 0, coarse.gather(1, (k - 1).clamp(min=0)), 0.0)  # (B, 1)
    columns = k * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)  # (B, b)
    block = torch.where(columns < V, probs.gather(1, columns.clamp(max=V - 1)), 0.0)  # (B, b)
    fine = block.cumsum(-1, dtype=torch.float64) + before  # (B, b)
    j = torch.searchsorted(fine, u, right=True).squeeze(1)
    return k.squeeze(1) * CDF_BLOCK + torch.where(j < CDF_BLOCK, j, last_nonzero(block))

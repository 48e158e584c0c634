"""What a rollout engine is asked and what it gives back, and how it draws each token -- the part
every engine shares (rollout.py's HFRollout and VLLMRollout, env.py's turn loop, distributed.py's
engine groups).

    Sampling      max_new_tokens, temperature (0: greedy), top_p, seed
    Completions   n samples a prompt, prompt-major, each with its tokens (the stop token
                  included), truncated flag, text, the sampler's log-probs and the weights'
                  version; Ready: ones already generated, behind the interface of ones on their way
    sample_next   a token per row from the logits and nothing else: argmax, or a draw from
                  softmax(logits / T) cut to the top-p nucleus (inverse_cdf: one uniform a row)
    cut_at_stop   a completion ends at its first stop token, which it keeps (the model must learn to
                  stop), or at max_new_tokens, truncated
    policy_lag    how many steps behind the trainer a batch's weights are (--async-steps)

The trainer's log-probs must describe exactly this distribution: the same temperature and top-p,
nothing else (no penalties from a generation_config the trainer cannot see).
"""

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def sample_next(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One token per row of (B, V) logits: the argmax when greedy, else a draw from
    softmax(logits / T), cut to the top-p nucleus when top_p < 1 -> (B,) token ids.

    The draw inverts the CDF with one uniform number per row. torch.multinomial draws an
    exponential random number for every vocabulary entry instead: a quarter of generation here."""
    if sampling.temperature == 0:
        token = logits.argmax(-1)  # (a row's NaN is its argmax: checked on B values, not B V)
        if not torch.isfinite(logits.gather(-1, token[:, None])).all():
            raise ValueError("sampling: the logits hold NaN or are all -inf in some row")
        return token
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)  # (B, V)
    if sampling.top_p < 1:  # the smallest set of likeliest tokens holding top_p of the mass
        sorted_probs, order = probs.sort(-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # (B, V)
        probs = probs.scatter(-1, order, sorted_probs * (mass_before < sampling.top_p))
    # fp64 totals: past 0.5 an fp32 running sum no longer grows by probabilities below ~3e-8,
    # and those tokens could never be drawn.
    totals = probs.sum(-1, dtype=torch.float64)  # (B,)
    if not torch.isfinite(totals).all():  # (a NaN anywhere makes its row's total NaN)
        raise ValueError("sampling: the logits hold NaN or are all -inf in some row")
    u = torch.rand(len(probs), 1, device=probs.device, dtype=torch.float64) * totals[:, None]
    return inverse_cdf(probs, u.squeeze(1))


CDF_BLOCK = 256  # vocabulary entries a block of inverse_cdf's coarse running sum


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token whose running sum of (B, V) probabilities exceeds u (B,), fp64 -> (B,).

    In two passes, as a vocabulary of 49,152 makes it pay: the running sum of blocks' totals finds
    each row's block, then the running sum inside that block alone finds the token. A running sum
    over the whole row is sequential in each row: 42 ms a draw of 64 rows against 6 ms so (fp32,
    a 2-core EPYC; a decoding step of 64 rows is ~300 ms). Block totals are a vectorised sum. The
    sums are added in another order than one running sum: the draw differs only where u falls
    within ~1e-16 of a boundary."""
    B, V = probs.shape
    blocks = F.pad(probs, (0, -V % CDF_BLOCK)).view(B, -1, CDF_BLOCK)  # (B, nb, b), zeros padded
    sums = blocks.sum(-1, dtype=torch.float64)  # (B, nb)
    coarse = sums.cumsum(-1)
    # u at or past the row's last sum by a rounding (the caller's total added in another order):
    # the last block that can be drawn from
    last_block = sums.shape[1] - 1 - (sums > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
    k = torch.minimum(torch.searchsorted(coarse, u[:, None], right=True), last_block)  # (B, 1)
    before = torch.where(k > 0, coarse.gather(1, (k - 1).clamp(min=0)), 0.0)  # (B, 1)
    block = blocks[torch.arange(B, device=probs.device), k.squeeze(1)]  # (B, b)
    fine = block.cumsum(-1, dtype=torch.float64) + before  # (B, b)
    j = torch.searchsorted(fine, u[:, None], right=True).squeeze(1)
    # u past the block's own sum by a rounding: its last token that can be drawn
    last = CDF_BLOCK - 1 - (block > 0).flip(-1).to(torch.uint8).argmax(-1)
    return k.squeeze(1) * CDF_BLOCK + torch.where(j < CDF_BLOCK, j, last)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B,) log softmax(logits / T)[token] for (B, V) logits: the log-prob of each drawn token under
    the distribution sample_next drew it from (in fp32, as the trainer computes its own)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, V)
    return logp.gather(-1, tokens[:, None]).squeeze(-1)

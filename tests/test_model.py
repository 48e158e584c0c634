"""Log-probs the trainer computes describe what the model (and the engine) really do: every head
architecture, fp32 rotary buffers in bf16 copies, a reference in the policy's precision, no KV
cache in training forwards."""

import math
from types import SimpleNamespace

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                          GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM,
                          PhiConfig, PhiForCausalLM)

from hardware import autocast
from logprobs import check_head_logits, completion_logprobs, pack
from rollout import HFRollout

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
             eos_token_id=2, bos_token_id=1, pad_token_id=0)


def _phi_with_head_bias():
    model = PhiForCausalLM(PhiConfig(**SMALL))
    torch.nn.init.normal_(model.lm_head.bias, std=3.0)  # random init leaves it ~0
    return model


ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "phi (LM-head bias)": _phi_with_head_bias,
    "gemma2 (final-logit soft-capping)": lambda: Gemma2ForCausalLM(
        Gemma2Config(**SMALL, head_dim=32, final_logit_softcapping=0.3)),
    "cohere (logit_scale)": lambda: CohereForCausalLM(CohereConfig(**SMALL, logit_scale=0.3)),
    "granite (logits_scaling)": lambda: GraniteForCausalLM(GraniteConfig(**SMALL,
                                                                         logits_scaling=4.0)),
}


class _Bigram(torch.nn.Module):
    """A model whose next-token distribution depends on the current token only: the decoder's
    state is a row of `table` (log-probabilities) and the head is the identity. Its log-probs can
    be read off the table by hand."""

    def __init__(self, probs):
        super().__init__()
        self.embed = torch.nn.Embedding.from_pretrained(torch.tensor(probs).log(), freeze=False)
        self.head = torch.nn.Identity()
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace())

    def get_decoder(self):
        return lambda input_ids, use_cache: SimpleNamespace(last_hidden_state=self.embed(input_ids))

    def get_output_embeddings(self):
        return self.head


def test_completion_logprobs_of_a_bigram_model_by_hand():
    """Prompt [0] then completion [1, 2, 0]; prompt [1, 2] then [2] (padded with 0). Token t's
    log-prob is log P(t | token before t); entropies are of the row it was sampled from."""
    P = [[0.5, 0.25, 0.25],  # P(next | 0)
         [0.1, 0.6, 0.3],  # P(next | 1)
         [0.2, 0.2, 0.6]]  # P(next | 2)
    model = _Bigram(P)
    ids, pl, cl = pack([[0], [1, 2]], [[1, 2, 0], [2]], pad_id=0)
    for chunk_tokens in (1, 2048):  # chunking changes nothing
        lp, ent = completion_logprobs(model, ids, pl, cl, chunk_tokens=chunk_tokens)
        expected = [math.log(0.25), math.log(0.3), math.log(0.2),  # P(1|0), P(2|1), P(0|2)
                    math.log(0.6), 0.0, 0.0]  # P(2|2), then zeros past the completion
        assert lp.flatten().tolist() == pytest.approx(expected, abs=1e-6)
        H = [-sum(p * math.log(p) for p in row) for row in P]
        assert ent.flatten().tolist() == pytest.approx([H[0], H[1], H[2], H[2], 0, 0], abs=1e-6)
    # At temperature 0.5 the sampled distribution after 0 is (0.25, 0.0625, 0.0625) / 0.375.
    lp, _ = completion_logprobs(model, ids, pl, cl, temperature=0.5)
    assert lp[0, 0].item() == pytest.approx(math.log(0.0625 / 0.375), abs=1e-6)
    lp.sum().backward()  # the log-probs carry the gradient back to the weights
    assert model.embed.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_chunked_logprobs_equal_the_models_own(name):
    torch.manual_seed(0)
    model = ARCHITECTURES[name]().eval()
    prompts = [[5, 6, 7], [8]]
    completions = [[9, 2], [10, 11, 12, 13, 2]]
    input_ids, pl, cl = pack(prompts, completions, pad_id=0)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, input_ids, pl, cl, temperature=0.7, chunk_tokens=3)
        full = torch.log_softmax(model(input_ids).logits.float() / 0.7, -1)
    for b in range(2):
        for j, tok in enumerate(completions[b]):
            assert lp[b, j] == pytest.approx(float(full[b, len(prompts[b]) + j - 1, tok]), abs=1e-4)
    check_head_logits(model)  # passes for every architecture smolrl knows


@pytest.mark.parametrize("name", ["llama", "cohere (logit_scale)", "granite (logits_scaling)",
                                  "gemma2 (final-logit soft-capping)"])
@pytest.mark.parametrize("bf16", [False, True])
def test_linear_head_backward_equals_autograd(name, bf16, monkeypatch):
    """LinearHeadLogprobs writes the head's backward out (Gemma 2's soft cap too, issue 69);
    autograd through head_logits (the path every other head takes) must give the same log-probs,
    entropies and gradients -- with the rows in cache-sized blocks (a CPU's), in blocks that
    split a chunk unevenly, and in a GPU's eighths (the device pretended)."""
    import logprobs as logprobs_module
    torch.manual_seed(0)
    model = ARCHITECTURES[name]()
    assert logprobs_module.linear_head(model)[0] is not None  # these take the written-out path
    input_ids, pl, cl = pack([[5, 6, 7], [8]], [[9, 2], [10, 11, 12, 13, 2]], pad_id=0)
    weights = torch.randn(2, 5)  # a loss that weighs every token differently

    def run():
        model.zero_grad()
        with autocast("cpu", bf16):
            lp, ent = completion_logprobs(model, input_ids, pl, cl, temperature=0.7,
                                          chunk_tokens=3)
        (lp * weights).sum().backward()
        return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}

    fast = run()
    # Row blocks of 2 (a tiny vocabulary fits in one): blocks that split a chunk unevenly.
    row_blocks = logprobs_module._row_blocks
    monkeypatch.setattr(logprobs_module, "_row_blocks", lambda logits: row_blocks(
        logits, cache_bytes=2 * 4 * logits.shape[1]))
    blocked = run()
    monkeypatch.setattr(logprobs_module, "_row_blocks", row_blocks)
    monkeypatch.setattr(logprobs_module, "on_cuda", lambda device: True)
    eighths = run()
    monkeypatch.setattr(logprobs_module, "linear_head", lambda model: (None, 1.0, 0.0))
    slow = run()
    tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)
    for run_ in (fast, blocked, eighths):
        torch.testing.assert_close(run_[0], slow[0], **tol)
        torch.testing.assert_close(run_[1], slow[1], **tol)
        for name in slow[2]:
            torch.testing.assert_close(run_[2][name], slow[2][name], **tol, msg=name)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_batch_of_one_chunk_runs_the_head_once(bf16, monkeypatch):
    """The head's (n, H) x (H, V) product: a batch that is one log-prob chunk keeps its logits for
    the backward (LinearHeadLogprobs' keep_logits) and runs the product once, forward only; a
    batch of several chunks makes each chunk's again in the backward, so that only one chunk's
    logits are ever alive. The log-probs and every gradient are the same bit for bit as the
    chunk's with its logits made again: the product made again is the one kept."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import logprobs as logprobs_module

    torch.manual_seed(0)
    model = ARCHITECTURES["llama"]()
    V = model.config.vocab_size

    class HeadProducts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func == torch.ops.aten.mm.default and out.shape[-1] == V:
                self.count += 1  # a product whose output has the vocabulary's width: logits
            return out

    input_ids, pl, cl = pack([[5, 6, 7], [8]], [[9, 2], [10, 11, 12, 13, 2]], pad_id=0)
    weights = torch.randn(2, 5)

    def run(chunk_tokens):
        model.zero_grad()
        products = HeadProducts()
        with autocast("cpu", bf16), products:
            lp, _ = completion_logprobs(model, input_ids, pl, cl, temperature=0.7,
                                        chunk_tokens=chunk_tokens)
            (lp * weights).sum().backward()
        return products.count, lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    kept, several = run(2048), run(4)  # 7 completion tokens: one chunk, then two
    chunk_logprobs = logprobs_module.chunk_logprobs
    monkeypatch.setattr(logprobs_module, "chunk_logprobs",
                        lambda *args, only_chunk: chunk_logprobs(*args, only_chunk=False))
    made_again = run(2048)
    assert (kept[0], made_again[0], several[0]) == (1, 2, 2 * 2)
    assert torch.equal(kept[1], made_again[1])
    for name, grad in kept[2].items():
        assert torch.equal(grad, made_again[2][name]), name


@pytest.mark.parametrize("attention", ["sdpa", "smolrl", "smolrl-long-rows",
                                       "smolrl-long-rows-on-cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shared_prompt_gives_every_completion_its_own_rows_logprobs(dtype, attention,
                                                                      monkeypatch):
    """A group's prompt runs once, followed by all its completions (logprobs.share_prompts): every
    log-prob, entropy and gradient must equal those of each sample in its own row -- to fp32's
    rounding, and in bf16 (the bf16 copy the update runs on) to bf16's, scaled to the values.
    Under SDPA the packed rows carry a mask; under smolrl's attention (attention.py) each
    completion runs against its prompt's keys and its own, the others never computed."""
    import logprobs as logprobs_module
    from attention import use_smolrl_attention
    from conftest import assert_close_to_scale
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    if attention != "sdpa":
        assert use_smolrl_attention(model)
    if attention.startswith("smolrl-long-rows"):  # (rows too long for matmuls: SDPA's kernels)
        monkeypatch.setattr("attention.SMALL_SCORES", 0)
    if attention.endswith("on-cuda"):  # (CUDA's calls, as the device pretended gets them)
        monkeypatch.setattr("attention.on_cuda", lambda device: True)
    a, b, c = [5, 6, 7, 8], [9, 10], [11, 12, 13]
    prompts = [a, a, b, a, b, c]  # groups need not be contiguous; c is alone
    completions = [[20, 21], [22, 23, 24, 25, 2], [26], [27], [28, 29, 30], [31, 32]]
    input_ids, pl, cl = pack(prompts, completions, pad_id=0)
    check_head_logits(model)  # verifies that sharing changes nothing for this architecture
    assert model.smolrl_shares_prompts
    shared = logprobs_module.share_prompts(model, input_ids, pl, cl)
    # three distinct prompts: under SDPA's mask a row each (the longest 12 tokens: a's 4 + its
    # completions' 8), under smolrl's attention one row of every token once, no padding
    rows = (3, 12) if attention == "sdpa" else (1, 4 + 8 + 2 + 4 + 3 + 2)
    assert shared is not None and tuple(shared.input_ids.shape) == rows
    assert (shared.layout is None) == (shared.mask.dim() == 4) == (attention == "sdpa")
    weights = torch.randn(6, 5)

    def run():
        model.zero_grad()
        lp, ent = completion_logprobs(model, input_ids, pl, cl, temperature=0.7)
        (lp * weights).sum().backward()
        return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}

    model.to(dtype)  # (the verdict above is made in fp32, as setup_trainer makes it)
    together = run()
    monkeypatch.setattr(logprobs_module, "share_prompts", lambda *args: None)
    apart = run()
    if dtype == torch.float32:
        for x, y in zip(together[:2], apart[:2]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        for name in apart[2]:
            torch.testing.assert_close(together[2][name], apart[2][name], rtol=1e-4, atol=1e-6,
                                       msg=name)
        return
    for x, y in zip(together[:2], apart[:2]):
        assert_close_to_scale(x.float(), y.float(), dtype, "log-probs and entropies")
    for name in apart[2]:
        assert_close_to_scale(together[2][name].float(), apart[2][name].float(), dtype, name)
    distinct = pack([a, b], [[20], [21]], pad_id=0)
    assert logprobs_module.share_prompts(model, *distinct) is None  # nothing to share


def test_a_hybrid_decoder_never_shares_prompts():
    """LFM2's convolution layers run a packed row as one sequence, so a completion would see the
    ones packed before it: the check at load must turn sharing off (rows run apart)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM
    import logprobs as logprobs_module
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(Lfm2Config(**SMALL, initializer_range=0.5,
                                       layer_types=["conv", "full_attention"])).eval()
    check_head_logits(model)
    assert model.smolrl_shares_prompts is False
    input_ids, pl, cl = pack([[5, 6, 7]] * 3, [[9, 10, 11], [12, 13], [14]], pad_id=0)
    assert logprobs_module.share_prompts(model, input_ids, pl, cl) is None


def test_an_unknown_head_is_refused():
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    forward = model.forward

    def scaled(*args, **kwargs):  # an architecture that does something after its head
        out = forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    model.forward = scaled
    with pytest.raises(SystemExit, match="log-probs differ from the model's own"):
        check_head_logits(model)


def test_training_forward_builds_no_kv_cache(tiny_model):
    model, _ = tiny_model
    decoder = model.get_decoder()
    seen = []
    forward = decoder.forward
    decoder.forward = lambda *a, **k: (seen.append(k.get("use_cache")), forward(*a, **k))[1]
    try:
        ids, pl, cl = pack([[5, 6]], [[7, 8]], pad_id=0)
        completion_logprobs(model, ids, pl, cl)
    finally:
        del decoder.forward
    assert seen == [False]


def test_bf16_engine_keeps_rope_in_fp32_far_into_the_sequence(tokenizer):
    """Rounded to bf16, inv_freq shifts every rotary angle by an amount growing with position:
    the engine's log-probs drift from the trainer's far into a long sequence."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMALL, "vocab_size": 512, "hidden_size": 128,
                            "max_position_embeddings": 2048})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention, so positions matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    engine = HFRollout(model, tokenizer)
    for name, buf in engine.model.named_buffers():
        assert buf.dtype == torch.float32, name
    ids = torch.randint(3, 512, (1, 1200))
    pl, cl = torch.tensor([1]), torch.tensor([1199])
    with torch.no_grad():
        with autocast("cpu"):
            trainer, _ = completion_logprobs(model, ids, pl, cl)
        engine_lp, _ = completion_logprobs(engine.model, ids, pl, cl)
    diff = (engine_lp - trainer).abs()[0]  # (1199,)
    # measured: 0.0042 at positions >= 1000 with fp32 buffers, 0.031 with inv_freq in bf16
    assert float(diff[999:].mean()) < 0.01
    assert float(diff[999:].mean()) < 3 * float(diff[:100].mean())


def test_the_update_s_model_flops_are_a_hand_count_of_the_tiny_llama(tiny_model_dir):
    """hardware.py's count for the tiny Llama (vocab V, width 128, MLP 256, 2 layers, 2 heads of
    64 with one KV head, tied head): N = V*128 (the head; the tied embedding is looked up) + 2 x
    (q 128*128 + k, v 128*64 each + o 128*128 + gate, up, down 3 x 128*256); a forward is 2N + 4
    L d T a token, a backward twice that, and the KL reference one more forward. Two groups of two
    rows share their prompt: the forward runs each prompt once (4 + 3 tokens) and every
    completion (2 + 1 + 2 + 2)."""
    from conftest import make_batch
    from hardware import processed_tokens
    from grpo import Config
    from trainer import setup_trainer, update_flops
    cfg = Config(model=tiny_model_dir, data="arith", beta=0.1)
    trainer = setup_trainer(cfg, reference=True)
    V = trainer.model.config.vocab_size
    N = V * 128 + 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256) + 5 * 128  # (+ the norms'
    # weights: every parameter but the looked-up embedding counts, as in nanoGPT's estimate_mfu)
    batch = make_batch([[5, 6, 7, 8]] * 2 + [[9, 10, 11]] * 2, [[1, 2], [3], [4, 5], [6, 7]],
                       [1.0, -1.0, 1.0, -1.0])
    keep = torch.arange(4)
    assert processed_tokens(batch.input_ids, batch.prompt_lens, batch.completion_lens, keep,
                            True) == 4 + 3 + 7
    assert processed_tokens(batch.input_ids, batch.prompt_lens, batch.completion_lens, keep,
                            False) == 2 * 4 + 2 * 3 + 7
    T = (6 + 5 + 5 + 5) / 4  # the mean row length
    per_token = (2 * N + 4 * 2 * 128 * T) * 2 + (4 * N + 8 * 2 * 128 * T)  # policy + reference
    shares = trainer.compute.smolrl_shares_prompts
    assert update_flops(trainer, batch, keep) == pytest.approx(
        (14 if shares else 21) * per_token, rel=1e-9)
    # Micro-batches of 3 rows split the second group: its prompt runs in each (the count once
    # took it once for the whole update)
    trainer.cfg.micro_batch_size, trainer.cfg.max_tokens_per_microbatch = 3, None
    assert update_flops(trainer, batch, keep) == pytest.approx(
        (4 + 3 + 5 + 3 + 2 if shares else 21) * per_token, rel=1e-9)


def test_generations_roofline_floors_are_a_hand_count_of_the_tiny_llama(tiny_model, monkeypatch):
    """hardware.py's floors for the tiny Llama. Bytes: a decoding step reads the N matmul weights
    (as in the FLOPs test: the tied head once), a context token's keys and values are 2 (K, V) x
    2 layers x 1 KV head x 64 dims; fp32, 4 bytes each. FLOPs: 2 N a token's forward, 4 L d =
    4 x 2 x 128 a key it attends to. The HF engine samples 2 x 3 tokens of a 4-token prompt, no
    stop token: the prompt's prefill runs once (4 tokens, attending to 1 + 2 + 3 + 4 = 10 keys),
    then two decoding forwards (tokens 1 and 2 fed back, each sample reading 5 then 6 keys). At 1
    FLOP/s and 1 byte/s the floors are the counts themselves."""
    import rollout
    from hardware import Floors, decode_bytes, decode_cost
    from rollout import HFRollout
    from sampling import Sampling
    model, tokenizer = tiny_model
    V = model.config.vocab_size
    N = V * 128 + 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256) + 5 * 128
    cost = decode_cost(model, torch.float32)
    assert cost == (4 * N, 2 * 2 * 1 * 64 * 4, 2 * N, 4 * 2 * 128)
    assert decode_cost(model, torch.bfloat16) == (2 * N, 2 * 2 * 1 * 64 * 2, 2 * N, 4 * 2 * 128)
    engine = HFRollout(model, tokenizer, dtype=torch.float32)
    engine.stop_ids = set()
    monkeypatch.setattr(rollout, "floors", lambda flops, nbytes, *_: Floors(flops, nbytes))
    out = engine.generate([[5, 6, 7, 8]], 2, Sampling(3, 1.0, seed=0))
    assert [len(c) for c in out.completion_ids] == [3, 3]
    assert out.memory_floor == decode_bytes(cost, 2, 2 * 5 + 2 * 6) == 2 * 4 * N + 22 * 1024
    tokens, keys = 4 + 2 * 2, 10 + 2 * (5 + 6)
    assert out.compute_floor == tokens * 2 * N + keys * 4 * 2 * 128
    # A second call finds the prompt's keys and values kept from the first: only its last token
    # runs (held 3, new 1: 4 keys), and the floors count what ran.
    engine.generate([[5, 6, 7, 8]], 2, Sampling(3, 1.0, seed=0, keep_cache=True))
    again = engine.generate([[5, 6, 7, 8, *out.completion_ids[0]]], 1, Sampling(2, 1.0, seed=0))
    if again.cached_tokens:  # (the engine kept this prompt's keys and values)
        held = again.cached_tokens
        new = 7 - held
        assert again.compute_floor == (new + 1) * 2 * N + (new * held + new * (new + 1) // 2
                                                           + 7 + 1) * 4 * 2 * 128


def test_no_fraction_of_the_machines_limit_passes_one_after_a_busy_start(tiny_model_dir,
                                                                           tmp_path, monkeypatch):
    """A start that shares the cores with another job measures the peak FLOP/s and the bandwidth
    low (here: 1/1000 of the real ones, as a stand-in for a busy start); the run's fractions must
    still be at most 1 -- issue 57 saw mfu 135 % --, each limit measured again and raised to what
    a phase achieved."""
    import grpo
    import hardware
    from cli import parse_config
    real = {"peak": hardware._measure_peak, "bandwidth": hardware._measure_bandwidth}
    calls = {"peak": 0, "bandwidth": 0}

    def busy_first(kind):
        def measure(*args):
            calls[kind] += 1
            rate, where = real[kind](*args)
            return (rate / 1000 if calls[kind] == 1 else rate), where
        return measure
    monkeypatch.setattr(hardware, "_measure_peak", busy_first("peak"))
    monkeypatch.setattr(hardware, "_measure_bandwidth", busy_first("bandwidth"))
    monkeypatch.setattr(hardware, "_BEST", {})
    out = tmp_path / "run"
    grpo.main(parse_config(grpo.Config, [
        "--model", tiny_model_dir, "--data", "arith", "--steps", "2", "--prompts-per-step", "2",
        "--num-generations", "4", "--max-new-tokens", "8", "--eval-every", "2",
        "--reward", "tests.rewards:parity_reward", "--temperature", "1.0",
        "--eval-size", "4", "--dtype", "fp32", "--out", str(out)]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    fractions = [(k, r[k]) for r in rows for k in r if k == "mfu" or k.endswith("_frac")
                 and k.split("_")[0] in ("gen", "eval")]
    assert {k for k, _ in fractions} >= {"mfu", "gen_roofline_frac", "gen_compute_frac",
                                         "gen_memory_frac", "eval_roofline_frac"}
    assert all(0 < v <= 1 for _, v in fractions), fractions
    assert calls["peak"] >= 2 and calls["bandwidth"] >= 2  # measured again once beaten


def test_a_cpus_limits_are_measured_again_each_minute_and_the_best_reading_stands(monkeypatch):
    """A reading taken while another job shared the cores stays low, and every fraction over it
    high: 146 against 183 GFLOP/s in two runs of one day, +25 % on each `mfu` of the first. On a
    CPU the limit is measured again once a minute and the best reading kept (a lower one never
    lowers it); a GPU's datasheet figure is never measured."""
    import hardware
    clock, readings = [0.0], iter([100.0, 180.0, 150.0])
    monkeypatch.setattr(hardware, "_BEST", {})
    monkeypatch.setattr(hardware.time, "monotonic", lambda: clock[0])
    measure = lambda: (next(readings), "measured")  # noqa: E731
    best = lambda: hardware._best(("peak", "cpu", torch.float32), measure, 0.0)[0]  # noqa: E731
    assert best() == 100.0
    clock[0] = 30.0
    assert best() == 100.0  # (within the minute: not measured)
    clock[0] = 61.0
    assert best() == 180.0
    clock[0] = 122.0
    assert best() == 180.0  # 150 read, 180 kept
    gpu = iter([(989e12, "datasheet")])
    assert hardware._best(("peak", "cuda", torch.bfloat16), lambda: next(gpu), 0.0)[0] == 989e12
    clock[0] = 1e6
    assert hardware._best(("peak", "cuda", torch.bfloat16), lambda: next(gpu), 0.0)[0] == 989e12


@pytest.mark.parametrize("probe_gflops, large", [(0.27, False), (1.3, False), (5.0, False),
                                                  (40.0, True), (150.0, True)])
def test_the_peak_of_an_emulated_dtype_is_measured_without_a_minute_long_matmul(probe_gflops,
                                                                                large, monkeypatch):
    """bf16 on an AVX2-only CPU is emulated: one 512 x 2048 x 2048 matmul took 16 s (0.27 GFLOP/s,
    where a 128 x 512 x 512 one ran at 1.3), and measuring the peak (a warm-up call, a timed one,
    again once a phase beat it) took a minute of the first step of every process of a run. A small
    matmul is timed first; the large one only where it would take well under a second (40 GFLOP/s:
    0.11 s), else the small one's rate is the peak (5 GFLOP/s: 0.86 s, 4 s if 5x slower at size).
    (Rates stand in for CPUs.)"""
    import hardware
    asked = []

    def rate(dtype, shape=(64, 576, 1536), seconds=0.03):
        asked.append(shape)
        return probe_gflops if shape == hardware.PROBE_SHAPE else probe_gflops * 1.2
    monkeypatch.setattr(hardware, "matmul_rate", rate)
    peak, where = hardware._measure_peak("cpu", torch.bfloat16)
    if large:
        assert asked == [hardware.PROBE_SHAPE, hardware.PEAK_SHAPE]
        assert peak == pytest.approx(probe_gflops * 1.2e9)
    else:
        assert asked == [hardware.PROBE_SHAPE] and peak == pytest.approx(probe_gflops * 1e9)
        assert str(hardware.PROBE_SHAPE) in where


def test_smolrl_attention_gives_the_logits_sdpa_gives():
    """attention.py stands in for SDPA in every layer of a model that takes it: a whole forward
    (SDPA's own path), a decoding step from a cache (decode_attention) and a packed row of shared
    prompts (the test above) must give what the model gives under SDPA."""
    from attention import use_smolrl_attention
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    ids = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits  # (2, 9, V) under SDPA
        assert use_smolrl_attention(model) and model.config._attn_implementation == "smolrl"
        whole = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :8], use_cache=True)
        step = model(input_ids=ids[:, 8:], past_key_values=first.past_key_values).logits
    torch.testing.assert_close(whole, want)
    torch.testing.assert_close(step[:, -1], want[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp32 under autocast"])
def test_small_attention_recomputes_in_its_backward_the_gradients_sdpa_gives(dtype):
    """attention.SmallAttention keeps q, k and v for the backward, not the probabilities, and
    recomputes them there: its output and its gradients for q, k and v must be SDPA's (computed
    in fp64 as the reference) to the input dtype's rounding, with grouped query heads and a
    mask whose rows see different keys -- under bf16 autocast too (LoRA's and FSDP's fp32
    weights), where a forward run by autocast in bf16 and a backward recomputed in fp32 would
    differ by ~1 %."""
    from attention import SmallAttention
    autocast = dtype == "fp32 under autocast"
    dtype = torch.float32 if autocast else dtype
    torch.manual_seed(0)
    B, H, KV, n, m, D = 3, 6, 2, 5, 9, 8
    q, k, v = (torch.randn(B, h, length, D).to(dtype).requires_grad_()
               for h, length in ((H, n), (KV, m), (KV, m)))
    mask = torch.rand(B, 1, n, m) < 0.6
    mask[..., 0] = True  # every query sees a key
    d_out = torch.randn(B, H, n, D)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = SmallAttention.apply(q, k, v, mask, 0.3)
    got.backward(d_out.to(dtype))
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=mask, scale=0.3, enable_gqa=True)
    want.backward(d_out.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert got.dtype == dtype and all(t.grad.dtype == dtype for t in (q, k, v))
    torch.testing.assert_close(got.double(), want, **tol)
    for mine, theirs in zip((q, k, v), ref):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **tol)


@pytest.mark.parametrize("dtypes", ["bf16", "fp32", "autocast: fp32 q and k, bf16 v",
                                    "fp32 q, bf16 k and v"])
def test_small_attention_computes_only_its_scores_in_fp32(dtypes):
    """SmallAttention's products, forward and backward: the scores q k^T (and their recomputation)
    in fp32 whatever the dtype, the five others -- p v, dv, dp, dq and dk -- in the queries' dtype
    (bf16 products run ~2.5x faster on a CPU than fp32 ones; FlashAttention-2 rounds p and ds
    alike). Before, a bf16 model ran all seven in fp32. In bf16 the output differs from the same
    attention with p kept in fp32 by no more than p's rounding and its own. In fp32, and under
    bf16 autocast (LoRA, FSDP2: rotary hands over q and k in fp32 beside a bf16 v), every product
    is fp32: the output is the fp32 formula's bit for bit and the gradients autograd's through it
    to fp32's rounding (the code before this change gave the same bits in both: checked once,
    2026-12-06)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from attention import SmallAttention, _probs

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                self.dtypes.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    B, H, KV, n, m, D = 2, 6, 2, 5, 9, 8
    qk_dtype = torch.bfloat16 if dtypes == "bf16" else torch.float32  # the queries'
    k_dtype = torch.bfloat16 if dtypes.startswith(("bf16", "fp32 q,")) else torch.float32
    v_dtype = torch.float32 if dtypes == "fp32" else torch.bfloat16
    q, k, v = (torch.randn(B, h, length, D).to(dtype).requires_grad_()
               for h, length, dtype in ((H, n, qk_dtype), (KV, m, k_dtype), (KV, m, v_dtype)))
    mask = torch.rand(B, 1, n, m) < 0.6
    mask[..., 0] = True
    d_out = torch.randn(B, H, n, D).to(v_dtype)
    products = Products()
    with products:
        out = SmallAttention.apply(q, k, v, mask, 0.3)
        out.backward(d_out)
    assert out.dtype == v_dtype and (q.grad.dtype, k.grad.dtype, v.grad.dtype) == \
        (qk_dtype, k_dtype, v_dtype)
    fp32 = torch.float32
    assert products.dtypes == [fp32, qk_dtype, fp32] + [qk_dtype] * 4
    # The fp32 formula, as SmallAttention computed every case before: autograd through it.
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    p = _probs(ref[0].reshape(B, KV, H // KV * n, D), ref[1], mask, 0.3)
    fp32_out = (p @ ref[2]).view(B, H, n, D)
    if dtypes != "bf16":
        assert torch.equal(out.detach(), fp32_out.detach().to(v_dtype))
        fp32_out.backward(d_out.float())
        for mine, theirs in zip((q, k, v), ref):
            torch.testing.assert_close(mine.grad, theirs.grad.to(mine.dtype), rtol=1e-6,
                                       atol=1e-7)
    else:  # p rounded to bf16 (half a unit, 2^-9 of each p) and the output rounded once more
        bound = 2.0 ** -9 * (p @ ref[2].abs()).view(B, H, n, D) + 2.0 ** -8 * fp32_out.abs()
        assert bool(((out.detach().float() - fp32_out.detach()).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_attention_makes_few_tensors_the_size_of_its_scores(dtype):
    """At the default run's shapes SmallAttention's time went as much to the passes over its
    (B, KV, g n, m) scores as to its products: each fresh tensor that size costs a pass and its
    page faults on a CPU. In bf16 the forward makes three -- the product, the softmax, p in the
    products' dtype -- and the backward seven (the scores' three again, dp and its fp32 copy,
    dp p, ds rounded), where the plain formula made 5 and 12 (in fp32 2 and 4, against 4 and 9):
    the scaling and the mask go in place, the mask added as 0 or fp32's lowest (masked_fill with
    a broadcast mask ran ~14x slower), ds in place. The probabilities stay the plain formula's
    bit for bit -- q k^T in fp32, scaled, masked_fill'ed, softmax'ed -- with q and the keys as the
    model hands them over (strided views of its projections), at shapes whose keys the CPU's
    matmul takes as they are (B = 1, one KV head, one query) and in every dtype mix: given
    another layout of the same keys, it sums in another order."""
    from attention import SmallAttention, _probs
    from conftest import FreshTensors

    def views(B, H, KV, n, m, D, q_dtype, kv_dtype):  # (B, heads, length, D), as the model's
        return [torch.randn(B, length, h, D).to(t).transpose(1, 2).requires_grad_()
                for h, length, t in ((H, n, q_dtype), (KV, m, kv_dtype), (KV, m, kv_dtype))]

    torch.manual_seed(0)
    for B, H, KV, n, m, D in ((4, 6, 2, 5, 9, 8), (1, 6, 2, 5, 9, 8), (4, 6, 1, 5, 9, 8),
                              (1, 6, 2, 1, 100, 128), (4, 8, 1, 2, 7, 33)):
        for q_dtype in {dtype, torch.float32}:  # (fp32 q beside bf16 keys: under autocast)
            q, k, _ = views(B, H, KV, n, m, D, q_dtype, dtype)
            mask = torch.rand(B, 1, n, m) < 0.6
            mask[..., 0] = True
            q = q.detach().reshape(B, KV, H // KV * n, D)
            plain = (q.float() @ k.detach().float().transpose(-1, -2)) * 0.3
            plain = torch.softmax(plain.view(B, KV, H // KV, n, m).masked_fill(
                ~mask[:, :, None], torch.finfo(torch.float32).min), dim=-1)
            assert torch.equal(_probs(q, k.detach(), mask, 0.3),
                               plain.view(B, KV, H // KV * n, m)), (B, H, KV, n, m, D, q_dtype)
    B, H, KV, n, m, D = 4, 6, 2, 5, 9, 8
    q, k, v = views(B, H, KV, n, m, D, dtype, dtype)
    mask = torch.rand(B, 1, n, m) < 0.6
    mask[..., 0] = True
    forward, backward = FreshTensors(B * H * n * m), FreshTensors(B * H * n * m)
    with forward:
        out = SmallAttention.apply(q, k, v, mask, 0.3)
    with backward:
        out.backward(torch.randn(B, H, n, D).to(dtype))
    bf16 = dtype == torch.bfloat16  # (in fp32 p, dp and ds need no copy in the products' dtype)
    assert (forward.count, backward.count) == ((3, 7) if bf16 else (2, 4))


def test_small_attention_takes_a_double_backward():
    """Its backward runs ds in place only where no graph is recorded: with create_graph (a
    gradient penalty, a Hessian-vector product) dp * p keeps dp for the second backward, and an
    in-place ds raised there. Second-order gradients against autograd through plain attention."""
    from attention import SmallAttention

    torch.manual_seed(0)
    B, H, KV, n, m, D = 2, 4, 2, 3, 5, 8
    base = [torch.randn(B, length, h, D, dtype=torch.float64).transpose(1, 2)
            for h, length in ((H, n), (KV, m), (KV, m))]
    mask = torch.ones(n, m, dtype=torch.bool).tril(m - n).expand(B, 1, n, m)
    d_out = torch.randn(B, H, n, D, dtype=torch.float64)

    def plain(q, k, v):
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~mask, torch.finfo(torch.float32).min)
        return torch.softmax(s, -1) @ v

    def second_order(attend):
        q, k, v = [t.float().requires_grad_() for t in base]
        grads = torch.autograd.grad(attend(q, k, v), (q, k, v), d_out.float(), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v))

    mine = second_order(lambda q, k, v: SmallAttention.apply(q, k, v, mask, 0.3))
    for got, want in zip(mine, second_order(plain)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_on_cuda_run_sdpas_causal_kernels_without_a_mask(dtype, monkeypatch):
    """Rows too long for SmallAttention go to SDPA. On CUDA FlashAttention takes grouped KV heads
    (enable_gqa) but no mask, and the memory-efficient kernel a mask but no grouped heads: SDPA
    given both falls back to its math kernel, which keeps the fp32 scores for backward (~9.9 GB a
    layer at 8K tokens, 12 heads). So long blocks carry no mask where causal attention is exact
    (issue 69): the prompts is_causal; each prompt's completions -- its P keys, then their own --
    torch's lower-right causal bias, which calls FlashAttention with its causal option and makes
    no mask; and in fp32 (no FlashAttention) the KV heads are repeated for the memory-efficient
    kernel. The device is pretended (attention.on_cuda): the calls SDPA gets, and their outputs
    and gradients against the CPU's, which get a bool (n, m) mask for the completions."""
    from types import SimpleNamespace

    from torch.nn.attention.bias import CausalBias

    import attention
    monkeypatch.setattr(attention, "SMALL_SCORES", 0)  # (every block is a long one)
    calls = []  # (KV heads of k, enable_gqa, the mask's kind) of each SDPA call
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        kind = "none" if attn_mask is None else "causal bias" if isinstance(
            attn_mask, CausalBias) else tuple(attn_mask.shape)
        calls.append((k.shape[1], kwargs.get("enable_gqa", False), kind))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    # (attention.py's F only: CausalBias hands SDPA's calls back to the real function)
    monkeypatch.setattr(attention, "F", SimpleNamespace(scaled_dot_product_attention=spy))
    torch.manual_seed(0)
    H, KV, D = 6, 2, 8
    prompt_at = [(0, 5), (12, 3)]  # two prompts: 5 tokens, then 3
    completion_at = [(0, 5, 4), (0, 9, 3), (1, 15, 2)]  # (its prompt, start, length)
    L = 17
    q, k, v = (torch.randn(1, h, L, D).to(dtype) for h in (H, KV, KV))
    d_out = torch.randn(1, L, H, D).to(dtype)

    def run():
        layout = attention.prefix_layout(prompt_at, completion_at, L, "cpu", heads=H)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention.prefix_shared_attention(*inputs, layout, 0.3, 0.0)  # (1, L, H, D)
        out.backward(d_out)
        return [out.detach()] + [t.grad for t in inputs]

    on_cpu = run()
    assert calls == [(KV, True, "none"), (KV, True, (4, 9)), (KV, True, (2, 5))]
    monkeypatch.setattr(attention, "on_cuda", lambda device: True)
    calls.clear()
    as_on_cuda = run()
    grouped = dtype == torch.bfloat16  # (FlashAttention: half precision only)
    heads = KV if grouped else H
    assert calls == [(heads, grouped, "none"), (heads, grouped, "causal bias"),
                     (heads, grouped, "causal bias")]
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0, "atol": 2e-2}
    for got, want, name in zip(as_on_cuda, on_cpu, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got, want, **tol, msg=name)


@pytest.mark.parametrize("arch", ["mistral-window", "qwen2-sliding-layer"])
def test_a_model_with_sliding_layers_packs_rows_with_sdpas_mask(arch):
    """smolrl's attention runs a packed row by its layout only where every layer attends plainly
    to all earlier tokens: a model with a sliding window, or with one sliding layer among full
    ones, gets SDPA's mask for its packed rows, and its shared log-probs stay those apart."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    import logprobs as logprobs_module
    from attention import use_smolrl_attention
    torch.manual_seed(0)
    small = {k: v for k, v in SMALL.items() if k != "max_position_embeddings"}
    model = MistralForCausalLM(MistralConfig(**small, sliding_window=64)) \
        if arch == "mistral-window" else Qwen2ForCausalLM(Qwen2Config(
            **small, use_sliding_window=True, sliding_window=64, max_window_layers=1))
    assert use_smolrl_attention(model)
    check_head_logits(model)
    a = [5, 6, 7, 8]
    batch = pack([a, a, a], [[20, 21], [22, 23, 24], [25]], pad_id=0)
    shared = logprobs_module.share_prompts(model, *batch)
    assert shared is not None and shared.layout is None and shared.mask.dim() == 4
    together, _ = completion_logprobs(model, *batch)
    model.smolrl_shares_prompts = False
    apart, _ = completion_logprobs(model, *batch)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)


def test_soft_capped_attention_is_the_models_own_definition():
    """Issue 55: Gemma 2's layers soft-cap their attention scores (cap tanh(s / cap)); handed to
    SDPA, which has no such option, the cap was dropped. smolrl's attention computes them as the
    model's eager attention does: a whole forward, a decoding step from a cache, and log-probs
    with shared prompts (SDPA's mask: a sliding window) and their gradients equal eager's -- and
    SDPA's differ, so the cap matters at this size."""
    import copy

    from attention import use_smolrl_attention
    from conftest import assert_close_to_scale
    torch.manual_seed(0)
    small = {k: v for k, v in SMALL.items() if k != "max_position_embeddings"}
    eager = Gemma2ForCausalLM(Gemma2Config(**small, head_dim=32, attn_logit_softcapping=0.5,
                                           sliding_window=6, query_pre_attn_scalar=32,
                                           max_position_embeddings=128)).eval()
    for layer in eager.model.layers:  # scores of a few units, where tanh bends (random init
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):  # makes them ~0.01)
            torch.nn.init.normal_(proj.weight, std=0.3)
    eager.set_attn_implementation("eager")
    ours, sdpa = copy.deepcopy(eager), copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    ours.set_attn_implementation("sdpa")
    assert use_smolrl_attention(ours)
    ids = torch.randint(3, 300, (2, 11))
    with torch.no_grad():
        want = eager(input_ids=ids).logits  # (2, 11, V)
        torch.testing.assert_close(ours(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert (sdpa(input_ids=ids).logits - want).abs().max() > 1e-2  # (the cap matters)
        first = ours(input_ids=ids[:, :10], use_cache=True)
        step = ours(input_ids=ids[:, 10:], past_key_values=first.past_key_values).logits
    torch.testing.assert_close(step[:, -1], want[:, -1], rtol=1e-5, atol=1e-5)
    check_head_logits(ours)
    assert ours.smolrl_shares_prompts
    a = [5, 6, 7, 8, 9, 10, 11]
    batch = pack([a, a, a], [[20, 21], [22, 23, 24], [25]], pad_id=0)
    got, _ = completion_logprobs(ours, *batch)
    expected, _ = completion_logprobs(eager, *batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(ours.named_parameters(), eager.parameters()):
        assert_close_to_scale(p.grad, q.grad, what=name)


def test_soft_capped_attention_runs_under_bf16_autocast_with_padding():
    """Issue 67: softcapped_attention masks with the lowest finite fp32 score, which a bf16 tensor
    cannot hold -- and under bf16 autocast (LoRA, DPO: fp32 weights) its `query.float() @ key`
    ran in bf16, so masked_fill raised on every Gemma 2 forward. The scores stay fp32 there too:
    a left-padded batch gives finite logits and gradients, near those without autocast."""
    from attention import use_smolrl_attention
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=32, sliding_window=6,
                                           query_pre_attn_scalar=32))
    assert use_smolrl_attention(model)
    ids = torch.randint(3, 300, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding: its queries attend to nothing
    want = model(input_ids=ids, attention_mask=mask).logits
    with autocast("cpu"):
        got = model(input_ids=ids, attention_mask=mask).logits
    got.float()[mask.bool()].sum().backward()
    assert torch.isfinite(got).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    torch.testing.assert_close(got.float()[mask.bool()], want[mask.bool()], rtol=0, atol=0.05)


def test_a_crafted_weight_file_is_named_in_one_printable_line(tmp_path):
    """A --reward-model (--critic-from) folder whose safetensors header names an escape sequence
    (a clipboard write), which safetensors quotes: the refusal shows it as text."""
    import struct
    from model import check_reward_head
    header = json.dumps({"w": {"dtype": "\x1b]52;c;ZWNobyBwd25lZA==\x07", "shape": [1],
                               "data_offsets": [0, 4]}}, ensure_ascii=False).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header +
                                                 bytes(4))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SystemExit) as stop:
        check_reward_head(str(tmp_path), "--reward-model")
    assert "its weights cannot be read" in str(stop.value)
    assert "\\x1b]52;c;" in str(stop.value) and str(stop.value).isprintable()

"""Completions and masks come from lengths: pad == eos, truncation, the stop token is trained."""

import pytest
import torch

from logprobs import completion_logprobs, length_mask, pack
from rollout import HFRollout, group_batches
from sampling import CDF_BLOCK, Sampling, cut_at_stop, draw, inverse_cdf, sample_next


def test_cut_at_stop_keeps_the_stop_token():
    assert cut_at_stop([5, 6, 2, 2, 2], {2}, 5) == ([5, 6, 2], False)
    assert cut_at_stop([2, 2, 2], {2}, 3) == ([2], False)  # an immediate stop is one token
    assert cut_at_stop([5, 6, 7], {2}, 3) == ([5, 6, 7], True)
    assert cut_at_stop([5, 6, 0], {2, 0}, 3) == ([5, 6, 0], False)  # several stop ids
    # Stopping exactly at the limit is not truncation.
    assert cut_at_stop([5, 6, 2], {2}, 3) == ([5, 6, 2], False)


def test_pack_and_mask_from_lengths_with_pad_equal_eos():
    eos = 2
    prompts = [[10, 11], [12]]
    completions = [[20, eos], [21, 22, eos]]  # pad == eos: values cannot tell pad from stop
    input_ids, prompt_lens, completion_lens = pack(prompts, completions, pad_id=eos)
    assert input_ids.tolist() == [[10, 11, 20, eos], [12, 21, 22, eos]]
    mask = length_mask(completion_lens, 3)
    assert mask.tolist() == [[True, True, False], [True, True, True]]  # stop token included


def test_hf_rollout_shapes_masks_and_truncation(tiny_model):
    model, tok = tiny_model
    rollout = HFRollout(model, tok, batch_size=3)
    prompts = [tok("What is 1 + 1?")["input_ids"], tok("Hi")["input_ids"]]
    out = rollout.generate(prompts, 3, Sampling(max_new_tokens=6, temperature=1.0, seed=0))
    assert len(out) == 6
    assert out.prompt_ids[0] == prompts[0] and out.prompt_ids[3] == prompts[1]  # prompt-major
    for ids, cut in zip(out.completion_ids, out.truncated):
        assert 1 <= len(ids) <= 6
        if cut:
            assert len(ids) == 6 and tok.eos_token_id not in ids
        else:
            assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]


def test_hf_rollout_forced_stop_is_in_the_completion(tiny_model):
    model, tok = tiny_model
    rollout = HFRollout(model, tok)
    V, eos = model.config.vocab_size, tok.eos_token_id

    class EosHead(torch.nn.Module):  # a head that always predicts eos (== pad)
        def forward(self, hidden):
            logits = hidden.new_zeros(*hidden.shape[:-1], V)
            logits[..., eos] = 10.0
            return logits

    rollout.model.lm_head = EosHead()
    out = rollout.generate([tok("x")["input_ids"]], 2, Sampling(4, temperature=0.0))
    assert out.completion_ids == [[eos]] * 2  # one token, the stop itself: not empty
    assert out.truncated == [False, False]


def test_update_weights_copies_the_trainer(tiny_model):
    model, tok = tiny_model
    rollout = HFRollout(model, tok)
    with torch.no_grad():
        trained = type(model)(model.config)
        trained.load_state_dict(model.state_dict())
        trained.model.layers[0].mlp.up_proj.weight.add_(1.0)
    seconds = rollout.update_weights(trained.state_dict())
    assert seconds >= 0
    assert torch.allclose(rollout.model.model.layers[0].mlp.up_proj.weight.float(),
                          trained.model.layers[0].mlp.up_proj.weight, atol=1e-2)


def test_completion_logprobs_match_full_log_softmax(tiny_model):
    model, tok = tiny_model
    prompts = [[5, 6, 7], [8]]
    completions = [[9, 2], [10, 11, 12, 2]]
    input_ids, pl, cl = pack(prompts, completions, pad_id=tok.pad_token_id)
    with torch.no_grad():
        lp, ent = completion_logprobs(model, input_ids, pl, cl, temperature=0.7, chunk_tokens=2)
        full = torch.log_softmax(model(input_ids).logits.float() / 0.7, -1)
    for b in range(2):
        for j, tok_id in enumerate(completions[b]):
            pos = len(prompts[b]) + j
            assert torch.isclose(lp[b, j], full[b, pos - 1, tok_id], atol=1e-4)
            p = full[b, pos - 1].exp()
            assert torch.isclose(ent[b, j], -(p * full[b, pos - 1]).sum(), atol=1e-3)
    assert lp[0, 2:].eq(0).all()  # beyond the completion: zeros, masked out by length


def _greedy_path(model, prompt, steps):
    """Argmax continuation under the model's own logits, with nothing else applied."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_hf_engine_ignores_the_models_generation_config(tiny_model):
    """A generation_config.json with a repetition penalty, top_k, suppressed tokens and a ban on
    repeats must not change what the engine samples: the trainer's log-probs cannot see them."""
    import copy
    from transformers import GenerationConfig
    model, tok = tiny_model
    model = copy.deepcopy(model)
    prompt = tok("What is 2 + 2?")["input_ids"]
    expected = _greedy_path(model, prompt, 6)
    model.generation_config = GenerationConfig(
        repetition_penalty=100.0, top_k=2, suppress_tokens=[expected[0]], no_repeat_ngram_size=1,
        min_new_tokens=6, eos_token_id=tok.eos_token_id)
    engine = HFRollout(model, tok, dtype=torch.float32)
    greedy = engine.generate([prompt], 1, Sampling(max_new_tokens=6, temperature=0.0))
    assert greedy.completion_ids[0] == expected[:len(greedy.completion_ids[0])]
    assert greedy.completion_ids[0][0] == expected[0]  # the suppressed token is still sampled
    sampled = engine.generate([prompt], 64, Sampling(max_new_tokens=1, temperature=1.0, seed=0))
    firsts = [ids[0] for ids in sampled.completion_ids]
    assert len(set(firsts)) > 20  # a near-uniform random model, not top_k=2
    # ... nor transformers' default top_k=50: most samples lie outside the 50 likeliest tokens
    with torch.no_grad():
        order = model(torch.tensor([prompt])).logits[0, -1].argsort(descending=True)
    rank = {int(t): r for r, t in enumerate(order)}
    assert sum(rank[t] >= 50 for t in firsts) > 32


def test_every_eos_id_stops_without_truncation(tiny_model):
    import copy
    model, tok = tiny_model
    model = copy.deepcopy(model)
    prompt = tok("Hi")["input_ids"]
    first = _greedy_path(model, prompt, 1)[0]
    model.generation_config.eos_token_id = [tok.eos_token_id, first]  # e.g. Qwen's <|endoftext|>
    out = HFRollout(model, tok, dtype=torch.float32).generate([prompt], 2, Sampling(
        max_new_tokens=5, temperature=0.0))
    assert out.completion_ids == [[first]] * 2 and out.truncated == [False, False]


def test_sample_next_draws_from_the_tempered_distribution():
    """The token frequencies must follow softmax(logits / T), and a token with probability 0
    must never come out."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 0.5, -1.0, float("-inf"), 1.0])
    rows = 200_000
    tokens = sample_next(logits.expand(rows, -1), Sampling(temperature=0.7))  # (rows,)
    freq = torch.bincount(tokens, minlength=5).float() / rows
    expected = torch.softmax(logits / 0.7, -1)
    assert freq[3] == 0
    torch.testing.assert_close(freq, expected, atol=4e-3, rtol=0)  # ~4 standard errors


def test_the_blocked_inverse_cdf_draws_what_one_running_sum_draws():
    """inverse_cdf against the plain rule -- the first token whose fp64 running sum exceeds u, r of
    the row's total -- on a vocabulary that is not a whole number of blocks, with zero-probability
    tokens (a whole zero block, and the row's tail), u at 0, at a block's end and just under the
    total. Probabilities are multiples of 2**-12 (not summing to 1, as a top-p nucleus does not),
    so that every sum is exact in whatever order it is added."""
    torch.manual_seed(0)
    B, V = 64, 3 * CDF_BLOCK + 37
    probs = torch.randint(1, 8, (B, V)).float() / 2**12
    probs[:, CDF_BLOCK:2 * CDF_BLOCK] = 0  # a block that can never be drawn
    probs[:32, -40:] = 0  # rows 0-31: nothing in the last, partial block (768..804)
    probs[:, 5] = 0
    probs[2] = 0  # row 2: two blocks of 2**-9 each, the first ending at exactly half the total
    probs[2, :CDF_BLOCK] = probs[2, 2 * CDF_BLOCK:3 * CDF_BLOCK] = 2**-9
    cdf = probs.cumsum(-1, dtype=torch.float64)
    r = torch.rand(B, dtype=torch.float64)
    r[0], r[1], r[2] = 0.0, 1 - 2**-52, 0.5  # row 2: u at a block's end -> the next drawable
    expected = torch.searchsorted(cdf, (r * cdf[:, -1])[:, None], right=True).squeeze(1)
    tokens = inverse_cdf(probs, r)
    assert tokens.tolist() == expected.tolist() and tokens[2] == 2 * CDF_BLOCK
    assert (probs.gather(1, tokens[:, None]) > 0).all()
    # u at the row's total, or past it by a rounding: the last token that can be drawn, never one
    # of probability 0, never past the vocabulary
    last = [V - 41] * 2 + [3 * CDF_BLOCK - 1] + [V - 41] * 29 + [V - 1] * 32
    for end in (1.0, 1 + 2**-40):
        assert inverse_cdf(probs, torch.full((B,), end, dtype=torch.float64)).tolist() == last
    # a row with nothing to draw
    with pytest.raises(ValueError, match=r"NaN or \+inf, or are all -inf"):
        inverse_cdf(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="top_p 0 must be in"):  # (it would keep no token)
        sample_next(torch.zeros(2, 3), Sampling(temperature=1.0, top_p=0))
    for bad in ([0.0, float("nan")], [float("-inf"), float("-inf")], [0.0, float("inf")]):
        # one clear line
        with pytest.raises(ValueError, match=r"NaN or \+inf, or are all -inf"):
            sample_next(torch.tensor([[1.0, 2.0], bad]), Sampling(temperature=1.0))
        # greedy too: NaN's argmax is a NaN's index, which scored an evaluation 0 silently (issue
        # 67's Gemma 2)
        with pytest.raises(ValueError, match=r"NaN or \+inf, or are all -inf"):
            sample_next(torch.tensor([[1.0, 2.0], bad]), Sampling(temperature=0.0))


def test_sample_next_top_p_keeps_the_smallest_nucleus():
    """top_p = 0.75 over probabilities (0.5, 0.3, 0.15, 0.05): the two likeliest hold 0.8 >= 0.75,
    so only they are drawn, renormalised to (0.625, 0.375); greedy is the argmax."""
    torch.manual_seed(0)
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    rows = 100_000
    tokens = sample_next(logits.expand(rows, -1), Sampling(temperature=1.0, top_p=0.75))
    freq = torch.bincount(tokens, minlength=4).float() / rows
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=6e-3, rtol=0)
    tokens = sample_next(logits.expand(rows, -1), Sampling(temperature=1.0, top_p=0.85))
    assert torch.bincount(tokens, minlength=4)[0] > 0  # 0.85 needs the third token too
    assert sample_next(logits[None], Sampling(temperature=0.0)).tolist() == [1]
    # greedy takes the first of tied largest logits, as argmax does, in each dtype (the engine's
    # greedy tokens must not depend on how the maximum is found)
    ties = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -2.0, -1.0, -3.0]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert sample_next(ties.to(dtype), Sampling(temperature=0.0)).tolist() == [1, 0, 0]


def test_group_batches_keep_groups_whole_and_split_only_large_ones():
    assert list(group_batches([[1], [2], [3]], 2, 4)) == [([[1], [2]], 2), ([[3]], 2)]
    assert list(group_batches([[1], [2]], 5, 4)) == [([[1]], 4), ([[1]], 1), ([[2]], 4),
                                                     ([[2]], 1)]


def test_prompts_of_different_lengths_decode_as_if_alone(tiny_model):
    """Left padding, position ids, the prompt's cache copied to its samples, and samples that stop
    leaving the batch: each prompt's greedy completion in a mixed batch is the one the model gives
    it alone -- also for the samples that keep going after others have stopped."""
    import copy
    model, tok = tiny_model
    model = copy.deepcopy(model)
    with torch.no_grad():  # sharp attention, so that a token's position changes the argmax
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    prompts = [tok("What is 1 + 1? Think")["input_ids"], tok("Hi")["input_ids"], [7, 8, 9, 10]]
    paths = [_greedy_path(model, p, 8) for p in prompts]
    engine = HFRollout(model, tok, dtype=torch.float32)
    # The first prompt's second token becomes a stop token: its samples leave the batch after two
    # steps, while the other two prompts (which never produce it) decode on to the limit.
    stop = paths[0][1]
    assert stop not in paths[0][:1] + paths[1] + paths[2]
    engine.stop_ids = {stop}
    out = engine.generate(prompts, 2, Sampling(max_new_tokens=8, temperature=0.0))
    expected = [paths[0][:2], paths[1], paths[2]]
    assert out.completion_ids == [e for e in expected for _ in range(2)]
    assert out.truncated == [False, False, True, True, True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_logprobs_are_those_of_the_logits_it_sampled_from(dtype, tiny_model, monkeypatch):
    """The HF engine's log-prob of a token is log softmax(logits / T)[token] of the very logits
    the decoding loop drew it from -- not a second, batched forward, which in bf16 differs by
    ~0.03 nats a token (and with --async-steps 1 these numbers are pi_old). In both dtypes."""
    import rollout as rollout_module
    model, tok = tiny_model
    engine = HFRollout(model, tok, dtype=dtype, logprobs=True)
    drawn = []  # (logits, tokens) of every decoding step, rows in batch order

    def recording(logits, sampling, logprobs):
        out = draw(logits, sampling, logprobs)
        drawn.append((logits.clone(), out.tokens))
        return out

    monkeypatch.setattr(rollout_module, "draw", recording)
    engine.stop_ids = {-1}  # no stops: every row stays in the batch, in order
    prompts = [tok("What is 1 + 1?")["input_ids"], tok("Hi")["input_ids"]]
    out = engine.generate(prompts, 2, Sampling(max_new_tokens=5, temperature=0.7, seed=0))
    for t, (logits, tokens) in enumerate(drawn):
        expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
        for row in range(len(out)):
            assert out.completion_ids[row][t] == tokens[row]
            assert out.engine_logprobs[row][t] == float(expected[row])  # the same numbers


def test_vllm_discards_its_weights_for_a_training_step_and_the_sync_refills_them():
    """On a GPU the engine sleeps while the trainer trains. A weight sync always follows, so its
    weights are discarded (sleep level 2), not copied to host memory and back (level 1) only to be
    overwritten; generating on discarded weights that no sync has refilled is an error."""
    from rollout import VLLMRollout
    calls = []

    class FakeLLM:  # records what the engine asks of vLLM
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags):
            calls.append(("wake_up", *tags))

        def collective_rpc(self, method, args=()):
            calls.append((method,))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

    engine = object.__new__(VLLMRollout)  # (no vLLM needed for the bookkeeping)
    engine.llm, engine.on_gpu, engine.dtype, engine.version = FakeLLM(), True, torch.bfloat16, 0
    engine.awake, engine.discarded = {"weights", "kv_cache"}, False
    engine.sleep()
    assert calls == [("sleep", 2)]
    with pytest.raises(RuntimeError, match="discarded"):
        engine._wake({"weights", "kv_cache"})  # what generate does first
    engine.update_weights({"w": torch.ones(2)}, version=1)
    assert calls[1:] == [("wake_up", "weights"), ("load_trainer_weights",)]
    engine._wake({"weights", "kv_cache"})
    assert calls[-1] == ("wake_up", "kv_cache") and engine.version == 1


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_ray_engine_is_built_from_what_the_trainers_start_from_and_samples_as_the_local_one(
        dtype, tiny_model_dir, tmp_path):
    """trainer.make_engine (what each Ray engine worker runs) loaded --model where the trainers
    load --init-from (an SFT'd model with a chat template of its own was served by the base's),
    and never verified prompt sharing, so it decoded every prompt whole where the one-process
    engine shares their common prefix: other numerics, which in bf16 drew other tokens on an AMX
    Xeon (issue 40). Now both engines are built alike: the same tokens and, bit for bit, the same
    log-probs, in fp32 and bf16."""
    import shutil

    import grpo
    import trainer
    from cli import parse_config
    from data import arith_heldout, encode_prompts
    from transformers import AutoTokenizer
    start = tmp_path / "sft"
    shutil.copytree(tiny_model_dir, start)
    tokenizer = AutoTokenizer.from_pretrained(start)
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    tokenizer.save_pretrained(start)
    cfg = parse_config(grpo.Config, ["--model", tiny_model_dir, "--init-from", str(start),
                                     "--dtype", dtype, "--async-steps", "1", "--max-new-tokens",
                                     "8", "--out", str(tmp_path / "out")])
    local, remote = trainer.setup_local(cfg, train_step=None).rollout, trainer.make_engine(cfg)
    assert remote.tokenizer.chat_template == tokenizer.chat_template
    assert remote.share_prefix == local.share_prefix
    prompts = encode_prompts(tokenizer, arith_heldout(3), "answer-is", chat=True)
    sampling = Sampling(8, temperature=1.0, seed=5)
    a, b = local.generate(prompts, 4, sampling), remote.generate(prompts, 4, sampling)
    assert a.completion_ids == b.completion_ids and a.engine_logprobs == b.engine_logprobs


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_one_process_hf_engine_samples_from_the_trainers_own_tensors(dtype, tiny_model_dir,
                                                                          tmp_path, monkeypatch):
    """setup_local's HF engine holds no weights of its own: it decodes with the very tensors the
    trainer computes with (the bf16 copy, or the fp32 weights), so the optimizer step's new
    weights reach it with nothing copied, and it samples what an engine holding a copy of those
    weights samples, bit for bit."""
    import grpo
    import trainer as trainer_module
    from conftest import make_batch
    from cli import parse_config
    from model import full_weights
    cfg = parse_config(grpo.Config, ["--model", tiny_model_dir, "--dtype", dtype, "--lr", "1e-2",
                                     "--max-new-tokens", "8", "--out", str(tmp_path / "out")])
    made = []
    setup = type(cfg).setup
    monkeypatch.setattr(type(cfg), "setup",
                        lambda self, *a: made.append(setup(self, *a)) or made[0])
    run = trainer_module.setup_local(cfg, grpo.train_on_rollout)
    trainer, engine = made[0], run.rollout
    engine_tensors = {p.data_ptr() for p in engine.model.parameters()}
    assert engine_tensors == {p.data_ptr() for p in trainer.compute.parameters()}
    before = [p.detach().clone() for p in engine.model.parameters()]
    run.train(make_batch([[5, 6, 7, 8]] * 2, [[9, 10, 11], [12, 13, 14]], [1.0, -1.0]))
    assert run.sync_weights(1) >= 0 and engine.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
    copy = HFRollout(trainer.model, trainer.tokenizer, dtype=engine.model.dtype)  # its own copy
    copy.update_weights(full_weights(trainer.model))
    prompts, sampling = [[5, 6, 7, 8], [9, 10, 11, 12, 13]], Sampling(8, temperature=1.0, seed=3)
    a, b = engine.generate(prompts, 3, sampling), copy.generate(prompts, 3, sampling)
    assert a.completion_ids == b.completion_ids


def _tiny_gemma2(window: int, seed: int = 0):
    """A 2-layer Gemma 2 built from a config (random weights): soft-capped attention scores (cap
    50, as Gemma 2's), a layer with a sliding window of `window` tokens and a global one. Its q
    and k projections are scaled up so that scores are a few units and attention is sharp: a
    token's place changes the argmax."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from attention import use_smolrl_attention
    from logprobs import check_head_logits
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=window,
        query_pre_attn_scalar=32, eos_token_id=2, bos_token_id=1, pad_token_id=0)).eval()
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            torch.nn.init.normal_(proj.weight, std=0.5)
    assert use_smolrl_attention(model)  # (as load_model does: attention.softcapped_attention)
    check_head_logits(model)  # (as the trainer does: the engine shares a common prefix)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared, window", [(4, 6), (9, 6), (9, 64)])
def test_soft_capped_prompts_of_different_lengths_decode_as_if_alone(dtype, shared, window,
                                                                     monkeypatch):
    """Issue 67: Gemma 2's soft-capped attention masked with -inf, so a left-padding query of a
    batch, which attends to nothing, turned NaN -- and the NaN reached every real token through
    the next layer's values: greedy evaluation scored 0 silently, sampling raised. Prompts of
    different lengths sharing `shared` first tokens (Gemma's chat template: 4; 9 runs once and
    its cache is copied, the padding then between it and each prompt's rest -- which a sliding
    window counts as tokens: shared only where the whole row fits in the window), in a batch:
    each one's tokens and log-probs are those it gets decoded alone, in fp32 and bf16."""
    import sampling as sampling_module
    from types import SimpleNamespace
    model = _tiny_gemma2(window)
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2,
                          batch_decode=lambda ids, skip_special_tokens: [""] * len(ids))
    engine = HFRollout(model, tok, dtype=dtype, logprobs=True)
    engine.stop_ids = {-1}  # no stops: every sample decodes to the limit
    # The argmax drawn, so that a batch and a lone prompt draw alike; log-probs still at T = 1
    monkeypatch.setattr(sampling_module, "inverse_cdf", lambda probs, r: probs.argmax(-1))
    head = list(range(10, 10 + shared))
    prompts = [head + [40, 41, 42, 43, 44, 45, 46], head + [50], head + [60, 61, 62]]
    sampling = Sampling(max_new_tokens=6, temperature=1.0)
    together = engine.generate(prompts, 2, sampling)
    assert (together.cached_tokens > 0) == (shared >= 8 and window == 64)
    atol = 1e-5 if dtype == torch.float32 else 0.1
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], 1, sampling)
        for k in (2 * i, 2 * i + 1):
            assert together.completion_ids[k] == alone.completion_ids[0], (i, k)
            got, want = torch.tensor(together.engine_logprobs[k]), \
                torch.tensor(alone.engine_logprobs[0])
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=0, atol=atol)


class _SizedEngine:
    """Stands in for rollout.VLLMRollout: records the max_model_len it was started with."""
    made = []

    def __init__(self, model_path, tokenizer, stop_ids, *, max_model_len, **kwargs):
        self.max_model_len = max_model_len
        _SizedEngine.made.append(self)

    def update_weights(self, weights, version=0):
        return 0.0


@pytest.mark.parametrize("flags, room", [
    (["--max-prompt-tokens", "8192", "--max-new-tokens", "1024"], 8192 + 1024),  # issue 67's
    (["--max-prompt-tokens", "100", "--max-new-tokens", "16"], 116),
    (["--max-prompt-tokens", "100", "--max-new-tokens", "16", "--tools", "calculator",
      "--max-episode-tokens", "300"], 400),  # an episode's late turn: every turn before it
    (["--max-prompt-tokens", "30000", "--max-new-tokens", "4096"], 32768),  # the positions
])
def test_the_vllm_engine_holds_max_prompt_tokens_and_what_follows(flags, room, tiny_model_dir,
                                                                   tmp_path, monkeypatch, capsys):
    """The engine's max_model_len is --max-prompt-tokens plus the most tokens after a prompt
    (--max-new-tokens; an episode's --max-episode-tokens), within the model's positions (here
    32,768). It was max-new-tokens + 2,048 whatever --max-prompt-tokens said: a run with prompts
    of 8,192 tokens stopped at step 1, and prompts of 2,048-3,071 tokens beside 1,024 new ones had
    their completions cut short by the engine, silently."""
    pytest.importorskip("vllm")
    import grpo
    import rollout
    import trainer
    from cli import parse_config
    from model import load_model
    monkeypatch.setattr(rollout, "VLLMRollout", _SizedEngine)
    cfg = parse_config(grpo.Config, ["--model", tiny_model_dir, "--rollout", "vllm", "--out",
                                     str(tmp_path / "out"), *flags])
    model, tokenizer = load_model(tiny_model_dir)
    model.config.max_position_embeddings = 32768
    engine = trainer.engine_beside(
        type("T", (), {"model": model, "compute": model, "tokenizer": tokenizer,
                       "device": "cpu"})(), cfg, shared=False)
    assert engine.max_model_len == room
    capped = "the model's 32,768 positions" in capsys.readouterr().out
    assert capped == (room == 32768)  # (said at start: long prompts get less room)


def test_a_prompt_longer_than_the_vllm_engine_holds_stops_before_any_model_loads(
        tiny_model_dir, tmp_path, monkeypatch):
    """The vLLM engine is sized from --max-prompt-tokens on a CPU too: a longer prompt in the data
    stops the run in one line, measured by the tokenizer before any model loads (the memory
    plan's check, which only a GPU run made)."""
    import json

    import grpo
    import rl
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"problem": "1 + " * 100 + "1", "answer": "101"}) + "\n" +
                    json.dumps({"problem": "1 + 1", "answer": "2"}) + "\n")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(rl, "setup_local", no_model)
    cfg = grpo.Config(model=tiny_model_dir, data=str(data), rollout="vllm", dtype="fp32",
                      max_prompt_tokens=64, eval_every=0, out=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match=r"training problem 1 is a prompt of \d{3} tokens \(chat "
                                         r"template included\), longer than the 64 the vLLM "
                                         r"engine makes room for; pass --max-prompt-tokens"):
        grpo.main(cfg)


def test_an_episodes_first_prompt_is_measured_with_the_tools_it_shows(tiny_model_dir, tmp_path,
                                                                      monkeypatch):
    """--tools: the first turn's prompt holds the tools' descriptions (here 3x the problem's
    prompt): it is that prompt the vLLM engine and the memory plan hold, and the check measures.
    Measured without them, a prompt of 200 tokens passed --max-prompt-tokens 100 and the run
    stopped mid-episode, at a late turn, when the prompt and its turns outgrew the engine."""
    import json

    import grpo
    import rl
    data = tmp_path / "short.jsonl"
    data.write_text(json.dumps({"problem": "1 + 1", "answer": "2"}) + "\n")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(rl, "setup_local", no_model)
    cfg = grpo.Config(model=tiny_model_dir, data=str(data), rollout="vllm", dtype="fp32",
                      tools="calculator", max_new_tokens=64, max_prompt_tokens=100, eval_every=0,
                      out=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match=r"training problem 1 is a prompt of \d{3} tokens \(chat "
                                         r"template and tools included\), longer than the 100"):
        grpo.main(cfg)


def test_an_engine_the_models_positions_cut_says_what_a_prompt_gets(tiny_model_dir, monkeypatch,
                                                                     capsys):
    """The tiny model has 512 positions. Asked for 1,024 new tokens, every sample gets fewer (the
    line said "a prompt longer than -512 tokens"); asked for prompts of 600 tokens, one of 550
    passes the data's check and the engine cannot hold it: the model's positions are the limit,
    and the run's line says to shorten the prompts (it said to raise --max-prompt-tokens, which
    changes nothing)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    import rollout
    from model import load_model
    real = rollout.VLLMRollout
    monkeypatch.setattr(rollout, "VLLMRollout", _SizedEngine)
    model, tokenizer = load_model(tiny_model_dir)
    assert model.config.max_position_embeddings == 512
    rollout.make_rollout("vllm", model, tokenizer, max_prompt_tokens=100, max_new_tokens=1024)
    said = capsys.readouterr().out
    assert "-512" not in said and "every prompt leaves less than the 1,024 tokens" in said
    rollout.make_rollout("vllm", model, tokenizer, max_prompt_tokens=600, max_new_tokens=64)
    assert "a prompt of 512 tokens or more cannot be held" in capsys.readouterr().out
    engine = SimpleNamespace(max_model_len=512, max_prompt_tokens=600)
    with pytest.raises(SystemExit, match=r"a prompt of 550 tokens does not fit the vLLM engine's "
                                         r"max_model_len of 512, the model's positions: shorten"):
        real.generate(engine, [[5] * 550], 1, Sampling(8))



def decode_as(monkeypatch, flash: bool, grows: bool = True):
    """Every engine made after this call decodes by flash in bf16 (times that favour it) or by the
    matmuls on a cache that grows or not, whatever this machine would time."""
    import attention
    from attention import DecodeTimes
    monkeypatch.delenv("SMOLRL_DECODE", raising=False)
    times = DecodeTimes(1.0, 10.0, 20.0) if flash else \
        DecodeTimes(90.0, 100.0, 110.0) if grows else DecodeTimes(90.0, 110.0, 100.0)
    monkeypatch.setattr(attention, "decode_times", lambda *a: times)


@pytest.mark.parametrize("dtype, flash", [(torch.float32, False), (torch.bfloat16, False),
                                         (torch.bfloat16, True)])
def test_the_growing_cache_decodes_bit_for_bit_what_concatenation_does(dtype, flash, tiny_model,
                                                                      monkeypatch):
    """Keys and values written into room kept for them (GrowingLayer) give the samples and the
    log-probs of a cache concatenated every step -- in fp32 what the engine sampled before the
    cache grew (decode_attention either way), in bf16 by the matmuls and by flash: with samples
    leaving the batch (its rows reordered), with a room too small (the buffer grown mid-decode), and for
    a prompt that continues a kept sample (an episode's next turn)."""
    import attention
    import rollout as rollout_module
    decode_as(monkeypatch, flash)
    flashed, real = [], attention.flash_decode_attention  # (layers that ran SDPA's flash kernel)
    monkeypatch.setattr(attention, "flash_decode_attention",
                        lambda *a: flashed.append(1) or real(*a))
    model, tok = tiny_model
    prompts = [tok("What is 1 + 1?")["input_ids"], tok("Hi there")["input_ids"], [7, 8, 9]]
    sampling = Sampling(max_new_tokens=12, temperature=1.0, seed=3, keep_cache=True)

    def decode(grow):
        monkeypatch.setattr(rollout_module, "room_to_grow", grow)
        engine = HFRollout(model, tok, dtype=dtype, logprobs=True)
        assert engine.decoding.grows and engine.decoding.flash == flash
        engine.stop_ids = set(range(0, len(tok), 11))  # some samples stop early
        engine.share_prefix = True  # (as check_head_logits finds for a Llama: kept rows continue)
        first = engine.generate(prompts, 4, sampling)
        turn = [p + c + [5, 6] for p, c in zip(first.prompt_ids, first.completion_ids)]
        second = engine.generate(turn[::4], 1, sampling)  # (continues kept samples)
        assert second.cached_tokens > 0
        return [(o.completion_ids, o.engine_logprobs, o.truncated) for o in (first, second)]

    grow = rollout_module.room_to_grow
    expected = decode(lambda cache, rows, new_tokens: cache.reorder_cache(rows) or cache)
    assert any(expected[0][2]) and not all(expected[0][2])  # some stopped, some ran on
    assert decode(grow) == expected
    monkeypatch.setattr(rollout_module, "ROOM", 1)  # (a room too small: grown as it decodes)
    assert decode(grow) == expected
    assert bool(flashed) == flash


def test_a_growing_layer_holds_what_a_dynamic_layer_holds():
    """Update, reorder, crop, reset and free: GrowingLayer's keys and values are DynamicLayer's --
    written in place while there is room, the room doubled when it runs out, a reorder copying
    only the filled columns."""
    from transformers.cache_utils import DynamicLayer
    from rollout import GrowingLayer
    k, v = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    plain, growing = DynamicLayer(), GrowingLayer(k, v, room=2)
    plain.update(k, v)
    buffers = []
    for step in range(4):  # (past its room: grown)
        new = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
        assert all(torch.equal(a, b) for a, b in zip(plain.update(*new), growing.update(*new)))
        buffers.append((growing.keys.data_ptr(), growing._held["keys"][0].shape[2]))
    assert buffers == [buffers[0]] * 2 + [buffers[2]] * 2 and buffers[0][1] == 7
    assert buffers[2][1] == 14  # (7 filled: 7 more)
    assert growing.get_seq_length() == plain.get_seq_length() == 9
    rows = torch.tensor([2, 0])
    plain.reorder_cache(rows), growing.reorder_cache(rows)
    assert growing._held["keys"][0].shape[2] == 14  # (its room kept)
    assert torch.equal(plain.keys, growing.keys) and torch.equal(plain.values, growing.values)
    plain.crop(-3), growing.crop(-3)
    new = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    assert all(torch.equal(a, b) for a, b in zip(plain.update(*new), growing.update(*new)))
    growing.keys = growing.values = None  # (how _keep frees a layer)
    assert growing._held == {"keys": None, "values": None}
    plain.reset(), growing.reset()
    plain.reorder_cache(rows), growing.reorder_cache(rows)  # (nothing held: nothing to keep)
    new = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    assert all(torch.equal(a, b) for a, b in zip(plain.update(*new), growing.update(*new)))


def test_a_growing_cache_starts_with_little_room_and_never_outgrows_its_samples():
    """room_to_grow: ROOM columns to spare (or the fewer tokens its samples may add), doubled as
    they run out, but never past the prompt's columns plus max_new_tokens -- a buffer of every
    row's max_new_tokens from the start cost 2.9x the concatenated cache's memory where samples
    stopped early, and doubling without that bound ~2x where prompts are long."""
    from transformers.cache_utils import DynamicCache
    from rollout import GrowingLayer, ROOM, room_to_grow

    def capacities(prompt: int, new_tokens: int, fed: int) -> list[int]:
        cache = DynamicCache(ddp_cache_data=[(torch.randn(2, 1, prompt, 4),) * 2])
        layer = room_to_grow(cache, torch.tensor([0, 0, 1]), new_tokens).layers[0]
        assert isinstance(layer, GrowingLayer) and layer.keys.shape == (3, 1, prompt, 4)
        seen = [layer._held["keys"][0].shape[2]]
        for _ in range(fed):
            layer.update(torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 4))
            seen += [layer._held["keys"][0].shape[2]] if layer._held["keys"][0].shape[2] \
                != seen[-1] else []
        return seen

    assert ROOM == 64
    assert capacities(5, 10, 9) == [15]  # (fewer new tokens than ROOM: room for them)
    assert capacities(5, 200, 199) == [69, 138, 205]  # (doubled, then stopped at 5 + 200)
    assert capacities(2000, 128, 127) == [2064, 2128]  # (not 4,128: a long prompt's room)


def test_decode_times_runs_on_one_thread_and_gives_the_threads_back(monkeypatch):
    """The timing behind choose_decode runs on one thread (on all threads beside a busy core the
    choice swung), and the thread count comes back after it, after a failure too."""
    import attention
    inside = []
    real = attention.flash_decode_attention
    monkeypatch.setattr(attention, "flash_decode_attention",
                        lambda *a: inside.append(torch.get_num_threads()) or real(*a))
    monkeypatch.setattr(attention, "DECODE_PROBE", (2, 8))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        times = attention.decode_times.__wrapped__(2, 1, 8, torch.bfloat16)  # (uncached)
        assert set(inside) == {1} and torch.get_num_threads() == 2
        assert all(t > 0 for t in times)
        monkeypatch.setattr(attention, "flash_decode_attention", lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            attention.decode_times.__wrapped__(2, 1, 8, torch.bfloat16)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_flash_decoding_samples_as_near_the_trainer_as_the_matmuls(tiny_model, monkeypatch):
    """In bf16 flash decoding sums in another order than decode_attention: the engine's log-probs
    of what it sampled stay as near the trainer's (the mismatch the run logs) as the matmuls'."""
    from logprobs import completion_logprobs, length_mask, pack
    from model import empty_copy, full_weights
    model, tok = tiny_model
    trainer = empty_copy(model, torch.bfloat16)
    trainer.load_state_dict(dict(full_weights(model)))
    prompts = [tok("What is 1 + 1?")["input_ids"], tok("Hi there")["input_ids"]]
    worst = {}
    for flash in (False, True):
        decode_as(monkeypatch, flash, grows=False)
        engine = HFRollout(model, tok, dtype=torch.bfloat16, logprobs=True)
        assert engine.decoding.flash == engine.decoding.grows == flash
        engine.stop_ids = {-1}
        out = engine.generate(prompts, 4, Sampling(max_new_tokens=24, temperature=1.0, seed=0))
        ids, plens, clens = pack(out.prompt_ids, out.completion_ids, pad_id=tok.pad_token_id)
        with torch.no_grad():
            lp, _ = completion_logprobs(trainer, ids, plens, clens, temperature=1.0)
        engine_lp = torch.tensor(out.engine_logprobs)
        mask = length_mask(clens, lp.shape[1])
        worst[flash] = float(((lp.float() - engine_lp) * mask).abs().max())
    assert worst[True] <= max(2 * worst[False], 0.05), worst


def test_the_engine_decodes_by_flash_only_where_it_was_timed_faster(monkeypatch, tiny_model):
    """choose_decode: soft-capped scores and a (pretended) GPU decode as before, untimed; the
    cache grows where the matmuls on its view timed no slower than on a concatenated one; flash
    only in bf16, at no more than FLASH_MARGIN of the matmuls' best time, timed at the model's
    own head shape; SMOLRL_DECODE sets the choice. attention() runs flash where a decoding step's
    forward asks for it, never for soft-capped scores; a model that keeps its own attention
    decodes as before."""
    import copy
    import attention
    from transformers import LlamaConfig
    from attention import DecodeTimes, choose_decode, decode_attention, flash_decode_attention
    monkeypatch.delenv("SMOLRL_DECODE", raising=False)
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=48)  # (Qwen3's heads are not hidden / heads wide either)
    times, timed = [], []
    monkeypatch.setattr(attention, "decode_times",
                        lambda *a: timed.append(a) or times.pop())
    assert choose_decode(config, torch.bfloat16, "cuda")[:2] == (False, False)
    capped = copy.deepcopy(config)
    capped.attn_logit_softcapping = 50.0
    assert choose_decode(capped, torch.bfloat16, "cpu")[:2] == (False, False)
    assert not timed
    times += [DecodeTimes(1.0, 100.0, 99.0), DecodeTimes(1.0, 99.0, 100.0)]
    assert choose_decode(config, torch.float32, "cpu")[:2] == (False, True)  # (never flash)
    assert choose_decode(config, torch.float32, "cpu")[:2] == (False, False)
    assert timed[0] == (4, 2, 48, torch.float32)
    times.append(DecodeTimes(80.0, 120.0, 100.0))  # (at the margin: flash)
    chosen = choose_decode(config, torch.bfloat16, "cpu")
    assert chosen[:2] == (True, True)
    assert "flash 80 us, matmuls on a growing cache 120 us, on a concatenated one 100 us" \
        in chosen.line
    times.append(DecodeTimes(81.0, 120.0, 100.0))  # (past the margin: the matmuls again)
    assert choose_decode(config, torch.bfloat16, "cpu")[:2] == (False, False)
    for forced, expected in [("flash", (True, True)), ("grow", (False, True)),
                             ("concat", (False, False))]:
        monkeypatch.setenv("SMOLRL_DECODE", forced)
        chosen = choose_decode(config, torch.bfloat16, "cpu")
        assert chosen[:2] == expected and f"SMOLRL_DECODE={forced}" in chosen.line
    assert choose_decode(config, torch.float32, "cpu")[:2] == (False, False)  # (concat)
    monkeypatch.setenv("SMOLRL_DECODE", "flash")
    assert choose_decode(config, torch.float32, "cpu")[:2] == (False, True)
    monkeypatch.setenv("SMOLRL_DECODE", "grow")
    assert "SMOLRL_DECODE=grow ignored" in choose_decode(capped, torch.bfloat16, "cpu").line
    monkeypatch.setenv("SMOLRL_DECODE", "fast")
    with pytest.raises(SystemExit, match="SMOLRL_DECODE=fast: choose flash, grow or concat"):
        choose_decode(config, torch.bfloat16, "cpu")
    import grpo
    with pytest.raises(SystemExit, match="SMOLRL_DECODE=fast"):  # (before any model loads)
        grpo.Config(data="arith", out="/nonexistent/never-written")
    monkeypatch.delenv("SMOLRL_DECODE")
    assert len(timed) == 4

    q = torch.randn(3, 4, 1, 32, dtype=torch.bfloat16)
    keys, values = torch.randn(2, 3, 2, 20, 32, dtype=torch.bfloat16)
    k, v = keys[:, :, :15], values[:, :, :15]  # (a growing cache's view)
    mask = torch.ones(3, 1, 1, 15, dtype=torch.bool)
    mask[0, :, :, :6] = False  # (a left-padded row)
    module = torch.nn.Module()
    ran = []
    monkeypatch.setattr(attention, "flash_decode_attention",
                        lambda *a: ran.append("flash") or flash_decode_attention(*a))
    monkeypatch.setattr(attention, "decode_attention",
                        lambda *a: ran.append("matmuls") or decode_attention(*a))
    flash, _ = attention.attention(module, q, k, v, mask, scaling=0.2, flash_decode=True)
    attention.attention(module, q, k, v, mask, scaling=0.2, softcap=50.0, flash_decode=True)
    attention.attention(module, q, k, v, mask, scaling=0.2)
    assert ran == ["flash", "matmuls", "matmuls"]
    expected = decode_attention(q, k.contiguous(), v.contiguous(), mask, 0.2)
    assert flash.shape == expected.shape == (3, 1, 4, 32)
    assert (flash.float() - expected.float()).abs().max() < 0.02  # (bf16: sums in another order)
    masked = flash_decode_attention(q[:1], k[:1, :, 6:], v[:1, :, 6:], None, 0.2)
    assert torch.allclose(flash[:1].float(), masked.float(), atol=0.02)  # the padding unread

    model, tok = tiny_model
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    engine = HFRollout(eager, tok, dtype=torch.bfloat16)
    assert engine.decoding[:2] == (False, False) and "the model's own attention" in \
        engine.decoding.line

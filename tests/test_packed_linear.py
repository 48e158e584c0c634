"""The HF engine's weights packed for oneDNN: only where the numbers stay F.linear's, only for the
call, and the samples the very ones the plain layers draw."""

import pytest
import torch

import packed_linear
from packed_linear import can_pack, packed_linears
from rollout import HFRollout
from sampling import Sampling

# oneDNN's bf16 packed linear needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT: on an AVX2-only CPU
# can_pack says no and the engine does not pack, so the tests of packing itself have nothing to
# test there (the engine's own tests run unpacked).
BF16_PACKS = can_pack(torch.nn.Linear(128, 256).to(torch.bfloat16), "cpu", torch.bfloat16)
needs_bf16_packing = pytest.mark.skipif(not BF16_PACKS, reason="no oneDNN bf16 packed linear on "
                                        "this CPU (AVX2 only): nothing is packed here")


def linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=needs_bf16_packing)])
def test_packed_layers_compute_for_the_call_only_and_are_restored_after_an_error(dtype,
                                                                                 tiny_model):
    """Taken on every CPU, whatever it measures: within the context each Linear computes with a
    packed weight -- the numbers F.linear gives where packs_exactly says so, close to them
    otherwise --, and after it (an exception included) the modules are as they were."""
    import copy
    model = copy.deepcopy(tiny_model[0]).to(dtype)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.no_grad():
        plain = model(ids).logits
        with packed_linears(model, rows=1, dtype=dtype):
            assert all("forward" in vars(m) for m in linears(model))
            packed = model(ids).logits
        if can_pack(model, "cpu", dtype):
            assert torch.equal(packed, plain)
        else:
            torch.testing.assert_close(packed, plain, rtol=0.05, atol=0.05)
        with pytest.raises(ZeroDivisionError), packed_linears(model, rows=1, dtype=dtype):
            1 / 0
    assert not any("forward" in vars(m) for m in linears(model))
    model(ids).logits.sum().backward()  # autograd works again: the plain forwards are back


def test_a_dtype_or_shape_whose_packed_product_differs_is_not_packed(tiny_model, monkeypatch):
    """The engine packs only when every weight shape of its model gave F.linear's numbers bit for
    bit here: one shape that did not, and it decodes with the plain layers."""
    model, tok = tiny_model
    monkeypatch.setattr(packed_linear, "MEASURED", {})
    shapes = {tuple(m.weight.shape) for m in linears(model)}
    assert len(shapes) > 1
    odd = sorted(shapes)[0]
    monkeypatch.setattr(packed_linear, "_same_numbers", lambda w: tuple(w.shape) != odd)
    engine = HFRollout(model, tok, dtype=torch.bfloat16)
    assert not engine.packs
    import rollout as rollout_module
    packs = []
    monkeypatch.setattr(rollout_module, "packed_linears", lambda *a: packs.append(a))
    engine.generate([[5, 9, 13]], 2, Sampling(3, temperature=1.0, seed=0))
    assert packs == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_samples_with_packed_weights_what_it_samples_without(dtype, tiny_model,
                                                                      monkeypatch):
    """Where the engine packs (bf16 on a CPU whose oneDNN computes it natively or not: measured),
    the tokens and their log-probs are bit for bit those of the plain layers -- prompts of several
    lengths, samples leaving the batch; where it does not (fp32: MKL's sums), nothing changes."""
    import rollout as rollout_module
    model, tok = tiny_model
    engine = HFRollout(model, tok, dtype=dtype, logprobs=True)
    assert engine.packs == can_pack(engine.model, "cpu", dtype)
    prompts = [tok("What is 1 + 1?")["input_ids"], tok("Hi")["input_ids"], [7, 8, 9, 10, 11]]
    sampling = Sampling(max_new_tokens=16, temperature=1.0, seed=3)
    engine.stop_ids = {-1}
    drawn = engine.generate(prompts, 4, sampling).completion_ids
    engine.stop_ids = {drawn[0][3], drawn[5][9]}  # tokens drawn on the way: samples leave there
    calls = []
    real = rollout_module.packed_linears
    monkeypatch.setattr(rollout_module, "packed_linears",
                        lambda *a: calls.append(a[1:]) or real(*a))
    packed = engine.generate(prompts, 4, sampling)
    assert calls == ([(12, dtype)] if engine.packs else [])
    engine.packs = False
    plain = engine.generate(prompts, 4, sampling)
    assert packed.completion_ids == plain.completion_ids
    assert packed.engine_logprobs == plain.engine_logprobs
    assert len({len(c) for c in plain.completion_ids}) > 1


@needs_bf16_packing
def test_a_biased_layer_fed_a_strided_input_keeps_f_linears_rounding():
    """F.linear adds a bias inside the matmul only for a 2-D or a contiguous input; a strided 3-D
    one -- Phi's biased LM head reads h[:, -1:] -- it multiplies, then adds the bias in bf16. The
    packed forward does the same, so the numbers stay F.linear's for every input the probe and a
    model give it (a fused bias there differed by a bf16 step: 34 of 144 log-probs of a Phi)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 256).to(torch.bfloat16)
    torch.nn.init.normal_(layer.bias)  # (transformers' init leaves biases 0: the rounding hides)
    model = torch.nn.Sequential(layer)
    x = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16)  # noqa: E731
    inputs = {"2-D": x(9, 128), "3-D": x(3, 5, 128), "3-D strided": x(3, 7, 128)[:, -1:],
              "4-D strided": x(2, 3, 7, 128)[:, :, 2:]}
    assert not inputs["3-D strided"].is_contiguous()
    with torch.no_grad():
        plain = {k: layer(v) for k, v in inputs.items()}
        with packed_linears(model, rows=9, dtype=torch.bfloat16):
            packed = {k: layer(v) for k, v in inputs.items()}
    if can_pack(model, "cpu", torch.bfloat16):
        assert all(torch.equal(packed[k], plain[k]) for k in inputs), \
            [k for k in inputs if not torch.equal(packed[k], plain[k])]


@needs_bf16_packing
def test_a_layer_with_a_forward_of_its_own_is_left_alone(tiny_model):
    """A Linear whose instance already has a forward (a hook library's wrapper) is not packed: its
    own forward runs within the call and is still there after it."""
    import copy
    model = copy.deepcopy(tiny_model[0]).to(torch.bfloat16)
    layer = linears(model)[0]
    calls = []
    layer.forward = lambda x: calls.append(1) or torch.nn.functional.linear(x, layer.weight)
    with torch.no_grad(), packed_linears(model, rows=1, dtype=torch.bfloat16):
        model(torch.tensor([[5, 9, 13]]))
    assert calls and "forward" in vars(layer)


@needs_bf16_packing
def test_at_smollm2s_widths_every_row_count_a_call_feeds_keeps_the_plain_numbers(tokenizer):
    """oneDNN picks its kernel by the shapes: at SmolLM2-135M's widths a weight packed for one
    row count and fed another -- a prefill of hundreds of rows, or 96 decoding rows of the key
    projection (AMX Xeon) -- summed in another order, though the first probe (a few row counts)
    passed; the tiny models' 128-wide layers hid it. A 2-layer model of those widths: one long
    prompt alone, a GRPO-like step (prefill 384 rows, 32 decoding), 96 decoding rows."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id)
    engine = HFRollout(LlamaForCausalLM(config), tokenizer, dtype=torch.bfloat16, logprobs=True)
    engine.stop_ids = {-1}  # every sample decodes every step
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(100, len(tokenizer) - 1, (n,), generator=g).tolist()  # noqa
    for prompts, n in [([prompt(40)], 1), ([prompt(48) for _ in range(8)], 4),
                       ([prompt(6) for _ in range(4)], 24)]:
        sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=3)
        packs, engine.packs = engine.packs, True
        packed = engine.generate(prompts, n, sampling)
        engine.packs = False
        plain = engine.generate(prompts, n, sampling)
        engine.packs = packs
        assert packed.completion_ids == plain.completion_ids
        assert packed.engine_logprobs == plain.engine_logprobs, (len(prompts), n)


def test_only_the_rows_a_weight_was_packed_for_run_packed_and_only_where_measured_the_same(
        monkeypatch):
    """A weight packed for 4 rows computes packed for inputs of 4 rows only (any other count:
    F.linear), and only once `agrees` has measured those numbers F.linear's: a packed kernel that
    sums otherwise -- here one output in 2^16 a step apart, rarer than oneDNN's ~1 in 16,000 --
    is found and not used."""
    if not can_pack(torch.nn.Linear(128, 256).to(torch.bfloat16), "cpu", torch.bfloat16):
        pytest.skip("this machine's packed bf16 product is not F.linear's: nothing is packed")
    layer = torch.nn.Linear(128, 256).to(torch.bfloat16)
    x = {n: torch.randn(n, 1, 128, dtype=torch.bfloat16) for n in (3, 4)}
    fed, real = [], packed_linear._packed
    monkeypatch.setattr(packed_linear, "_packed", lambda *a: fed.append(a[2]) or real(*a))
    monkeypatch.setattr(packed_linear, "AGREES", {})
    with torch.no_grad(), packed_linears(torch.nn.Sequential(layer), 4, torch.bfloat16):
        assert all(torch.equal(layer(x[n]), torch.nn.functional.linear(x[n], layer.weight,
                                                                        layer.bias)) for n in x)
    assert any(t is x[4] for t in fed) and not any(t is x[3] for t in fed)  # (3 rows: F.linear)
    assert {t.shape for t in fed} == {(4, 1, 128)}  # (the probe's random inputs: that shape)

    calls = []

    def off_by_a_step(weight, bias, x):  # one output of every 64th call (4 x 256): a step up
        out = real(weight, bias, x)
        calls.append(x)
        if len(calls) % 64 == 0:
            out.view(-1)[0] = (out.view(-1)[0].float() * (1 + 2 ** -7)).bfloat16()
        return out
    monkeypatch.setattr(packed_linear, "_packed", off_by_a_step)
    monkeypatch.setattr(packed_linear, "AGREES", {})
    with torch.no_grad(), packed_linears(torch.nn.Sequential(layer), 4, torch.bfloat16):
        assert torch.equal(layer(x[4]), torch.nn.functional.linear(x[4], layer.weight, layer.bias))
    assert list(packed_linear.AGREES.values()) == [False]


def test_a_measure_is_of_its_thread_count_and_a_strided_input_is_never_packed(monkeypatch):
    """oneDNN picks its kernel by the thread count too (1 thread: every SmolLM2 shape agreed; 2:
    the 192 x 576 key projection at 96 rows did not): a measure taken on one thread count is not
    reused on another. And a strided input (the prefill's LM head reads h[:, -1:]) goes to
    F.linear, which sums a strided view of a frozen weight in another order than a contiguous
    one -- bias or none."""
    if not can_pack(torch.nn.Linear(128, 256).to(torch.bfloat16), "cpu", torch.bfloat16):
        pytest.skip("this machine's packed bf16 product is not F.linear's: nothing is packed")
    layer = torch.nn.Linear(128, 256, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(4, 1, 128, dtype=torch.bfloat16)
    real, threads, fed = packed_linear._packed, torch.get_num_threads(), []

    def by_threads(weight, bias, x):  # another kernel on 2 threads: one output a step up
        out = real(weight, bias, x)
        fed.append(x)
        if torch.get_num_threads() == 2:
            out.view(-1)[0] = (out.view(-1)[0].float() * (1 + 2 ** -7)).bfloat16()
        return out
    monkeypatch.setattr(packed_linear, "_packed", by_threads)
    monkeypatch.setattr(packed_linear, "AGREES", {})
    plain = torch.nn.functional.linear(x, layer.weight)
    try:
        with torch.no_grad(), packed_linears(torch.nn.Sequential(layer), 4, torch.bfloat16):
            torch.set_num_threads(1)
            assert torch.equal(layer(x), plain) and any(t is x for t in fed)  # (packed, agreed)
            torch.set_num_threads(2)
            assert torch.equal(layer(x), plain)  # measured again: differs, so F.linear's
            strided = torch.randn(4, 3, 128, dtype=torch.bfloat16)[:, -1:]
            fed.clear()
            assert torch.equal(layer(strided), torch.nn.functional.linear(strided, layer.weight))
            assert not any(t is strided for t in fed)
    finally:
        torch.set_num_threads(threads)

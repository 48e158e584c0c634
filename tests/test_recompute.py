"""recompute.py: the backward keeps fewer activations, and computes exactly the same gradients."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from recompute import Made, MeanSquare, Remade, keep_less, remake

HIDDEN, INTERMEDIATE, LAYERS = 128, 256, 2


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=HIDDEN,
                                        intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                                        num_attention_heads=2, num_key_value_heads=1))


def forward_backward(model, ids):
    """(bytes the forward leaves alive for the backward, the gradients)."""
    made = Made()
    with made:
        hidden = model.model(input_ids=ids).last_hidden_state
    held = made.held_bytes()
    hidden.float().square().mean().backward()
    return held, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_backward_keeps_less_and_computes_the_same_gradients(llama, dtype):
    ids = torch.randint(0, 300, (3, 50))
    plain = copy.deepcopy(llama).to(dtype)
    ours = copy.deepcopy(plain)
    assert keep_less(ours) == LAYERS + 2 * LAYERS + 1  # the MLPs, the layers' norms, the last norm
    held, grads = forward_backward(plain, ids)
    held_less, grads_less = forward_backward(ours, ids)
    # Gone: each layer's act(gate) and product (intermediate-wide); its two norms' normalised x
    # and output (which the linears after them keep) -- in bf16 or fp16 the norm keeps its output
    # and its input in place of its fp32 x, the same bytes --; the last norm's normalised x, and
    # there half its x's bytes (its input kept instead; its output no linear keeps here).
    tokens, size = ids.numel(), dtype.itemsize
    last = HIDDEN * (2 if size < 4 else 1)
    assert held - held_less == tokens * size * (LAYERS * (2 * INTERMEDIATE + 4 * HIDDEN) + last)
    assert grads.keys() == grads_less.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_less[name]), name


@pytest.mark.parametrize("dtype,scores", [("fp32", None), ("bf16", None), ("fp32", 0)])
def test_shared_prompts_gather_their_keys_again_and_the_gradients_are_the_same(
        tiny_model_dir, dtype, scores, monkeypatch):
    """The update's own forward (logprobs.completion_logprobs: smolrl's attention, a group's prompt
    once in one packed row): each completion's gathered keys and values are remade too -- under
    attention.SmallAttention, and under SDPA, which long rows take (scores=0: every row)."""
    import attention
    from hardware import DTYPES
    from logprobs import check_head_logits, completion_logprobs
    from model import load_model
    if scores is not None:
        monkeypatch.setattr(attention, "SMALL_SCORES", scores)
    plain = load_model(tiny_model_dir, dtype=DTYPES[dtype])[0]
    check_head_logits(plain)
    ours = copy.deepcopy(plain)
    keep_less(ours)
    R, G, P = 2, 4, 7  # prompts, completions a prompt, prompt tokens
    torch.manual_seed(0)
    lens = torch.tensor([5, 3, 6, 1, 2, 6, 4, 6])  # (R G,)
    ids = torch.randint(3, 200, (R * G, P + 6))
    ids[:, :P] = torch.randint(3, 200, (R, P)).repeat_interleave(G, dim=0)

    def forward_backward(model):
        made = Made()
        with made:
            logprobs, _ = completion_logprobs(model, ids, torch.full((R * G,), P), lens)
        held = made.held_bytes()
        logprobs.sum().backward()
        return held, {n: p.grad for n, p in model.named_parameters()}

    held, grads = forward_backward(plain)
    held_less, grads_less = forward_backward(ours)
    for name in grads:
        assert torch.equal(grads[name], grads_less[name]), name
    config, size = plain.config, DTYPES[dtype].itemsize
    kv = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    tokens = R * P + int(lens.sum())  # one packed row
    # each prompt's keys, then each completion's: its prompt's and its own
    gathered = R * P + R * G * (P + int(lens.max()))
    # The MLPs and norms as above; each layer's gathered keys and values go, and the layer's own
    # keys and values (a token each) are kept in their place.
    last = HIDDEN * (2 if dtype == "bf16" else 1)
    assert held - held_less == size * (
        tokens * (LAYERS * (2 * INTERMEDIATE + 4 * HIDDEN) + last)
        + LAYERS * 2 * kv * (gathered - tokens))


def test_modules_that_compute_something_else_keep_their_forward(llama):
    """By their parts these look like Llama's MLP and RMSNorm; they compute otherwise (the gate and
    up roles swapped; Gemma's norm scales by 1 + w), so keep_less leaves them alone."""
    model = copy.deepcopy(llama)
    for layer in model.model.layers:
        layer.mlp.__class__ = type("SwappedMLP", (type(layer.mlp),), {
            "forward": lambda self, x: self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))})
        layer.input_layernorm.__class__ = type("OnePlusRMSNorm", (type(layer.input_layernorm),), {
            "forward": lambda self, h: (1 + self.weight) * (h * torch.rsqrt(
                h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))})
    changed = keep_less(model)
    assert changed == LAYERS + 1  # the post-attention norms and the last one only
    x = torch.randn(2, 4, HIDDEN)
    for layer, original in zip(model.model.layers, llama.model.layers):
        assert "forward" not in vars(layer.mlp) and "forward" not in vars(layer.input_layernorm)
        assert "forward" in vars(layer.post_attention_layernorm)
        with torch.no_grad():  # and the swapped MLP still computes its own way
            assert not torch.equal(layer.mlp(x), original.mlp(x))


def test_the_trainer_and_its_bf16_copy_remake_activations(tiny_model_dir):
    """setup_trainer gives its trained model keep_less's forwards -- the bf16 copy (a deepcopy)
    its own, bound to the copy's modules -- and not under gradient checkpointing."""
    import grpo
    from conftest import rl_trainer
    for dtype in ("fp32", "bf16"):
        trainer = rl_trainer(grpo.Config(model=tiny_model_dir, dtype=dtype))
        layer = trainer.compute.model.layers[0]
        for module in (layer, layer.mlp, layer.input_layernorm):
            assert vars(module)["forward"].__self__ is module
        assert vars(layer)["unscoped_forward"].__self__ is layer
        assert (trainer.compute is trainer.model) == (dtype == "fp32")
        # (bf16: checked on the copy, in the dtype it computes in; the fp32 master never runs)
        assert ("forward" in vars(trainer.model.model.layers[0].mlp)) == (dtype == "fp32")
    checkpointed = rl_trainer(grpo.Config(model=tiny_model_dir, gradient_checkpointing=True))
    assert "forward" not in vars(checkpointed.compute.model.layers[0].mlp)


class RoundsTheProductRMSNorm(LlamaRMSNorm):
    """Olmo2's norm: w * x * rsqrt rounded to the input's dtype as a whole, where Llama's rounds
    x * rsqrt before the weight: the same in fp32, not in bf16 nor under autocast."""

    def forward(self, hidden):
        x = hidden.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * x).to(hidden.dtype)


class DropsOut(LlamaMLP):
    def forward(self, x):
        return self.down_proj(torch.nn.functional.dropout(self.act_fn(self.gate_proj(x)) *
                                                          self.up_proj(x), 0.1, self.training))


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float32, True),
                                            (torch.bfloat16, False)])
def test_the_check_runs_in_the_dtype_and_mode_the_model_trains_in(llama, dtype, autocast):
    """keep_less is called on the model that computes: a norm that equals Llama's in fp32 only is
    refused in bf16 and under autocast; an MLP with dropout, in training mode (the models load in
    eval mode, where dropout is off)."""
    model = copy.deepcopy(llama).to(dtype).eval()
    layer = model.model.layers[0]
    layer.input_layernorm.__class__ = RoundsTheProductRMSNorm
    layer.mlp.__class__ = DropsOut
    keep_less(model, autocast=autocast)
    rounds_alike = dtype == torch.float32 and not autocast
    assert ("forward" in vars(layer.input_layernorm)) == rounds_alike
    assert "forward" not in vars(layer.mlp)
    assert "forward" in vars(model.model.layers[1].mlp)  # (Llama's own: taken)


def test_a_forward_never_backpropagated_frees_everything(llama):
    """Tensors an op saves of its own output (SDPA's, softmax's) would hold their graph node: a
    cycle, which a forward dropped without a backward (an exception between them) would leak."""
    model = copy.deepcopy(llama)
    keep_less(model)
    made = Made()
    with made:
        hidden = model.model(input_ids=torch.randint(0, 300, (2, 20))).last_hidden_state
    assert made.held_bytes() > 0
    del hidden
    assert made.held_bytes() == 0


def test_the_norms_mean_square_has_autograds_gradient_in_one_product():
    """RMSNorm's mean(x^2): autograd's backward expanded the gradient to x's shape, divided it by
    N and multiplied by 2x -- passes over (tokens, hidden) that cost ~1.3 of an RMSNorm's 5.5 ms
    forward and backward at the default run's shape, making four tensors that size. MeanSquare's
    makes one, x (2g / N), whose every element is autograd's bit for bit (2x and 2(g / N) are
    exact doublings, so both round 2 x g / N once). Multiplying by 2 / N instead rounds
    differently: the model-level tests above do not see it, this one does. Widths: SmolLM2's
    norms (576), a head's (64, Qwen3's q_norm), 2048, a prime; magnitudes over ten orders; fp32
    and bf16-upcast inputs."""
    from conftest import FreshTensors

    for seed in range(6):
        for width in (576, 64, 2048, 7):
            draw = torch.Generator().manual_seed(seed)
            x = torch.randn(40, width, generator=draw) * 10.0 ** torch.randn(40, 1, generator=draw)
            x = x.bfloat16().float() if seed % 2 else x
            grad = torch.randn(40, 1, generator=draw)
            theirs, mine = x.clone().requires_grad_(), x.clone().requires_grad_()
            theirs.pow(2).mean(-1, keepdim=True).backward(grad)
            out = MeanSquare.apply(mine)
            assert torch.equal(out, theirs.pow(2).mean(-1, keepdim=True))
            made = FreshTensors(x.numel())
            with made:
                out.backward(grad)
            assert torch.equal(mine.grad, theirs.grad), (seed, width)
            assert made.count == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_bf16_norms_result_is_made_once_not_again_for_each_projection(llama, dtype):
    """The attention's norm feeds q, k and v's projections, which each keep its result. Remade, it
    was made again for each of the three in the backward (its fp32 x * rsqrt too), ~1.5 % of the
    default run's bf16 update on a Zen 4; in bf16 (and fp16) it is kept instead, in the bytes of
    the fp32 x it no longer keeps (the test above counts them), and the norm's weight multiplies
    twice in all: the forward's product and its gradient's. In fp32 keeping it would add its
    bytes: there it is remade, three times more."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = copy.deepcopy(llama).to(dtype)
    keep_less(model)
    layer = model.model.layers[0]
    weight = layer.input_layernorm.weight

    class WeightProducts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mul.Tensor and any(
                    isinstance(a, torch.Tensor) and a.data_ptr() == weight.data_ptr()
                    for a in args):
                WeightProducts.count += 1
            return func(*args, **(kwargs or {}))

    hidden = torch.randn(2, 9, HIDDEN, dtype=dtype, requires_grad=True)
    position = torch.arange(9)[None].expand(2, 9)
    with WeightProducts():
        out = layer(hidden, position_embeddings=model.model.rotary_emb(hidden, position),
                    position_ids=position)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().sum().backward()
    assert WeightProducts.count == (2 if dtype.itemsize < 4 else 5), WeightProducts.count


def test_an_in_place_change_to_a_kept_tensor_is_still_an_error():
    x = torch.randn(5, requires_grad=True)
    with Remade():
        y = x.exp()  # (keeps y for its backward)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified in place after the forward saved it"):
        y.sum().backward()


def test_empty_tensors_are_not_taken_for_one_another():
    """Every empty storage sits at address 0: one registered must not stand for another."""
    a = torch.randn(0, 3, requires_grad=True)
    b = torch.randn(3, 0, dtype=torch.float64, requires_grad=True)
    with Remade():
        remake(a * 2, lambda a: a * 2, a)
        out = (b.double() * b).sum() + (a * a).sum()
    out.backward()
    assert b.grad.shape == (3, 0) and a.grad.shape == (0, 3)


def _doubles_in_place(module, args, output):
    output.mul_(2)  # (returns None: the output, changed in place, is what the model goes on with)


def _jitters_its_input(module, args):
    """Mixtral's router_jitter_noise: `hidden_states *= noise`, in place, on the MLP's input (the
    post-attention norm's output). The noise drawn from a seed: the same in both models."""
    noise = torch.empty_like(args[0]).uniform_(0.9, 1.1, generator=torch.Generator().manual_seed(7))
    args[0].mul_(noise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["input_layernorm", "mlp", "down_proj", "act_fn"])
def test_a_registered_tensor_changed_in_place_is_kept_not_remade(llama, dtype, where):
    """Issue 67: a registered tensor changed in place after remake() -- a forward hook doubling
    input_layernorm's output, Mixtral's router jitter multiplying the MLP's input (the
    post-attention norm's output), a hook scaling down_proj's input -- was made again as it was
    before the change: q and k's gradients came out half the right ones, the experts' 5-7 % off.
    Now its version is recorded at registration and a tensor changed since is kept as it is: the
    gradients are those of the model without recompute.py, bit for bit. A hook on the MLP's activation, which here draws
    noise: the recipes would run it again in the backward, so that MLP remakes nothing."""
    plain = copy.deepcopy(llama).to(dtype)
    ours = copy.deepcopy(plain)
    keep_less(ours)
    for model in (plain, ours):
        for layer in model.model.layers:
            if where == "input_layernorm":
                layer.input_layernorm.register_forward_hook(_doubles_in_place)
            elif where == "mlp":
                layer.mlp.register_forward_pre_hook(_jitters_its_input)
            elif where == "down_proj":  # its input: act(gate) * up, scaled in place
                layer.mlp.down_proj.register_forward_pre_hook(lambda module, args: args[0].mul_(3))
            else:  # a hook that returns another tensor, drawn at random each call
                layer.mlp.act_fn.register_forward_hook(
                    lambda module, args, out: out * torch.empty_like(out).uniform_(0.9, 1.1))
    ids = torch.randint(0, 300, (2, 30))
    torch.manual_seed(1)
    _, grads = forward_backward(plain, ids)
    torch.manual_seed(1)
    _, grads_less = forward_backward(ours, ids)
    for name in grads:
        assert torch.equal(grads[name], grads_less[name]), name


def test_a_recipes_input_changed_in_place_is_kept_or_an_error():
    """What a recipe reads, changed in place: before an op saves the registered tensor, or after
    but while the scope lasts, the tensor is kept as it is (the recipe would make another); after
    the scope, the backward stops, as autograd does for a tensor it keeps -- not a silent, wrong
    gradient. (x needs no gradient, as a frozen model's inputs: no op of autograd's own keeps it,
    so nothing else would notice.)"""
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    expected = 2 * x
    with Remade():
        h = remake(x * 2, lambda x: x * 2, x)
        x.add_(1)  # before any op saved h
        (h * w).sum().backward()
    assert torch.equal(w.grad, expected)
    x = torch.randn(4)
    expected, w.grad = 2 * x, None
    with Remade():
        h = remake(x * 2, lambda x: x * 2, x)
        out = (h * w).sum()  # saves h: as its recipe
        x.add_(1)  # after, but inside the scope: h itself is kept when it ends
    out.backward()
    assert torch.equal(w.grad, expected)
    x = torch.randn(4)
    with Remade():
        h = remake(x * 2, lambda x: x * 2, x)
        out = (h * w).sum()
    x.add_(1)  # after the scope
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()


def test_a_norm_keeps_its_input_only_where_that_holds_no_more_than_its_fp32_x():
    """A bf16 or fp16 norm keeps its input and its result in the bytes of the fp32 x it no longer
    keeps -- not under autocast with an fp32 weight (its result is fp32: 6 bytes an element), nor
    for an input that is a slice of a wider tensor (keeping it would keep the whole; DeepSeek-V3's
    kv_a_layernorm reads a split). Found by review."""
    from recompute import _keeps_input
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    wide = torch.randn(6, 4 * HIDDEN, dtype=bf16)
    assert _keeps_input(torch.ones(HIDDEN, dtype=bf16), torch.randn(6, HIDDEN, dtype=bf16))
    assert _keeps_input(torch.ones(HIDDEN, dtype=fp16), torch.randn(6, HIDDEN, dtype=fp16))
    assert _keeps_input(torch.ones(HIDDEN, dtype=bf16), wide.view(6, 4, HIDDEN))  # (all of it)
    assert not _keeps_input(torch.ones(HIDDEN, dtype=fp32), torch.randn(6, HIDDEN, dtype=bf16))
    assert not _keeps_input(torch.ones(HIDDEN, dtype=fp32), torch.randn(6, HIDDEN))
    assert not _keeps_input(torch.ones(HIDDEN, dtype=bf16), wide[:, -HIDDEN:])


def _scales_its_input(module, args, output):
    args[0].mul_(1.5)  # (after the norm's forward: the residual stream goes on scaled)


@pytest.mark.parametrize("where", ["input_layernorm", "last norm", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norms_input_scaled_in_place_after_it_trains_as_without_recompute(llama, dtype, where):
    """A bf16 norm's fp32 x is made again from its input: a hook scaling that input in place after
    the norm ran changed what the recipe reads. In bf16 no op of the plain model keeps the input,
    which trains on; so does ours, the same gradients bit for bit (the layer's scope keeps x
    itself when it ends). A hook on a module that has a scope of its own -- a decoder layer, the
    last norm -- runs after that scope ends: there the norm keeps x, as before (found by review).
    In fp32 x is the input, which the plain model keeps: both stop."""
    plain = copy.deepcopy(llama).to(dtype)
    ours = copy.deepcopy(plain)
    keep_less(ours)
    for model in (plain, ours):
        module = {"input_layernorm": model.model.layers[1].input_layernorm,
                  "last norm": model.model.norm, "layer": model.model.layers[1]}[where]
        module.register_forward_hook(_scales_its_input)
    ids = torch.randint(0, 300, (2, 30))
    if dtype == torch.float32:
        for model in (plain, ours):
            with pytest.raises(RuntimeError, match="modified by an inplace|modified in place"):
                forward_backward(model, ids)
        return
    (_, grads), (_, grads_less) = forward_backward(plain, ids), forward_backward(ours, ids)
    for name in grads:
        assert torch.equal(grads[name], grads_less[name]), name


def test_mixtrals_router_jitter_gives_the_gradients_of_the_model_without_recompute():
    """Mixtral's own in-place jitter (router_jitter_noise, on in training mode), the noise drawn
    alike in both models: bit for bit the gradients of the model without recompute.py."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    plain = MixtralForCausalLM(MixtralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.1)).train()
    ours = copy.deepcopy(plain)
    assert keep_less(ours) > 0  # (its norms)
    ids = torch.randint(0, 300, (2, 20))
    torch.manual_seed(1)
    _, grads = forward_backward(plain, ids)
    torch.manual_seed(1)
    _, grads_less = forward_backward(ours, ids)
    for name in grads:
        assert torch.equal(grads[name], grads_less[name]), name

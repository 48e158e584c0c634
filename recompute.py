"""What the backward keeps: results that are cheap to make again are not stored.

Autograd keeps every tensor an op needs for its gradient until the backward reaches that op. In a
Llama-style decoder layer half of those bytes are results a few cheap ops away from tensors the
backward keeps anyway:

    MLP        down(act(gate) * up)            act(gate) and the product: from gate and up
    RMSNorm    y = w * (x * rsqrt(mean(x^2)))  x * rsqrt: from x and its rsqrt; and in fp32 y
                                               (every linear after it keeps y) -- in bf16 x,
                                               from the bf16 input (rms_norm_forward)
    attention  each completion's keys and      gathered from the layer's keys and values (a
               values (attention.py)           shared prompt's once for each completion)

(gate, up, x, its rsqrt, the keys and values: their own ops' gradients need them.) So those are
stored as *how to make them*, a Recipe, and made again by the same ops on the same inputs when the
backward asks: the gradients are bit-identical, and the extra work is element-wise ops and
gathers, no matmul. The scope is a decoder layer's forward: inside it, saved-tensor hooks store
a tensor given to remake() as its recipe -- while it is what the recipe makes. A tensor changed
in place after it was registered (a forward hook that scales a norm's output, Mixtral's router
jitter `hidden_states *= noise`), or whose recipe's inputs were, is kept as it is. So is one
whose inputs change after an op saved its recipe while the scope lasts (a hook that scales a
bf16 norm's input after the norm): the scope keeps it when it ends. An input changed after the
scope is an error in the backward, as autograd's own check is; so a bf16 norm whose scope a
hook outlives (on the layer, on the last norm) keeps its fp32 x, and no recipe reads its input.
What is left: a caller changing a bf16 model's embeddings in place after its forward stops the
backward, where plain autograd trains.
SmolLM2-135M, the default update's 32 sequences: 1.05 -> 0.52 GB held for the backward, forward +
backward 6.0 -> 5.8 s (`python benchmarks/activations.py`; tests/test_recompute.py counts the
bytes that go, and checks the gradients equal, fp32, bf16 and fp16).
Liger-Kernel's fused SwiGLU and RMSNorm keep the same tensors.

keep_less() gives the MLP and RMSNorm forwards below to the modules whose own forward they
reproduce exactly (checked on a small input as it applies them); the others keep theirs. Not with
gradient checkpointing (which remakes whole layers through saved-tensor hooks of its own) nor
--compile (the compiler's partitioner chooses what to remake itself).
"""

import copy
import gc
import threading
import types
import weakref
from typing import Callable, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Registered(NamedTuple):
    """A tensor given to remake(), as it was then."""
    tensor: torch.Tensor
    version: int  # its version: changed in place since (a hook, Mixtral's router jitter), it is
    #               no longer what the recipe makes
    make: Callable[..., torch.Tensor]  # make(*inputs) makes it again
    inputs: tuple  # every tensor make reads ...
    versions: tuple  # ... and their versions
    held: list  # the tensor itself, where its inputs changed in place before the scope ended

    def changed(self) -> bool:
        return self.tensor._version != self.version or _changed(self.inputs, self.versions)


class Recipe(NamedTuple):
    make: Callable[..., torch.Tensor]  # makes the registered tensor again ...
    inputs: tuple  # ... from these, as they were at registration
    versions: tuple
    size: tuple  # the saved tensor: the registered one or a view of it (a linear keeps its
    stride: tuple  # input flattened to 2-D, attention its keys transposed)
    offset: int
    held: list  # Registered.held: [Kept] where the recipe can no longer make it


class Kept(NamedTuple):
    tensor: torch.Tensor  # detached (see Remade._pack)
    version: int  # its version when saved: an in-place change since is an error, as in autograd


_local = threading.local()  # each thread its scopes, innermost last (an engine may decode in a
                            # thread of the trainer's process while it trains)


def _scopes() -> list["Remade"]:
    return _local.__dict__.setdefault("scopes", [])


class Remade:
    """A scope whose saved tensors, where remake() was told how to make them, are stored as that."""

    def __init__(self, hooked: bool = False):
        # storage address -> the tensor and its recipe. The tensor is held until the scope ends,
        # so that no other tensor can take its address meanwhile and be mistaken for it.
        self.recipes: dict[int, Registered] = {}
        # Whether hooks run on the scoped module's call after the scope ends: one may change its
        # input in place where no recipe's change is seen any more (rms_norm_forward asks).
        self.hooked = hooked
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self):
        _scopes().append(self)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        _scopes().pop()
        for r in self.recipes.values():
            # What a recipe reads, changed in place after an op saved the recipe but inside the
            # scope (a hook scaling a bf16 norm's input, which the norm's recipe for its fp32 x
            # reads): the recipe would make another tensor, so the tensor itself is kept.
            if _changed(r.inputs, r.versions) and r.tensor._version == r.version:
                r.held.append(Kept(r.tensor.detach(), r.version))
        self.recipes.clear()

    def _pack(self, t: torch.Tensor):
        registered = self.recipes.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if registered is None or registered.changed():
            # Kept: not registered, or changed in place since (it, or what its recipe reads),
            # which the recipe would not make. Detached: an op that saves its own output (softmax,
            # exp) would otherwise hold its own graph node, a cycle that outlives a forward never
            # backpropagated. Its version, so that an in-place change before the backward is
            # still an error.
            return Kept(t.detach(), t._version)
        return Recipe(registered.make, registered.inputs, registered.versions, t.shape,
                      t.stride(), t.storage_offset(), registered.held)


def _changed(tensors: tuple, versions: tuple) -> bool:
    return any(t._version != v for t, v in zip(tensors, versions))


def _unpack(saved):
    if isinstance(saved, Recipe):
        if saved.held:  # (see Remade.__exit__)
            return _unpack(saved.held[0]).as_strided(saved.size, saved.stride, saved.offset)
        if _changed(saved.inputs, saved.versions):  # (it would make something else)
            raise RuntimeError("a tensor the backward makes again was modified in place after "
                               "the forward saved it: what it is made from has changed")
        return saved.make(*saved.inputs).as_strided(saved.size, saved.stride, saved.offset)
    if saved.tensor._version != saved.version:
        raise RuntimeError(f"a tensor the backward needs, {tuple(saved.tensor.shape)}, was "
                           f"modified in place after the forward saved it (version "
                           f"{saved.tensor._version}, saved at {saved.version})")
    return saved.tensor


def remake(tensor: torch.Tensor, make: Callable[..., torch.Tensor], *inputs) -> torch.Tensor:
    """tensor, which the backward will get by calling make(*inputs) where this runs in a scope (a
    layer under keep_less, with grad); elsewhere nothing changes. `inputs`: every tensor make
    reads (their versions are checked, as `tensor`'s: a change in place since is kept or an
    error, never a silently different tensor)."""
    if _scopes() and torch.is_grad_enabled() and tensor.numel():  # (every empty one is at 0)
        _scopes()[-1].recipes[tensor.untyped_storage().data_ptr()] = Registered(
            tensor, tensor._version, make, inputs, tuple(x._version for x in inputs), [])
    return tensor


def mlp_forward(self, x):
    """down(act(gate(x)) * up(x)) as Llama's MLP computes it; act(gate) and the product remade --
    unless a hook runs with the activation: the backward would run it again (a hook that records,
    or draws noise, twice), so then nothing is remade."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    if _hooked(self.act_fn):
        return self.down_proj(self.act_fn(gate) * up)
    act = remake(self.act_fn(gate), self.act_fn, gate)
    return self.down_proj(remake(act * up, lambda gate, up: self.act_fn(gate) * up, gate, up))


def _hooked(module) -> bool:
    """Whether calling module runs hooks besides its forward: its own, or every module's."""
    every = torch.nn.modules.module
    return bool(module._forward_pre_hooks or module._forward_hooks or
                every._global_forward_pre_hooks or every._global_forward_hooks)


class MeanSquare(torch.autograd.Function):
    """x.pow(2).mean(-1, keepdim=True), its backward written out. Autograd's -- the gradient
    expanded to x's shape and divided by N (mean's), then times 2x (pow's) -- makes four tensors
    of x's size, ~1.3 of the 5.5 ms an RMSNorm's forward and backward took at the default run's
    1,302 x 576 in bf16. Here one, x (2g / N), with the same bits: 2x and 2(g / N) are exact
    doublings, so both ways round 2 x g / N once (tests/test_recompute.py) -- unless one of them
    overflows (|x| or |g| / N over ~1.7e38 in fp32, where the loss is not finite anyway)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.pow(2).mean(-1, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return x * (grad / x.shape[-1] * 2)


def rms_norm_forward(self, hidden):
    """Llama's RMSNorm, in fp32, the result in the input's dtype. Kept for the backward, four bytes
    an element either way: an fp32 input (x itself), its result and x * rsqrt remade from it; a
    bf16 input as it came, and the result, with x in fp32 and x * rsqrt remade from the input
    (_keeps_input says where). A remade result is made again for each op that saved it -- q, k
    and v's projections each ask for the attention's norm, the gate and up projections for the
    MLP's --, its fp32 x * rsqrt with it: kept, in the bytes of the fp32 x it replaces, the
    update ran ~1.5 % faster (0.05-0.07 s of ~4.2 at the default run's shapes in bf16 on a Zen 4,
    faster in 27 of 40 paired rounds; the same gradients, bit for bit)."""
    dtype = hidden.dtype
    # (a hook on the layer, or on a norm with a scope of its own, runs after the scope: it could
    # change the input the recipe of x reads, unseen; there the norm keeps x, as before)
    narrow = _keeps_input(self.weight, hidden) and not (_scopes() and _scopes()[-1].hooked)
    up = lambda h: h.to(torch.float32)  # noqa: E731
    x = remake(up(hidden), up, hidden) if narrow else up(hidden)
    # MeanSquare only where a backward will run: decoding skips apply()'s ~5 us a call
    squares = MeanSquare.apply(x) if x.requires_grad else x.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(squares + self.variance_epsilon)
    normed = lambda h, rstd: (up(h) * rstd).to(dtype)  # noqa: E731 (h: the input, or x)
    y = self.weight * remake(normed(x, rstd), normed, hidden if narrow else x, rstd)
    return y if narrow else remake(y, lambda w, h, rstd: w * normed(h, rstd), self.weight, x,
                                   rstd)


def _keeps_input(weight, hidden) -> bool:
    """Whether the norm keeps its input and its result rather than its fp32 x: where both take
    fewer bytes than fp32 (bf16, fp16; not an fp32 weight's result under autocast) and the input
    is the whole of its storage (a slice of a wider tensor would keep all of it)."""
    size = hidden.element_size()
    return (size < 4 and torch.promote_types(weight.dtype, hidden.dtype).itemsize < 4
            and hidden.numel() * size == hidden.untyped_storage().nbytes())


def _forward_for(module) -> Callable | None:
    """Which of the forwards above could stand for module's, by its parts."""
    if all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return mlp_forward
    if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
        return rms_norm_forward
    return None


@torch.no_grad()
def _computes_the_same(module, forward, autocast: bool) -> bool:
    """Whether forward gives exactly what module's own forward gives, on a small random input in
    training mode (where dropout would differ): in the weights' dtype, and with autocast (the
    bf16 autocast LoRA and FSDP2 compute under) on inputs in that dtype and in bf16 too -- a norm
    that rounds its product rather than its normalised x to the input's dtype differs only there."""
    weight = next(module.parameters(), None)
    if weight is None:
        return False
    if sum(p.numel() for p in module.parameters()) <= 2**20:  # a norm: on a copy, its weights
        module, draw = copy.deepcopy(module), torch.Generator().manual_seed(1)  # drawn at random
        for p in module.parameters():  # (a fresh one's are all 1, with which most roundings agree)
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=draw))
    hidden = getattr(module, "hidden_size", None) or weight.shape[-1]
    x = torch.randn(2, 3, hidden, generator=torch.Generator().manual_seed(0)).to(weight)
    cases = [(x, False)] + ([(x, True), (x.bfloat16(), True)] if autocast else [])
    training = module.training
    module.train()
    try:
        for given, autocasting in cases:
            with torch.autocast(weight.device.type, torch.bfloat16, enabled=autocasting):
                if not torch.equal(forward(module, given), module(given)):
                    return False
        return True
    except Exception:  # (a shape or signature this file does not know)
        return False
    finally:
        module.train(training)


def _scoped_forward(self, *args, **kwargs):
    if not torch.is_grad_enabled():  # (decoding, evaluation: nothing is saved, no scope needed)
        return self.unscoped_forward(*args, **kwargs)
    with Remade(hooked=_hooked(self)):
        return self.unscoped_forward(*args, **kwargs)


def keep_less(model, autocast: bool = False) -> int:
    """Give model's MLPs and RMSNorms the forwards above where they compute exactly what their
    own do (checked once per class, in the weights' dtype: call it on the model that computes,
    such as a bf16 copy; autocast: and under bf16 autocast, as LoRA and FSDP2 compute), and run
    each decoder layer -- and such a module outside the layers, the last norm -- in a scope of
    its own. Returns how many modules took a forward."""
    same: dict[type, bool] = {}
    changed = []
    for module in model.modules():
        forward = _forward_for(module)
        if forward is None:
            continue
        if type(module) not in same:
            same[type(module)] = _computes_the_same(module, forward, autocast)
        if same[type(module)]:
            module.forward = types.MethodType(forward, module)
            changed.append(module)
    layers = list(getattr(model.get_decoder(), "layers", None) or [])
    inside = {id(m) for layer in layers for m in layer.modules()}
    for module in layers + [m for m in changed if id(m) not in inside]:
        # Bound methods, not closures: a deepcopy of the model (trainer.bf16_copy) binds them to
        # the copy's modules.
        module.unscoped_forward = module.forward
        module.forward = types.MethodType(_scoped_forward, module)
    return len(changed)


class Made(TorchDispatchMode):
    """The storages the ops make while this is active, by weak reference to every tensor that
    shows them (a storage a view alone keeps alive still counts; a weight's transpose, a view of
    what existed before, does not). held_bytes(): the bytes of those still alive, each storage
    once -- around a forward, what it leaves for the backward (and its output). How
    tests/test_recompute.py and benchmarks/activations.py measure."""

    def __init__(self):
        super().__init__()
        self.new_storages: set[int] = set()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage().data_ptr()
                if storage not in inputs:
                    self.new_storages.add(storage)
                if storage in self.new_storages:
                    self.made.append(weakref.ref(t))
        return out

    def held_bytes(self) -> int:
        gc.collect()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (ref() for ref in self.made) if t is not None}
        return sum(storages.values())

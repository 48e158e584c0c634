"""The HF engine's linear layers with their weights packed once for the CPU's matmul kernel.

A decoding step multiplies a few dozen rows -- one token per sample -- by every weight of the
model. On a CPU, PyTorch's bf16 matmul is oneDNN's, and each call hands it the weight in its plain
(out, in) layout, which oneDNN first copies into the blocks its kernel reads: at decoding's row
counts that copy is a large share of the call, paid for every layer at every step. Packed once per
generate call instead (`torch.ops.mkldnn`, as torch.compile's CPU backend packs frozen weights),
the same kernel runs on the same numbers: measured on a 2-core Zen 4 in bf16, 32 rows x SmolLM2's
576 -> 1536 took 180 us plain and 146 us packed, the 49K-token LM head 7.1 and 5.2 ms.

Only where the packed product is bit for bit F.linear's -- what the trainer computes its
log-probs with -- on this machine, in this dtype, at each weight shape the model has:
`packs_exactly` measures it once a process. In
fp32 F.linear is MKL's, whose sums are ordered otherwise (packing would be ~1.5x faster there, but
the engine's numbers would leave the trainer's), so fp32 decodes as before.
"""

from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F


MEASURED: dict[tuple, bool] = {}  # (weight shape, dtype) -> packs exactly, this process


def packs_exactly(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed linear gives F.linear's numbers bit for bit here for this (out, in)
    weight: random inputs of 1, 7 and 64 rows and 3-D batches (one strided), with and without a
    bias. The kernel chosen depends on the shapes and the dtype: each pair is measured once a
    process."""
    key = (tuple(weight.shape), weight.dtype)
    if key not in MEASURED:
        MEASURED[key] = _same_numbers(weight.detach())
    return MEASURED[key]


def _same_numbers(weight) -> bool:
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")):
        return False
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(weight.shape[0], generator=gen).to(weight.dtype)
    try:
        packed = ops._reorder_linear_weight(weight, 64)
        module = SimpleNamespace(weight=weight, bias=bias)  # (what _packed_forward reads)
        for rows in [(1,), (7,), (64,), (3, 5), (3, 7)]:
            x = torch.randn(*rows, weight.shape[1], generator=gen).to(weight.dtype)
            x = x[:, -2:] if x.dim() == 3 and rows[1] == 7 else x  # (strided, as a head reads)
            if not torch.equal(F.linear(x, weight), _packed(packed, None, x)) or \
                    not torch.equal(F.linear(x, weight, bias), _packed_forward(packed, module, x)):
                return False
    except RuntimeError:  # (a build or a CPU without these kernels)
        return False
    return True


def _packed(weight, bias, x):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_forward(packed, module, x):
    """A Linear's forward on its packed weight. F.linear adds a bias inside the matmul only for a
    2-D or a contiguous input; a strided one of more dimensions (Phi's LM head reads h[:, -1:]) it
    multiplies, then adds the bias in the weight's dtype -- another rounding, which the packed op's
    fused bias does not make: that input goes to F.linear as it is."""
    if module.bias is not None and x.dim() > 2 and not x.is_contiguous():
        return F.linear(x, module.weight, module.bias)
    return _packed(packed, module.bias, x)


def _packable(model, dtype: torch.dtype) -> list:
    """The model's plain nn.Linear layers with a plain tensor as weight, in `dtype`, on the CPU."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and
            type(m.weight.data) is torch.Tensor and m.weight.dtype == dtype and
            m.weight.device.type == "cpu" and "forward" not in vars(m)]  # (not a hooked one)


def can_pack(model, device, dtype: torch.dtype) -> bool:
    """Decoding on a CPU, in a dtype and at weight shapes whose packed product is F.linear's here
    (in fp32 it is not: see above)."""
    layers = _packable(model, dtype)
    return torch.device(device).type == "cpu" and bool(layers) and \
        all(packs_exactly(m.weight) for m in layers)


@contextmanager
def packed_linears(model, rows: int, dtype: torch.dtype):
    """Within: each plain nn.Linear of `model` whose weight is in `dtype` (the dtype can_pack
    measured) computes with its weight packed for `rows` rows (the
    packing is read again at the next call: the weights change between calls). Its forward is
    swapped on the instance and restored after, so a trainer sharing these modules sees nothing.
    Under no_grad only (oneDNN's packed linear has no backward)."""
    swapped = []
    try:
        for module in _packable(model, dtype):
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)
            module.forward = partial(_packed_forward, packed, module)
            swapped.append(module)
        yield
    finally:
        for module in swapped:
            del module.forward

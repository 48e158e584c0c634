"""The HF engine's linear layers with their weights packed once for the CPU's matmul kernel.

A decoding step multiplies a few dozen rows -- one token per sample -- by every weight of the
model. On a CPU, PyTorch's bf16 matmul is oneDNN's, and each call hands it the weight in its plain
(out, in) layout, which oneDNN first copies into the blocks its kernel reads: at decoding's row
counts that copy is a large share of the call, paid for every layer at every step. Packed once per
generate call instead (`torch.ops.mkldnn`, as torch.compile's CPU backend packs frozen weights),
the same kernel runs on the same numbers: measured on a 2-core Zen 4 in bf16, 32 rows x SmolLM2's
576 -> 1536 took 180 us plain and 146 us packed, the 49K-token LM head 7.1 and 5.2 ms.

Only where the packed product is bit for bit F.linear's -- what the trainer computes its
log-probs with -- on this machine, in this dtype, at each weight shape the model has, and at the
row count the weight was packed for. oneDNN picks its kernel by the shapes: a weight packed for
32 rows and fed 96, or 289 (a prefill), sums in another order, and so, at some counts, does one
packed for the very rows it is fed (96 rows of SmolLM2's 192 x 576 key projection, AMX Xeon);
then about one bf16 output in 16,000 comes out a step apart; the thread count changes the kernel
too. So two measures, each once a process and thread count:
`packs_exactly` per weight shape before a model packs at all (in fp32 F.linear is MKL's, whose sums
are ordered otherwise everywhere: packing would be ~1.5x faster there, but the engine's numbers
would leave the trainer's, so fp32 decodes as before), and `agrees` per (shape, rows) the first
time a call feeds a weight the rows it was packed for, over 2^18 random outputs (a kernel that
sums otherwise shows in ~16 of them). Any other row count -- a prefill, a batch after samples
left it -- and any strided input go to F.linear: packing pays off in the full batch's decoding
steps.
"""

import math
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F


MEASURED: dict[tuple, bool] = {}  # (weight shape, dtype, threads) -> packs exactly, here
AGREES: dict[tuple, bool] = {}  # (shape, dtype, bias, input's shape, threads) -> the same
PROBE_OUTPUTS = 1 << 18  # outputs compared: ~16 differ where the sums are ordered otherwise


def packs_exactly(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed linear gives F.linear's numbers bit for bit here for this (out, in)
    weight, at a first look: random inputs of 1, 7 and 64 rows and a 3-D batch, with and without a
    bias, packed for 64 rows (a build or a dtype whose sums differ everywhere packs nothing; each
    row count a call packs for is measured again by `agrees`). Once a process a (shape, dtype,
    thread count)."""
    key = (tuple(weight.shape), weight.dtype, torch.get_num_threads())
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
        for rows in [(1,), (7,), (64,), (3, 5)]:
            x = torch.randn(*rows, weight.shape[1], generator=gen).to(weight.dtype)
            if not all(torch.equal(F.linear(x, weight, b), _packed(packed, b, x))
                       for b in (None, bias)):
                return False
    except RuntimeError:  # (a build or a CPU without these kernels)
        return False
    return True


def _packed(weight, bias, x):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_forward(packed, rows: int, module, x):
    """A Linear's forward on its weight packed for `rows` rows, where that gives F.linear's
    numbers for this input; F.linear's otherwise. A strided input -- the prefill's LM head reads
    h[:, -1:] -- goes to F.linear as it is: F.linear sums a strided view in another order than a
    contiguous one (a frozen weight's, from 33 rows: a distillation teacher's), and adds a bias
    after the matmul, in the weight's dtype (Phi's head), where the packed op fuses it."""
    if not x.is_contiguous() or not agrees(packed, rows, module, x.shape[:-1]):
        return F.linear(x, module.weight, module.bias)
    return _packed(packed, module.bias, x)


def agrees(packed, rows: int, module, lead: torch.Size) -> bool:
    """Whether `module`'s weight, packed for `rows` rows, gives F.linear's numbers bit for bit for
    inputs shaped (*lead, in): only inputs of exactly `rows` rows, measured the first time over
    random inputs of that shape holding PROBE_OUTPUTS outputs in all; F.linear's for the others."""
    weight, bias = module.weight, module.bias
    if math.prod(lead) != rows:
        return False
    key = (tuple(weight.shape), weight.dtype, bias is not None, tuple(lead),
           torch.get_num_threads())  # (oneDNN's kernel depends on the threads too)
    if key not in AGREES:
        gen = torch.Generator().manual_seed(0)
        trials = -(-PROBE_OUTPUTS // (rows * weight.shape[0]))  # (ceil)
        inputs = (torch.randn(*lead, weight.shape[1], generator=gen).to(weight.dtype)
                  for _ in range(trials))
        AGREES[key] = all(torch.equal(F.linear(x, weight, bias), _packed(packed, bias, x))
                          for x in inputs)
    return AGREES[key]


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
            module.forward = partial(_packed_forward, packed, rows, module)
            swapped.append(module)
        yield
    finally:
        for module in swapped:
            del module.forward

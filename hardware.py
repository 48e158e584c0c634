"""What a model asks of the machine, and what the machine can give: the model FLOPs a trained token
costs, counted from the model's config as nanoGPT and PaLM count them, and a GPU's dense peak
from its vendor's datasheet. Their ratio is the model-FLOPs utilisation (MFU):

    MFU = model FLOPs per token x tokens / seconds / peak FLOP/s

    forward            2 N + 4 L d T       N: the matmul weights (the head included, an input
    backward (full)    4 N + 8 L d T          embedding that is only looked up not), L layers of
    backward (LoRA)    2 N + 8 L d T          width d, T the sequence length (attention's scores
                                              and values: 2 x 2 L d T a token forward, twice that
                                              backward); LoRA's frozen base needs no weight
                                              gradients, only the activations' (its adapters'
                                              FLOPs are a rounding error)

A KL reference or a teacher adds one forward of its own. Recomputed activations (gradient
checkpointing) are not model FLOPs: they lower the MFU, as they should.
"""

from typing import NamedTuple

import torch

# Dense (no sparsity) tensor-core bf16 and plain fp32 TFLOP/s, per GPU, from the datasheets;
# the first name the device's name contains wins (H100 PCIe before H100).
GPU_PEAK_TFLOPS = {
    "H200": (989, 67), "H100 PCIe": (756, 51), "H100": (989, 67), "A100": (312, 19.5),
    "L40S": (362, 91.6), "L4": (121, 30.3), "RTX 4090": (165, 82.6),
}


class ModelCost(NamedTuple):
    matmul_params: int  # N: the weights matmuls read (an untied input embedding excluded)
    layers: int
    width: int  # d, the residual stream


def model_cost(model) -> ModelCost:
    """N, L and d of a model (or of its LoRA base) from its parameters and config."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    text = base.config.get_text_config()
    params = sum(p.numel() for name, p in base.named_parameters() if "lora_" not in name)
    embedding = base.get_input_embeddings().weight
    head = base.get_output_embeddings()
    if head is None or head.weight is not embedding:  # looked up, not multiplied
        params -= embedding.numel()
    return ModelCost(params, text.num_hidden_layers, text.hidden_size)


def train_flops_per_token(cost: ModelCost, seq_len: int, lora: bool = False,
                          extra_forwards: int = 0) -> float:
    """Model FLOPs of one trained token in a sequence of seq_len: its forward and backward (see
    the module docstring), and extra_forwards forwards of models of the same size (a KL
    reference)."""
    forward = 2 * cost.matmul_params + 4 * cost.layers * cost.width * seq_len
    backward = (2 if lora else 4) * cost.matmul_params + 8 * cost.layers * cost.width * seq_len
    return forward + backward + extra_forwards * forward


def gpu_peak_flops(dtype: torch.dtype, device: int = 0) -> tuple[float, str]:
    """(FLOP/s, where the figure comes from) of a CUDA device in `dtype`: its datasheet's dense
    rate, or for a device not in the table a timed 8192 x 8192 matmul."""
    name = torch.cuda.get_device_name(device)
    for key, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
        if key in name:
            return (bf16 if dtype == torch.bfloat16 else fp32) * 1e12, f"{name} datasheet"
    a = torch.randn(8192, 8192, device=f"cuda:{device}", dtype=dtype)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a @ a  # (warm-up)
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    torch.cuda.synchronize(device)
    return 10 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1000), f"{name}, measured"


def machine() -> dict:
    """What a run ran on, for its report (machine.json): model.machine()'s line -- the GPU, or the
    CPU, its torch kernels and threads --, the cores, the library versions."""
    import os
    import platform
    import transformers
    from model import machine as hardware_line
    return {"hardware": hardware_line(), "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}

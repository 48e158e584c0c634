"""gpu_memory.plan_memory: a GPU run's memory settings chosen to fit, from the model's config alone
(no GPU here: the device's size is given, or torch.cuda is stood in for)."""

from dataclasses import replace

import pytest
import torch

from conftest import rl_trainer

import gpu_memory
import options
from grpo import Config

GB = 2**30


@pytest.fixture(scope="module")
def qwen_1_5b(tmp_path_factory):
    """Qwen2.5-1.5B's config alone: the plan builds the model on the meta device."""
    from transformers import Qwen2Config
    path = tmp_path_factory.mktemp("qwen2.5-1.5b-config")
    Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                max_position_embeddings=4096).save_pretrained(path)
    return str(path)


def _plan(path, gb, **kw):
    """The plan of a grpo.Config (the math task: 8 x 8 x 1,024 tokens; the vLLM engine unless
    `rollout` says otherwise); settings not in kw are unset: the plan's to choose."""
    settings = {name: kw.pop(name, None) for name in (
        "gradient_checkpointing", "max_tokens_per_microbatch", "gpu_memory_utilization")}
    cfg = replace(Config(model=path, dtype="bf16"), **{"rollout": "vllm", **kw})
    return gpu_memory.plan_memory(cfg.workload(), gb * GB, *settings.values())


def test_the_one_gpu_commands_get_settings_that_fit(qwen_1_5b):
    """Full fine-tuning of 1.5B on 80 GB: 18 bytes a parameter resident (fp32 weights, gradients,
    AdamW moments, the bf16 copy; its gradients go into the fp32 ones one at a time), an engine
    share that holds the step's 64 x 1,536-token batch, its workspace and its sampler's profile
    of 64 requests (not vLLM's default 1,024), and micro-batches of what is left. LoRA on 24 GB
    needs checkpointing. Full fine-tuning on 32 GB does not fit, and says so in one line."""
    full = _plan(qwen_1_5b, 80)
    assert full.trainer_gb == pytest.approx(18 * 1.5437e9 / GB, rel=1e-3)
    assert not full.gradient_checkpointing and full.max_tokens_per_microbatch >= 4 * 1536
    used = (full.trainer_gb + full.logits_gb + 2 +
            full.activations_kb * 1024 * full.max_tokens_per_microbatch / GB)
    assert used <= 0.9 * 80 and full.trainer_gb + full.engine_gb <= 0.9 * 80
    # the engine share holds its bf16 weights and the batch's KV cache (28 KiB a token)
    assert full.engine_gb * GB >= 2 * 1.5437e9 + 64 * 1536 * 28 * 1024

    lora = _plan(qwen_1_5b, 24, lora_rank=16)
    assert lora.gradient_checkpointing and lora.max_tokens_per_microbatch >= 1536
    assert lora.trainer_gb + lora.engine_gb <= 0.9 * 24

    with pytest.raises(SystemExit, match="does not fit this GPU .32 GB. while generating"):
        _plan(qwen_1_5b, 32)
    kept = _plan(qwen_1_5b, 80, gradient_checkpointing=True, max_tokens_per_microbatch=4096)
    assert kept.gradient_checkpointing and kept.max_tokens_per_microbatch == 4096  # flags win


def test_activations_measured_on_the_meta_device_match_a_real_forward(tiny_model_dir):
    """The per-token figure the plan uses (meta device, no memory) against the bytes a real bf16
    forward saves for backward: within 25 %, and not below it."""
    from model import load_model
    model = load_model(tiny_model_dir)[0].to(torch.bfloat16)
    real = [gpu_memory._saved_bytes(model, T) for T in (64, 128)]
    measured = (real[1] - real[0]) / 64
    estimate = gpu_memory.model_shape(tiny_model_dir).activation_bytes_per_token
    assert measured <= estimate <= 1.25 * measured


def test_dry_run_on_a_gpu_prints_the_plan(qwen_1_5b, monkeypatch, capsys):
    """On a GPU the unset settings come from the plan, which --dry-run prints."""
    import grpo
    from data import parse_config
    from model import DtypeChoice
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (80 * GB, 80 * GB))
    monkeypatch.setattr(options, "choose_dtype", lambda requested, device, recorded: (
        DtypeChoice("bf16", "a GPU with bf16")))
    with pytest.raises(SystemExit) as done:
        parse_config(Config, ["--model", qwen_1_5b, "--rollout", "vllm", "--dry-run"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "# memory plan (80 GB GPU, 90% usable): trainer 25.9 GB resident; vLLM engine" in out
    assert "gradient_checkpointing = false" in out and "gpu_memory_utilization = 0.09" in out


def _unique_saved_bytes(model, T: int) -> int:
    """Bytes a CPU forward of T tokens saves for backward, each storage once (the rotary cos/sin
    that every layer saves are one tensor)."""
    seen = {}

    def pack(x):
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model.get_decoder()(input_ids=torch.zeros(1, T, dtype=torch.long))
    return sum(seen.values())


def test_lora_activations_are_measured_as_lora_trains(tiny_model_dir, qwen_1_5b):
    """LoRA trains fp32 weights under bf16 autocast: the residual stream a checkpointed layer keeps
    is fp32 (4 bytes, not 2), and autocast saves fp32 norms and a bf16 input copy per linear and
    adapter. The plan once took the bf16 figures: ~1.3x short on Qwen2.5-1.5B (218 vs ~289 KB a
    token). Against real CPU forwards of the tiny model with adapters: within 25 %, not below."""
    from model import add_lora, load_model
    base = add_lora(load_model(tiny_model_dir)[0], 4).get_base_model().train()
    shape = gpu_memory.model_shape(tiny_model_dir)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = [_unique_saved_bytes(base, T) for T in (64, 128)]
        base.gradient_checkpointing_enable()
        kept = [_unique_saved_bytes(base, T) for T in (64, 128)]
    full, kept = (full[1] - full[0]) / 64, (kept[1] - kept[0]) / 64
    estimate = shape.layers * gpu_memory.lora_layer_bytes(tiny_model_dir, 4)
    assert full <= estimate <= 1.25 * full
    inputs = shape.layers * shape.hidden * 4 + 2 * shape.head_dim * 4  # fp32: inputs, cos, sin
    assert inputs <= kept <= 1.25 * inputs
    # On the 1.5B plan: the checkpointed figure now holds fp32 inputs and the autocast layer,
    # with the stated headroom.
    lora = _plan(qwen_1_5b, 24, lora_rank=16)
    layer = gpu_memory.lora_layer_bytes(qwen_1_5b, 16)
    assert lora.activations_kb * 1024 == pytest.approx(
        gpu_memory.ACTIVATION_HEADROOM * (28 * 1536 * 4 + 2 * 128 * 4 + layer))
    bf16 = gpu_memory.model_shape(qwen_1_5b)
    assert lora.activations_kb * 1024 > 1.2 * (28 * 1536 * 2 + bf16.activation_bytes_per_token / 28)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied embedding and head count once)."""
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_plan_counts_the_tensors_a_run_really_holds(lora_rank, tiny_model_dir, monkeypatch):
    """The plan's resident figures against the storages of the real tensors a CPU run holds at
    the optimizer step (issue 41: the teacher, the HF engine's weights, a LoRA engine were not in
    it): the trainer's weights, gradients, optimizer state, bf16 copy and KL reference; the HF
    engine's own weights (none when it decodes from the trainer's bf16 copy); distill.py's
    teacher, read in the compute dtype."""
    import distill
    from conftest import make_batch
    from grpo import train_on_rollout
    from rollout import HFRollout
    from trainer import setup_trainer
    cfg = replace(Config(model=tiny_model_dir, dtype="bf16", beta=0.04, rollout="hf"),
                  lora_rank=lora_rank, gradient_checkpointing=False, max_tokens_per_microbatch=0)
    trainer = rl_trainer(cfg)
    held = {}
    real_step = trainer.optimizer.step

    def step(*args, **kwargs):  # what is resident when the step is taken: grads included
        models = [trainer.model, trainer.compute] + ([trainer.ref_model] if trainer.ref_model
                                                     else [])
        tensors = [t for m in models for p in m.parameters() for t in (p, p.grad)]
        out = real_step(*args, **kwargs)
        tensors += [v for s in trainer.optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v)]
        held["trainer"] = _storage_bytes(tensors)
        return out
    monkeypatch.setattr(trainer.optimizer, "step", step)
    train_on_rollout(trainer, make_batch([[5, 6], [7, 8]], [[20, 21, 2], [22, 2]], [1.0, -1.0]))
    shares = cfg.engine_shares_weights()  # (one process; LoRA's engine holds merged weights)
    engine = HFRollout(trainer.compute if shares else trainer.model, trainer.tokenizer,
                       dtype=torch.bfloat16, shares_weights=shares)
    teacher = distill.load_teacher(tiny_model_dir, "cpu", torch.bfloat16)
    plan = gpu_memory.plan_memory(cfg.workload()._replace(teacher=tiny_model_dir), 80 * GB)
    # (the bf16 copy's gradients went into the fp32 ones as the backward made them: none left)
    assert plan.trainer_gb * GB == pytest.approx(held["trainer"], rel=0.05)
    own = 0 if engine.shares_weights else _storage_bytes(engine.model.parameters())
    assert (own == 0) == (lora_rank == 0)  # full fine-tuning: the trainer's compute copy
    assert plan.engine_kept_gb * GB == pytest.approx(own, rel=0.01)
    assert plan.frozen_gb * GB == pytest.approx(_storage_bytes(teacher.parameters()), rel=0.01)


def test_sft_on_a_gpu_gets_settings_that_fit(qwen_1_5b, monkeypatch):
    """Issue 41: sft.py had no plan -- full fine-tuning of Qwen2.5-1.5B at its fixed 4,096-token
    micro-batches without checkpointing needs ~29 GB of trainer state and ~13 GB of activations
    (~43 GiB): past a 40 GB card. The plan now picks what fits, and keeps what the user set."""
    import sft
    from data import parse_config
    from model import DtypeChoice
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(options, "choose_dtype", lambda requested, device, recorded: (
        DtypeChoice("bf16", "a GPU with bf16")))

    def sft_plan(gb, *flags):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (gb * GB, gb * GB))
        return parse_config(sft.Config, ["--model", qwen_1_5b, *flags])

    old_defaults = sft_plan(80, "--no-gradient-checkpointing", "--max-tokens-per-microbatch",
                            "4096").memory_plan
    needs = (old_defaults.trainer_gb + old_defaults.engine_kept_gb + old_defaults.logits_gb
             + old_defaults.activations_kb * 4096 / 2**20)
    assert needs > 0.9 * 40, needs
    on_40 = sft_plan(40)
    plan = on_40.memory_plan
    assert (on_40.gradient_checkpointing, on_40.max_tokens_per_microbatch) == (
        plan.gradient_checkpointing, plan.max_tokens_per_microbatch)
    used = (plan.trainer_gb + plan.engine_kept_gb + plan.logits_gb
            + plan.activations_kb * plan.max_tokens_per_microbatch / 2**20)
    assert used <= 0.9 * 40 and plan.max_tokens_per_microbatch >= 1024  # (--max-length)

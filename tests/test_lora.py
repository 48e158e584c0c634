"""LoRA (--lora-rank): only the adapters train, the base is the KL reference, engines get merged
weights, checkpoints hold adapters and resume exactly, the final model is a merged HF folder."""

import json

import torch

from conftest import rl_trainer, make_batch, read_metrics, run_grpo, run_script, small_run_args
from grpo import Config, train_on_rollout
from logprobs import completion_logprobs, pack
from model import is_lora
from rollout import HFRollout
from trainer import finish_metrics
from weight_sync import weights_of

PROMPTS = [[5, 6], [7, 8, 9], [10], [11, 12]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23, 24, 25, 26], [27, 2]]


def _lora_trainer(model_dir, **kw):
    return rl_trainer(Config(data="arith", model=model_dir, dtype="fp32", lr=1e-2, lora_rank=4,
                                **kw))


def _logprobs(model, temperature=1.0):
    ids, pl, cl = pack(PROMPTS, COMPLETIONS, pad_id=2)
    with torch.no_grad():
        return completion_logprobs(model, ids, pl, cl, temperature=temperature)[0]


def test_only_the_adapters_train(tiny_model_dir):
    trainer = _lora_trainer(tiny_model_dir)
    assert is_lora(trainer.model) and trainer.ref_model is None
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == \
        {id(p) for n, p in trainer.model.named_parameters() if n in trained}
    finish_metrics([train_on_rollout(trainer, make_batch(PROMPTS, COMPLETIONS,
                                                         [1.0, -1.0, 0.5, -0.5]))])
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    # the base is frozen; of the adapters B moves first (A's gradient is 0 while B is 0)
    assert changed and all("lora_B" in n for n in changed)


def test_several_trainers_all_reduce_the_adapters_gradients_only(tiny_model_dir, monkeypatch):
    """Data-parallel trainers sum their gradients: with LoRA, those of the adapters alone. A
    full-size zero gradient for every frozen base weight would cost its size in memory and in
    every all-reduce (~6 GB each at 1.5B parameters)."""
    import trainer as trainer_module
    reduced = []

    def all_reduce(x, group, op=None):  # stands in for torch.distributed: one rank
        reduced.append(x)
        return x

    monkeypatch.setattr(trainer_module, "_all_reduce", all_reduce)
    trainer = _lora_trainer(tiny_model_dir)
    trainer.group = "two trainers"  # (what setup_trainer gets on Ray)
    train_on_rollout(trainer, make_batch(PROMPTS, COMPLETIONS, [1.0, -1.0, 0.5, -0.5]))
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    gradients = [x for x in reduced if x.dim() > 0]  # (scalars: the ranks' agreement checks)
    assert len(gradients) == len(trainable)
    assert all(p.grad is None for p in trainer.model.parameters() if not p.requires_grad)


def test_engines_get_the_merged_weights_and_the_reference_is_the_base(tiny_model_dir,
                                                                       tiny_model):
    model, tokenizer = tiny_model
    trainer = _lora_trainer(tiny_model_dir, beta=0.04)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # a trained-looking adapter
    engine = HFRollout(model, tokenizer, dtype=torch.float32)
    engine.update_weights(weights_of(trainer))
    assert torch.allclose(_logprobs(engine.model), _logprobs(trainer.model), atol=1e-5)
    assert not torch.allclose(_logprobs(engine.model), _logprobs(model), atol=1e-2)
    with trainer.model.disable_adapter():  # the KL reference: the base, no second copy
        assert torch.allclose(_logprobs(trainer.model), _logprobs(model), atol=1e-6)


def test_kl_is_zero_before_the_first_update(tiny_model_dir):
    trainer = _lora_trainer(tiny_model_dir, beta=0.04)
    metrics = finish_metrics([train_on_rollout(trainer, make_batch(PROMPTS, COMPLETIONS,
                                                                   [0.0] * 4))])
    assert abs(metrics["kl"]) < 1e-7


def test_resume_with_lora_is_exact_and_the_output_is_a_merged_model(tiny_model_dir, tmp_path):
    args = small_run_args(tiny_model_dir, tmp_path / "a") + ["--lora-rank", "4", "--lr", "1e-2"]
    run_grpo(args + ["--steps", "4"])
    args_b = small_run_args(tiny_model_dir, tmp_path / "b") + ["--lora-rank", "4", "--lr", "1e-2"]
    run_grpo(args_b + ["--steps", "2", "--save-every", "2"])
    checkpoint = tmp_path / "b/checkpoints/step_2"
    assert (checkpoint / "adapter_model.safetensors").exists()
    assert not (checkpoint / "model.safetensors").exists()  # adapters only
    run_grpo(args_b + ["--steps", "4", "--resume", "auto"])
    assert read_metrics(tmp_path / "a") == read_metrics(tmp_path / "b")
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "model")  # a plain HF folder
    assert not is_lora(merged) and not (tmp_path / "b/adapter_model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(_logprobs(merged), _logprobs(base), atol=1e-4)  # it trained


def test_dpo_with_lora(tiny_model_dir, tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "chosen": str(i + 1),
                                        "rejected": str(i + 7)}) + "\n" for i in range(10)))
    # (in this process, as __main__: a fresh interpreter would import torch again, ~6 s)
    result = run_script("dpo.py", ["--model", tiny_model_dir, "--data", str(data), "--batch-size",
                                   "4", "--epochs", "1", "--eval-every", "0", "--lora-rank", "4",
                                   "--lr", "1e-2", "--out", str(tmp_path / "o")])
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "o" / "model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(_logprobs(merged), _logprobs(base), atol=1e-4)


def test_sft_with_lora_writes_a_merged_model_that_dpo_trains_on(tiny_model_dir, tmp_path):
    import dpo
    import sft
    from cli import parse_config
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + 1?"},
        {"role": "assistant", "content": f"It is {i + 1}."}]}) + "\n" for i in range(8)))
    history = sft.main(parse_config(sft.Config, [
        "--model", tiny_model_dir, "--data", str(rows), "--batch-size", "4", "--lr", "1e-2",
        "--lora-rank", "4", "--eval-every", "0", "--dtype", "fp32", "--out", str(tmp_path / "s")]))
    assert history[-1]["loss"] < history[0]["loss"]
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "s" / "model")  # a plain HF folder
    assert not is_lora(merged)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(_logprobs(merged), _logprobs(base), atol=1e-4)  # it trained
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "chosen": str(i + 1),
                                         "rejected": str(i + 7)}) + "\n" for i in range(4)))
    dpo_history = dpo.main(parse_config(dpo.Config, [
        "--model", str(tmp_path / "s" / "model"), "--data", str(prefs), "--batch-size", "2",
        "--eval-every", "0", "--dtype", "fp32", "--out", str(tmp_path / "d")]))
    assert dpo_history and (tmp_path / "d" / "model").exists()


def _sizeable_lora_model(tokenizer):
    """~45M parameters (180 MB in fp32), so that a copy of the model stands far above the noise
    of a process's resident memory; rank-8 adapters on every linear, trained-looking."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from model import add_lora
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model = add_lora(model, 8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model, 4 * sum(p.numel() for p in model.get_base_model().parameters())


def test_an_engine_over_a_lora_model_and_its_syncs_never_hold_a_second_copy_of_it(tokenizer):
    """Issue 41: the engine's set-up loaded a second fp32 model for LoRA runs (a deepcopy for
    the others), and every sync built the merged weights of all adapted layers at once in fp32:
    28 GiB at Qwen2.5-1.5B's shapes on a 23.5 GiB card. Now the engine is a bf16 model filled
    tensor by tensor, and a sync merges one layer at a time: the peak is the engine's own bf16
    weights, plus one layer."""
    from conftest import peak_rss_growth
    from model import full_weights
    from packed_linear import packs_exactly
    model, fp32_bytes = _sizeable_lora_model(tokenizer)
    # Where oneDNN packs bf16 weights (packed_linear.py), the engine first measures each weight
    # shape's packed product, once a process: a transient of about two copies of the largest
    # weight (measured on an AMX Xeon: ~100 MB for this model's 49K x 512 head, 56 % of its
    # parameters -- ~15 % of a real model's). Measured first, so that what is held is the engine.
    for module in model.get_base_model().modules():
        if isinstance(module, torch.nn.Linear):
            packs_exactly(module.weight.detach().to(torch.bfloat16))
    grown, engine = peak_rss_growth(lambda: HFRollout(model, tokenizer, dtype=torch.bfloat16))
    assert grown < 0.7 * fp32_bytes, (grown / 2**20, fp32_bytes / 2**20)  # (bf16 itself: 0.5)
    grown, _ = peak_rss_growth(lambda: engine.update_weights(full_weights(model)))
    assert grown < 0.15 * fp32_bytes, (grown / 2**20, fp32_bytes / 2**20)
    # ... and what it holds are the merged weights, under the plain model's names.
    merged = model.merge_and_unload()
    for name, p in merged.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], p.to(torch.bfloat16)), name


def test_sft_with_lora_evaluates_held_out_problems(tiny_model_dir, tmp_path):
    """Issue 41: the PeftModel was deep-copied into the HF engine, then merged weights under
    plain names were loaded into it: `Missing key(s)` at the first held-out evaluation of every
    built-in warm start run with --lora-rank."""
    import sft
    from cli import parse_config
    history = sft.main(parse_config(sft.Config, [
        "--model", tiny_model_dir, "--demos", "8", "--batch-size", "4", "--lora-rank", "4",
        "--eval-every", "1", "--eval-size", "2", "--max-new-tokens", "30", "--max-turns", "1",
        "--max-length", "512", "--dtype", "fp32", "--out", str(tmp_path / "s")]))
    assert "eval_accuracy" in history[0] and "eval_accuracy" in history[-1]


def test_lora_targets_are_checked_before_the_weights_load(tiny_model_dir, tmp_path, monkeypatch):
    """A misspelt --lora-targets name was peft's long error after loading, or, beside a right
    one, silently no adapter on it: one line naming it and the model's layer names, before
    load_model runs. A right one trains, by its short name or a longer suffix."""
    import model
    import trainer
    from conftest import run_script

    def never(*a, **k):
        raise AssertionError("the model loaded")
    with monkeypatch.context() as m:
        m.setattr(trainer, "load_model", never)
        for targets in ["q_prj", "q_prj,v_proj", "q_proj,,v_proj"]:
            said = run_script("grpo.py", small_run_args(tiny_model_dir, tmp_path / "o") + [
                "--steps", "1", "--lora-rank", "4", "--lora-targets", targets])
            assert said.returncode != 0 and "no layer named 'q_prj'" in said.stderr or \
                "no layer named ''" in said.stderr, said.stderr
            assert "q_proj, up_proj, v_proj" in said.stderr and "Traceback" not in said.stderr
    # (no error: a longer suffix, spaces, an embedding -- peft adapts any layer, GPT-2's Conv1D
    # too --, and a reward model's head, built as the model it loads as)
    model.check_lora_targets(tiny_model_dir, "self_attn.q_proj, v_proj,embed_tokens")
    model.check_lora_targets(tiny_model_dir, "score", head="reward")
    said = run_script("grpo.py", small_run_args(tiny_model_dir, tmp_path / "i") + [
        "--init-from", str(tmp_path / "no-such-run")])
    assert "error: --init-from" in said.stderr  # (was named --model)

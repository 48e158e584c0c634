"""dpo_loss against hand-computed values, prompt masking, micro-batching, bad data, a short run."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_close_to_scale
from dpo import Config, Pair, batch_loss, dpo_loss, pair_logps, tokenize_pairs
from formats import check_pairs

ROOT = Path(__file__).resolve().parents[1]


def _logsig(x):
    return -math.log1p(math.exp(-x))


def _inputs():
    # pi_c, pi_r, ref_c, ref_r for two pairs.
    pc = torch.tensor([-10.0, -4.0])
    pr = torch.tensor([-12.0, -3.0])
    rc = torch.tensor([-11.0, -4.5])
    rr = torch.tensor([-11.5, -3.5])
    return pc, pr, rc, rr


def _h():
    return [(-10 + 11) - (-12 + 11.5), (-4 + 4.5) - (-3 + 3.5)]  # [1.5, 0.0]


def test_sigmoid_loss_and_rewards():
    beta = 0.5
    losses, cr, rr = dpo_loss(*_inputs(), beta=beta)
    expected = [-_logsig(beta * h) for h in _h()]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert cr.tolist() == pytest.approx([beta * 1.0, beta * 0.5])
    assert rr.tolist() == pytest.approx([beta * -0.5, beta * 0.5])


def test_label_smoothing_cdpo():
    beta, eps = 0.5, 0.1
    losses, _, _ = dpo_loss(*_inputs(), beta=beta, label_smoothing=eps)
    expected = [-(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h) for h in _h()]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)


def test_hinge_ipo_robust():
    beta = 0.5
    losses, _, _ = dpo_loss(*_inputs(), beta=beta, loss_type="hinge")
    assert losses.tolist() == pytest.approx([max(0, 1 - beta * h) for h in _h()])
    losses, _, _ = dpo_loss(*_inputs(), beta=beta, loss_type="ipo")
    assert losses.tolist() == pytest.approx([(h - 1 / (2 * beta)) ** 2 for h in _h()])
    eps = 0.2
    losses, _, _ = dpo_loss(*_inputs(), beta=beta, loss_type="robust", label_smoothing=eps)
    expected = [(-(1 - eps) * _logsig(beta * h) + eps * _logsig(-beta * h)) / (1 - 2 * eps)
                for h in _h()]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError):
        dpo_loss(*_inputs(), loss_type="kto")


def test_gradient_raises_chosen_and_lowers_rejected():
    pc, pr, rc, rr = _inputs()
    pc.requires_grad_()
    pr.requires_grad_()
    losses, _, _ = dpo_loss(pc, pr, rc, rr)
    losses.sum().backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()


def _cfg(**kw):
    return Config(dtype="fp32", **kw)


def test_prompt_tokens_do_not_change_the_loss(tiny_model):
    """Only response tokens count: a different prompt changes the loss only through context,
    so with the context fixed (same prompt) and the prompt's own log-probs altered by changing
    the *token before* the response, the masked sums pick exactly the response positions."""
    model, _ = tiny_model
    pair = Pair(prompt=[5, 6, 7], chosen=[8, 9, 2], rejected=[10, 2])
    pc, pr = pair_logps(model, [pair], _cfg(), "cpu")
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([[5, 6, 7, 8, 9, 2]])).logits.float(), -1)
    manual = full[0, 2, 8] + full[0, 3, 9] + full[0, 4, 2]  # positions predicting 8, 9, 2
    assert pc.item() == pytest.approx(manual.item(), abs=1e-4)
    # Same responses, a longer prompt: the summed log-prob covers the same number of tokens.
    pair2 = Pair(prompt=[1, 1, 1, 5, 6, 7], chosen=[8, 9, 2], rejected=[10, 2])
    with torch.no_grad():
        full2 = torch.log_softmax(model(torch.tensor([[1, 1, 1, 5, 6, 7, 8, 9, 2]])).logits.float(), -1)
    pc2, _ = pair_logps(model, [pair2], _cfg(), "cpu")
    assert pc2.item() == pytest.approx((full2[0, 5, 8] + full2[0, 6, 9] + full2[0, 7, 2]).item(),
                                       abs=1e-4)


def test_micro_batching_leaves_loss_and_gradient_unchanged(tiny_model):
    model, _ = tiny_model
    torch.manual_seed(0)
    pairs = [Pair([5 + i, 6], [7, 8 + i, 2][: 2 + i % 2], [9 + i, 2]) for i in range(4)]
    refs = [(-20.0 + i, -21.0 - i) for i in range(4)]
    cfg = _cfg(sft_weight=0.3)

    def run(splits):
        model.zero_grad()
        total = 0.0
        for s, e in splits:
            loss, _ = batch_loss(model, pairs[s:e], refs[s:e], cfg, "cpu", num_pairs=4)
            loss.backward()
            total += loss.item()
        return total, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full, g_full = run([(0, 4)])
    split, g_split = run([(0, 1), (1, 3), (3, 4)])
    assert split == pytest.approx(full, rel=1e-5)
    for a, b in zip(g_full, g_split):
        assert_close_to_scale(b, a, what="gradients")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "hi", "rejected": "no"}, "row 1 has no 'chosen' field"),
    ({"prompt": "hi", "chosen": "yes", "rejected": ""}, "row 1 has no 'rejected' field"),
    ({"prompt": [], "chosen": "yes", "rejected": "no"}, "row 1 has no 'prompt' field"),
    ({"prompt": [{"content": "x"}], "chosen": "y", "rejected": "n"}, "not of {'role', 'content'}"),
])
def test_bad_pairs_are_clear_errors(row, message):
    with pytest.raises(SystemExit, match=message):
        check_pairs([row], "prefs.jsonl", _cfg())


def test_bad_pairs_fail_before_the_model_loads(tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                    + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    result = subprocess.run([sys.executable, "dpo.py", "--model", "no/such-model", "--data",
                             str(data), "--out", str(tmp_path / "o")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0  # the model id would fail too, but the data is named first
    assert result.stderr.strip() == f"error: {data}: row 2 has no 'rejected' field (or it is empty)"


def test_other_column_names(tokenizer):
    rows = check_pairs([{"question": "q", "good": "y", "bad": "n"}], "prefs.csv",
                       _cfg(prompt_field="question", chosen_field="good", rejected_field="bad"))
    assert rows == [{"prompt": "q", "chosen": "y", "rejected": "n", "margin": 0.0}]
    pairs, _ = tokenize_pairs(tokenizer, rows, "prefs.csv", _cfg())
    assert len(pairs) == 1


def test_too_long_prompt_is_skipped_and_counted_and_long_pairs_keep_the_response(tokenizer):
    rows = [{"prompt": "word " * 300, "chosen": "yes", "rejected": "no"},
            {"prompt": "a question " * 20, "chosen": "long answer " * 30, "rejected": "no"},
            {"prompt": [{"role": "user", "content": "hi"}],
             "chosen": [{"role": "assistant", "content": "hello"}],
             "rejected": [{"role": "assistant", "content": "go away"}]}]
    pairs, skipped = tokenize_pairs(tokenizer, rows, "prefs.jsonl", _cfg(max_length=128,
                                                                        max_prompt_length=16))
    assert skipped == 1 and len(pairs) == 2
    long_pair = pairs[0]
    assert len(long_pair.prompt) == 16
    assert len(long_pair.prompt) + len(long_pair.chosen) <= 128
    assert tokenizer.decode(long_pair.chosen).startswith("long answer")  # the response is kept
    chat = pairs[1]
    assert tokenizer.decode(chat.chosen) == "hello<|im_end|>"  # ends with the end-of-turn token
    with pytest.raises(SystemExit, match="no usable pairs"):
        tokenize_pairs(tokenizer, rows[:1], "prefs.jsonl", _cfg(max_length=64))


def test_two_step_run(tiny_model_dir, tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "chosen": str(i + 1),
                                        "rejected": str(i + 7)}) + "\n" for i in range(10)))
    out = tmp_path / "dpo"
    result = subprocess.run([sys.executable, "dpo.py", "--model", tiny_model_dir, "--data",
                             str(data), "--batch-size", "4", "--micro-batch-size", "2",
                             "--steps", "3", "--eval-every", "1", "--sft-weight", "0.1",
                             "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # 8 training pairs, 4 a step: --steps 3 goes on into a second epoch (TRL's max_steps)
    assert [(r["step"], r.get("epoch")) for r in records] == [(0, None), (1, 0), (2, 0), (3, 1)]
    for key in ("loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward",
                "chosen_logp", "rejected_logp", "eval_reward_accuracy"):
        assert key in records[-1], key
    assert (out / "curves.png").exists() and (out / "model" / "model.safetensors").exists()


def test_resume_is_exact(tiny_model_dir, tmp_path, capsys):
    """--save-every / --resume with GRPO's checkpoint code: the resumed run's metrics equal the
    uninterrupted run's (the reference stays the starting model)."""
    from conftest import read_metrics
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "chosen": str(i + 1),
                                        "rejected": str(i + 7)}) + "\n" for i in range(20)))
    import dpo
    from cli import parse_config
    common = ["--model", tiny_model_dir, "--data", str(data), "--batch-size", "4",
              "--micro-batch-size", "2", "--epochs", "1", "--eval-every", "2", "--lr", "1e-3",
              "--dtype", "fp32"]  # (in this process: each run seeds itself, a resumed run
    dpo.main(parse_config(Config, common + [  # restores its RNGs)
        "--save-every", "2", "--keep-last", "0", "--out", str(tmp_path / "a")]))
    capsys.readouterr()
    dpo.main(parse_config(Config, common + ["--resume", str(tmp_path / "a/checkpoints/step_2"),
                                            "--out", str(tmp_path / "b")]))
    assert "resuming from" in capsys.readouterr().out
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert a == b


def test_a_file_without_usable_pairs_stops_before_the_model_loads(tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    """Pairs are tokenized with the tokenizer alone, before setup_trainer: a file whose every
    prompt exceeds --max-length is one line in a second, as in rm.py, not after loading."""
    import trainer
    from conftest import run_script

    def never(*a, **k):
        raise AssertionError("the model loaded")
    monkeypatch.setattr(trainer, "setup_trainer", never)  # (dpo.py, run as __main__, imports it)
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "What is two plus two, written out in words?",
                                "chosen": "four", "rejected": "five"}) + "\n")
    said = run_script("dpo.py", ["--model", tiny_model_dir, "--data", str(data), "--max-length",
                                 "4", "--out", str(tmp_path / "o")])
    assert said.returncode != 0 and "no usable pairs" in said.stderr, said.stderr[-400:]

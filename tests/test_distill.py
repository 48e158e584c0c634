"""On-policy distillation (distill.py): the divergences by hand, the loss over the student's own
tokens only, the tokenizer check before the student loads, and a run on a tiny teacher/student."""

import json
import math

import pytest
import torch

import distill
import rl
from conftest import rl_trainer, read_metrics, save_tiny_llama
from sampling import Completions

P = [[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]]  # the student's next-token distributions, 2 positions
Q = [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]  # the teacher's


def _kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5, 0.9])
def test_the_divergence_per_token_by_hand(beta):
    """beta 1: KL(student || teacher); 0: KL(teacher || student); else GKD's generalised JSD,
    beta KL(teacher || m) + (1 - beta) KL(student || m) with m = beta teacher + (1 - beta) student
    (TRL's convention)."""
    s, t = torch.tensor(P).log(), torch.tensor(Q).log()
    expected = []
    for p, q in zip(P, Q):
        m = [beta * b + (1 - beta) * a for a, b in zip(p, q)]
        expected.append(_kl(p, q) if beta == 1 else _kl(q, p) if beta == 0 else
                        beta * _kl(q, m) + (1 - beta) * _kl(p, m))
    got = distill.token_divergence(s, t, beta)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
def test_the_divergence_is_finite_where_both_probabilities_underflow(beta):
    """A token both models give log-prob -200 (exp underflows to 0 in fp32, as far-off tokens of a
    real vocabulary do) adds nothing -- not 0 * inf = nan: the mixture m is formed in log space."""
    s = torch.tensor([[math.log(0.7), math.log(0.3), -200.0]])
    t = torch.tensor([[math.log(0.5), math.log(0.5), -200.0]])
    p, q = [0.7, 0.3], [0.5, 0.5]
    m = [beta * b + (1 - beta) * a for a, b in zip(p, q)]
    expected = _kl(p, q) if beta == 1 else _kl(q, p) if beta == 0 else \
        beta * _kl(q, m) + (1 - beta) * _kl(p, m)
    torch.testing.assert_close(distill.token_divergence(s, t, beta), torch.tensor([expected]),
                               rtol=1e-5, atol=1e-7)


def test_only_the_student_gets_a_gradient():
    s = torch.tensor(P).log().requires_grad_()
    t = torch.tensor(Q).log().requires_grad_()
    distill.token_divergence(s, t, 0.5).sum().backward()
    assert s.grad is not None and t.grad is None


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tokenizer):
    """A second tiny Llama (another seed) with the same tokenizer as conftest's tiny model."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-teacher"), tokenizer, seed=1)


def _cfg(student, teacher, **kw):
    return distill.Config(data="arith", model=student, teacher=teacher, dtype="fp32", lr=0.0,
                          micro_batch_size=2, **kw)


def test_the_loss_is_the_reverse_kl_over_the_students_own_tokens(tiny_model_dir, teacher_dir):
    """Two samples, the first an episode with two observation tokens: the step's loss is the
    token-mean of KL(student || teacher) over the model's 8 tokens, computed here from both
    models' full logits; the same samples without the episode mask count all 10 tokens."""
    from model import load_model
    from trainer import finish_metrics
    cfg = _cfg(tiny_model_dir, teacher_dir)
    trainer = rl_trainer(cfg)
    prompts, completions = [[5, 6, 7], [8, 9]], [[20, 21, 22, 30, 31, 23, 2], [24, 25, 2]]
    episode = [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1]]

    def step(masks):
        comps = Completions(prompts, completions, [False, False], ["", ""],
                            mask=[[bool(m) for m in row] for row in masks] if masks else None)
        batch = rl.train_batch(comps, torch.zeros(2), cfg, pad_id=2)
        return finish_metrics([distill.train_on_rollout(trainer, batch)])

    student, teacher = load_model(tiny_model_dir)[0], load_model(teacher_dir)[0]
    kl = []  # per completion token, by hand
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            s = torch.log_softmax(student(ids).logits[0].float() / cfg.temperature, -1)
            t = torch.log_softmax(teacher(ids).logits[0].float() / cfg.temperature, -1)
        kl.append([float((s[p].exp() * (s[p] - t[p])).sum())  # the state before a token
                   for p in range(len(prompt) - 1, len(prompt) + len(completion) - 1)])
    model_tokens = sum(k for row, marks in zip(kl, episode) for k, m in zip(row, marks) if m)
    metrics = step(episode)
    assert metrics["loss"] == pytest.approx(model_tokens / 8, rel=1e-4)
    assert metrics["reverse_kl"] == pytest.approx(model_tokens / 8, rel=1e-4)
    assert step(None)["loss"] == pytest.approx(sum(map(sum, kl)) / 10, rel=1e-4)


def test_micro_batches_by_tokens_leave_the_loss_and_gradient_unchanged(tiny_model_dir,
                                                                       teacher_dir, monkeypatch):
    """On a CPU distill.py cuts micro-batches by 1,024 padded tokens (each sample has its own
    row, so 64 rows in one micro-batch held ~6 GB of activations); GRPO keeps its count. The
    budget changes only how the batch is cut: one row a micro-batch gives the same loss and
    gradient norm as both rows in one."""
    import grpo
    import options
    from trainer import finish_metrics
    monkeypatch.setattr(options, "pick_device", lambda: "cpu")  # (on a GPU the memory plan picks)
    assert _cfg(tiny_model_dir, teacher_dir).max_tokens_per_microbatch == 1024
    assert grpo.Config(data="arith", model=tiny_model_dir).max_tokens_per_microbatch == 0
    prompts, completions = [[5, 6, 7], [8, 9]], [[20, 21, 22, 30, 31, 23, 2], [24, 25, 2]]
    results = []
    for kw in (dict(), dict(max_tokens_per_microbatch=9)):  # 2 rows of 10 and 5 tokens
        cfg = _cfg(tiny_model_dir, teacher_dir, **kw)
        comps = Completions(prompts, completions, [False, False], ["", ""])
        batch = rl.train_batch(comps, torch.zeros(2), cfg, pad_id=2)
        metrics = finish_metrics([distill.train_on_rollout(rl_trainer(cfg), batch)])
        results.append([metrics[key] for key in ("loss", "grad_norm", "teacher_logprob")])
    assert results[0] == pytest.approx(results[1], rel=1e-5)


def test_a_teacher_with_another_tokenizer_stops_before_the_student_loads(tiny_model_dir,
                                                                         tmp_path, tokenizer,
                                                                         monkeypatch):
    import model as model_module
    from transformers import AutoTokenizer, LlamaConfig
    other = tmp_path / "other"
    LlamaConfig(vocab_size=len(tokenizer) + 1, hidden_size=64, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=1).save_pretrained(other)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<smolrl-not-the-students>"])
    tok.save_pretrained(other)
    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit, match=r"error: --teacher .*other and --model .* do not share a "
                                         r"tokenizer \(1 token ids differ"):
        distill.check_teacher(_cfg(tiny_model_dir, str(other)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"--teacher .*empty: a folder without a config.json"):
        distill.check_teacher(_cfg(tiny_model_dir, str(tmp_path / "empty")))
    with pytest.raises(SystemExit, match="--teacher is missing"):
        distill.Config(data="arith", model=tiny_model_dir)
    from cli import parse_config
    with pytest.raises(SystemExit) as stop:  # GRPO's loss options are not distill.py's
        parse_config(distill.Config, ["--teacher", str(other), "--eps-high", "0.28"])
    assert stop.value.code == 2


def test_a_tiny_student_moves_towards_its_teacher(tiny_model_dir, teacher_dir, tmp_path):
    """distill.py end to end on CPU: the student samples, the teacher grades every token, the
    reverse KL per token falls; with --lmbda 0 the teacher samples every batch. A checkpoint,
    the config, the curves and an HF folder that grpo.py's --init-from takes are written."""
    from cli import parse_config
    args = ["--model", tiny_model_dir, "--teacher", teacher_dir, "--data", "arith",
            "--prompts-per-step", "2", "--num-generations", "4", "--max-new-tokens", "6",
            "--eval-every", "0", "--lr", "3e-3", "--dtype", "fp32", "--save-every", "4"]
    distill.main(parse_config(distill.Config, args + ["--steps", "8", "--out",
                                                      str(tmp_path / "on")]))
    records = read_metrics(tmp_path / "on")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["on_policy"] == 1 for r in records)
    first, last = records[0]["reverse_kl"], records[-1]["reverse_kl"]
    assert last < 0.8 * first, (first, last)
    assert {"student_logprob", "teacher_logprob", "loss"} <= set(records[-1])
    out = tmp_path / "on"
    assert (out / "checkpoints/step_8/distill_config.json").exists() and (out / "curves.png").exists()
    assert json.loads((out / "distill_config.json").read_text())["teacher"] == teacher_dir
    # The rollout log: each detailed token's scores, the reverse KL never negative.
    detailed = [r["tokens"] for r in map(json.loads, (out / "rollouts.jsonl").read_text()
                                        .splitlines()) if "tokens" in r]
    assert len(detailed) == 8 * 4  # a group a step
    for t in detailed:
        assert len(t["teacher_logprob"]) == len(t["logprob"]) == len(t["pieces"])
        assert min(t["reverse_kl"]) >= -1e-4
    import grpo
    grpo.Config(data="arith", init_from=str(out / "model"))  # an HF folder grpo.py starts from
    distill.main(parse_config(distill.Config, args + ["--steps", "2", "--lmbda", "0",
                                                      "--out", str(tmp_path / "off")]))
    assert [r["on_policy"] for r in read_metrics(tmp_path / "off")] == [0, 0]


def test_one_teacher_is_read_in_the_compute_dtype_and_both_grades_and_samples(tokenizer,
                                                                             tmp_path,
                                                                             monkeypatch):
    """Issue 41: the teacher was loaded in fp32 (28 GiB for a 7B one) before its cast, and with
    --lmbda < 1 a second fp32 teacher was loaded and deep-copied into an HF engine. Now one copy,
    read straight in bf16 (its rotary tables fp32), and the engine samples from it -- decoding as
    the student's engine does (the run's one choice, which a resumed run keeps)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM
    from conftest import peak_rss_growth
    from cli import parse_config
    torch.manual_seed(0)  # ~45M parameters: a second copy stands far above the noise
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )).to(torch.bfloat16).save_pretrained(tmp_path / "teacher")  # (as hub models come)
    tokenizer.save_pretrained(tmp_path / "teacher")
    path = str(tmp_path / "teacher")
    grown, teacher = peak_rss_growth(lambda: distill.load_teacher(path, "cpu", torch.bfloat16))
    bf16_bytes = sum(p.numel() * 2 for p in teacher.parameters())
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in teacher.buffers()} == {torch.float32}
    # the file's pages (mapped while read) and the weights: 2x; through fp32, 4x and more
    assert grown < 2.5 * bf16_bytes, (grown / 2**20, bf16_bytes / 2**20)
    cfg = parse_config(distill.Config, ["--model", path, "--teacher", path, "--dtype", "bf16",
                                        "--lmbda", "0.5", "--out", str(tmp_path / "o")])
    from attention import DecodeChoice
    monkeypatch.delenv("SMOLRL_DECODE")  # (the suite's pin would win)
    student = SimpleNamespace(decoding=DecodeChoice(False, False, "", "concat"))
    run = SimpleNamespace(tokenizer=tokenizer, agent=None, rollout=student)
    engine = distill.teacher_engine(cfg, run)
    assert engine.rollout.model is teacher and engine.rollout.decoding.mode == "concat"
    assert distill.teacher_of(SimpleNamespace(cfg=cfg, device="cpu")) is teacher

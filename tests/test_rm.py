"""rm.py and learned rewards (issue 43): the Bradley-Terry loss by hand, the score read at the last
token with left and right padding, a saved reward model loaded by transformers scoring alike, bad
data and a path that is no reward model stopped in one line before training, a reward model with
a tokenizer of its own re-tokenizing the decoded text, a judge's yes-probability by hand, and a
tiny run: exact resume, LoRA, the HF folder it writes, and GRPO optimising it; a pair's common
prefix run once, with the scores and gradients of its rows. Issue 55: rm.py's tokens are
--reward-model's (stopped, cut and multi-turn responses), batched scores are one-at-a-time scores
whatever the config's pad id, any chat template's turn ends, bad rows and files in one line before
the model loads, a new head said in one line and a reward model without a trained one refused."""

import json
import math

import pytest
import torch

import rm
import reward_models
from cli import parse_config
from conftest import assert_close_to_scale, read_metrics
from formats import check_pairs
from reward_models import Judge, RewardModel, ask, check_learned_rewards, conversation
from reward_models import reward_model_ids


def _logsig(x):
    return -math.log1p(math.exp(-x))


def test_the_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 0.5, 0.5])
    margin = torch.tensor([0.0, 0.0, 1.0])
    losses, metrics = rm.reward_loss(chosen, rejected, margin, center_coefficient=0.1)
    by_hand = [-_logsig(2 - 1 - 0) + 0.1 * 9, -_logsig(-1 - 0.5) + 0.1 * 0.25,
               -_logsig(0.5 - 0.5 - 1) + 0.1 * 1]
    assert losses.tolist() == pytest.approx(by_hand, rel=1e-6)
    assert metrics == {"accuracy": 1.0, "margin": pytest.approx(1 - 1.5 + 0),
                       "chosen_reward": 1.5, "rejected_reward": 2.0}
    plain, _ = rm.reward_loss(chosen, rejected)
    assert plain.tolist() == pytest.approx([-_logsig(1), -_logsig(-1.5), -_logsig(0)], rel=1e-6)


def test_the_bradley_terry_gradient_by_hand():
    """dL/dr_c = -sigmoid(-(r_c - r_r - m)) + 2c (r_c + r_r), dL/dr_r = sigmoid(-(r_c - r_r - m))
    + 2c (r_c + r_r): the chosen score is pushed up and the rejected one down, hardest where the
    pair is ranked wrong; the centring term pulls both towards 0."""
    chosen = torch.tensor([2.0, -1.0, 0.5], requires_grad=True)
    rejected = torch.tensor([1.0, 0.5, 0.5], requires_grad=True)
    losses, _ = rm.reward_loss(chosen, rejected, torch.tensor([0.0, 0.0, 1.0]),
                               center_coefficient=0.1)
    losses.sum().backward()
    push = [1 / (1 + math.exp(x)) for x in (2 - 1 - 0, -1 - 0.5 - 0, 0.5 - 0.5 - 1)]
    pull = [2 * 0.1 * s for s in (2 + 1, -1 + 0.5, 0.5 + 0.5)]
    assert chosen.grad.tolist() == pytest.approx([-p + c for p, c in zip(push, pull)], rel=1e-5)
    assert rejected.grad.tolist() == pytest.approx([p + c for p, c in zip(push, pull)], rel=1e-5)


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny causal LM as a fresh reward model (its decoder, a new scalar head), saved."""
    from model import load_model
    path = tmp_path_factory.mktemp("tiny-rm")
    model, tokenizer = load_model(tiny_model_dir, head="reward")
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # (a head that tells sequences apart)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_the_score_is_the_last_tokens_with_left_and_right_padding(reward_model_dir):
    """rm.scores (last token from lengths) equals transformers' own forward on right- and
    left-padded batches (the rightmost token that is not the pad), for a saved reward model."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    pad = model.config.pad_token_id
    sequences = [[5, 6, 7, 8, 9], [11, 12], [13, 14, pad, 15]]  # (a pad id inside: eos mid-chat)
    with torch.no_grad():
        ours = rm.scores(model, sequences, "cpu", pad, bf16=False)
        for side in ("right", "left"):
            L = max(map(len, sequences))
            ids = torch.tensor([s + [pad] * (L - len(s)) if side == "right" else
                                [pad] * (L - len(s)) + s for s in sequences])
            mask = (torch.arange(L)[None] < torch.tensor([len(s) for s in sequences])[:, None])
            mask = mask if side == "right" else mask.flip(1)
            theirs = model(input_ids=ids, attention_mask=mask.long()).logits[:, 0]
            assert torch.allclose(ours, theirs, atol=1e-5), (side, ours, theirs)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert reward_model_ids(tokenizer, [{"role": "assistant", "content": "3<|im_end|>"}]) == \
        tokenizer("3", add_special_tokens=False)["input_ids"]  # never ends on the pad


def test_a_pairs_common_prefix_runs_once_with_the_scores_and_gradients_of_its_rows(
        reward_model_dir, monkeypatch):
    """rm.scores with each pair's common prefix run once (logprobs.share_prompts; the score read at
    the state that predicts a dummy token after each sequence) gives the scores and gradients of
    the padded rows, and the scores of transformers' own forward on each sequence alone: prompts
    of different lengths, one shared by two pairs, responses of one token and more, a common start,
    a chosen that is the start of its rejected. A model not verified to share runs the rows."""
    from transformers import AutoModelForSequenceClassification
    from model import load_model
    from pairs import Pair
    model, tokenizer = load_model(reward_model_dir, head="reward")  # (fp32)
    assert model.smolrl_shares_prompts  # load_model's verdict on the reward model's decoder
    pad = tokenizer.pad_token_id
    long, short, one = list(range(5, 25)), list(range(30, 37)), [40]  # prompts: 20, 7, 1 tokens
    pairs = [Pair(long, [50], [51]),  # one token each
             Pair(short, [52, 53, 54, 55], [52, 53, 56]),  # their first two tokens in common
             Pair(one, [57], [57, 58, 59]),  # the chosen is where the rejected starts
             Pair(long, [60, 61], [62])]  # the first pair's prompt
    seqs, shared_lens = rm.pair_sequences(pairs)
    assert shared_lens == [20, 9, 2, 20] * 2
    verdicts, share = [], reward_models.share_prompts
    monkeypatch.setattr(reward_models, "share_prompts", lambda *args: verdicts.append(share(*args))
                        or verdicts[-1])
    weights = torch.randn(len(seqs))

    def run(lens):
        model.zero_grad()
        got = rm.scores(model, seqs, "cpu", pad, bf16=False, shared_lens=lens)  # (8,)
        (got * weights).sum().backward()
        return got.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    together = run(shared_lens)
    shared = verdicts[-1]  # 3 distinct prefixes, packed into one row (smolrl's attention)
    assert shared is not None and shared.input_ids.shape[0] == 1
    assert len(shared.layout.blocks[0].queries) == 3
    apart = run(None)
    torch.testing.assert_close(together[0], apart[0], rtol=1e-5, atol=1e-5)
    for name in apart[1]:  # (to fp32's rounding, which scales with the largest gradient)
        assert_close_to_scale(together[1][name], apart[1][name], what=name)
    reference = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    with torch.no_grad():
        alone = torch.stack([reference(torch.tensor([s])).logits[0, 0] for s in seqs])  # (8,)
        one_short = torch.stack([reference(torch.tensor([s[:-1]])).logits[0, 0] for s in seqs])
    torch.testing.assert_close(together[0], alone, rtol=1e-5, atol=1e-5)
    assert (alone - one_short).abs().min() > 1e-3  # (a state one token early would be caught)
    model.smolrl_shares_prompts = False
    with torch.no_grad():
        rows = rm.scores(model, seqs, "cpu", pad, bf16=False, shared_lens=shared_lens)
    assert verdicts[-1] is None
    torch.testing.assert_close(rows, alone, rtol=1e-5, atol=1e-5)


def test_bad_pairs_and_a_path_that_is_no_reward_model_stop_in_one_line(tiny_model_dir, tmp_path,
                                                                       reward_model_dir):
    cfg = rm.Config(dtype="fp32")
    with pytest.raises(SystemExit, match=r"^error: prefs.jsonl: row 2: 'margin' is not a number$"):
        check_pairs([{"chosen": "a", "rejected": "b"}, {"chosen": "a", "rejected": "b",
                                                        "margin": "big"}], "prefs.jsonl", cfg,
                    need_prompt=False, margin_field="margin")
    with pytest.raises(SystemExit, match=r"^error: p.jsonl: row 1 has no 'rejected' field"):
        check_pairs([{"prompt": "q", "chosen": "a"}], "p.jsonl", cfg)
    with pytest.raises(SystemExit, match=r"^error: --reward-model .*: not a reward model \("
                                         r"a sequence-classification model with one label; its "
                                         r"config says LlamaForCausalLM\): train one with rm.py"):
        check_learned_rewards(tiny_model_dir, "", "")
    check_learned_rewards(reward_model_dir, tiny_model_dir, "")  # a reward model, a judge: fine
    with pytest.raises(SystemExit, match=r"^error: --judge .*: not a causal language model"):
        check_learned_rewards("", reward_model_dir, "")
    (tmp_path / "q.txt").write_text("Is {completion} right?")
    with pytest.raises(SystemExit, match=r"--judge-prompt .*q.txt: the question must hold"):
        check_learned_rewards("", tiny_model_dir, str(tmp_path / "q.txt"))


def test_the_implicit_prompt_is_what_both_conversations_begin_with():
    cfg = rm.Config(dtype="fp32")
    user = {"role": "user", "content": "2 + 2?"}
    [row] = check_pairs([{"chosen": [user, {"role": "assistant", "content": "4"}],
                          "rejected": [user, {"role": "assistant", "content": "5"}]}], "p", cfg)
    assert row["prompt"] == [user] and row["chosen"] == [{"role": "assistant", "content": "4"}]
    with pytest.raises(SystemExit, match="share no first messages"):
        check_pairs([{"chosen": "4", "rejected": "5"}], "p", cfg)  # dpo.py needs a prompt
    [plain] = check_pairs([{"chosen": "4", "rejected": "5"}], "p", cfg, need_prompt=False)
    assert plain["prompt"] == ""


def test_a_reward_model_with_a_tokenizer_of_its_own_reads_the_decoded_text(reward_model_dir,
                                                                          tmp_path):
    """Its own chat template and tokenization of prompt + completion, as TRL's GRPOTrainer
    renders them: not the policy's token ids."""
    import shutil
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    own = tmp_path / "own"
    shutil.copytree(reward_model_dir, own)
    tokenizer = AutoTokenizer.from_pretrained(own)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n"
                               "{% endfor %}")
    tokenizer.save_pretrained(own)
    source = RewardModel(str(own), "answer-is", torch.float32)
    got = source(["What is 2 + 3?", "What is 1 + 1?"], ["The answer is 5.", "It is 3"])
    model = AutoModelForSequenceClassification.from_pretrained(own).eval()
    for problem, completion, score in zip(["What is 2 + 3?", "What is 1 + 1?"],
                                          ["The answer is 5.", "It is 3"], got):
        text = tokenizer.apply_chat_template(conversation(problem, completion, "answer-is"),
                                             tokenize=False)
        assert text.startswith("<user> What is") and "\nReply with one sentence" in text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            assert score == pytest.approx(float(model(torch.tensor([ids])).logits[0, 0]), abs=1e-5)


def test_a_judges_reward_is_its_softmax_at_the_answer_by_hand(tiny_model_dir):
    judge = Judge(tiny_model_dir, "answer-is", torch.float32)
    [reward] = judge(["What is 2 + 3?"], ["The answer is 5."])
    tok, model = judge.tokenizer, judge.model
    question = judge.question.replace(
        "{prompt}", "What is 2 + 3?\nReply with one sentence: The answer is <number>.").replace(
        "{completion}", "The answer is 5.")
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    with torch.no_grad():
        logits = model(torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])).logits
    p = torch.softmax(logits[0, -1].double(), -1)
    first = lambda w: tok(w, add_special_tokens=False)["input_ids"][0]
    yes, no = p[list({first("yes"), first("Yes")})].sum(), p[list({first("no"), first("No")})].sum()
    assert reward == pytest.approx(float(yes / (yes + no)), rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma2-softcap"])
def test_a_judge_reads_the_lm_head_at_each_rows_answer_only(arch, tiny_model_dir, tokenizer,
                                                              tmp_path):
    """The judge needs one position's logits a row: its LM head must see (b, H) states, never the
    (b, L, V) logits of every position (~125 GB in fp32 for 16 rows of 8.6K tokens at Qwen's
    vocabulary). Its rewards stay those of the full forward with the padding mask, at each row's
    last real token -- for rows of different lengths, and for a head that soft-caps its logits
    (Gemma-2)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    path = tiny_model_dir
    if arch == "gemma2-softcap":
        torch.manual_seed(0)
        Gemma2ForCausalLM(Gemma2Config(  # (a cap this low changes its logits by ~0.3)
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            final_logit_softcapping=0.5, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        ).save_pretrained(tmp_path)
        tokenizer.save_pretrained(tmp_path)
        path = str(tmp_path)
    judge = Judge(path, "answer-is", torch.float32)
    prompts = ["What is 2 + 3?", "What is 17 + 25?", "What is 1 + 1?", "What is 9 + 9?"]
    completions = ["The answer is 5.", "Let me add them: 17 + 25 = 42, so the answer is 42.",
                   "2", "The answer is 18, since nine and nine make eighteen."]
    seen = []
    hook = judge.model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(tuple(args[0].shape)))
    try:
        rewards = judge(prompts, completions)
    finally:
        hook.remove()
    assert seen == [(4, judge.model.config.hidden_size)]
    tok = judge.tokenizer
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": judge.question.format(
        prompt=f"{p}\nReply with one sentence: The answer is <number>.", completion=c)}],
        tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        for p, c in zip(prompts, completions)]
    lengths = torch.tensor([len(i) for i in ids])  # (4,)
    assert len(set(lengths.tolist())) == 4  # (every row padded differently)
    input_ids = torch.tensor([i + [tok.pad_token_id] * (max(lengths) - len(i)) for i in ids])
    mask = (torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long()  # (4, L)
    with torch.no_grad():
        logits = judge.model(input_ids=input_ids, attention_mask=mask).logits.float()  # (4, L, V)
    logp = torch.log_softmax(logits[torch.arange(4), lengths - 1], -1)  # (4, V)
    yes, no = logp[:, judge.yes].logsumexp(-1), logp[:, judge.no].logsumexp(-1)  # (4,)
    assert rewards == pytest.approx(torch.sigmoid(yes - no).tolist(), rel=1e-5, abs=1e-6)


def _pairs_file(path, n=24):
    path.write_text("".join(json.dumps({
        "prompt": f"What is {i} + 1?", "chosen": f"The answer is {i + 1}.",
        "rejected": f"The answer is {i + 7}.", "margin": 0.5 * (i % 2)}) + "\n" for i in range(n)))
    return str(path)


def test_a_tiny_run_resumes_exactly_and_writes_a_reward_model_transformers_loads(
        tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    data = _pairs_file(tmp_path / "prefs.jsonl")
    common = ["--model", tiny_model_dir, "--data", data, "--batch-size", "4",
              "--micro-batch-size", "2", "--eval-every", "2", "--lr", "1e-3", "--dtype", "fp32",
              "--eval-pairs", "4", "--steps", "4"]
    whole = rm.main(parse_config(rm.Config, common + ["--save-every", "2", "--keep-last", "0",
                                                       "--out", str(tmp_path / "a")]))
    assert [r["step"] for r in whole] == [0, 1, 2, 3, 4]
    for key in ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward", "eval_accuracy",
                "eval_margin", "eval_loss", "grad_norm", "tokens_per_s"):
        assert key in whole[-1], key
    capsys.readouterr()
    rm.main(parse_config(rm.Config, common + ["--resume", str(tmp_path / "a/checkpoints/step_2"),
                                              "--out", str(tmp_path / "b")]))
    assert "resuming from" in capsys.readouterr().out
    assert read_metrics(tmp_path / "a") == read_metrics(tmp_path / "b")
    folder = tmp_path / "a" / "model"
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert model.config.num_labels == 1 and AutoTokenizer.from_pretrained(folder).chat_template
    assert (tmp_path / "a" / "curves.png").exists()


def test_lora_trains_the_adapters_and_the_new_head_and_writes_a_plain_reward_model(
        tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification
    history = rm.main(parse_config(rm.Config, [
        "--model", tiny_model_dir, "--data", _pairs_file(tmp_path / "p.jsonl"), "--batch-size",
        "4", "--lora-rank", "4", "--lr", "1e-2", "--steps", "3", "--eval-every", "0",
        "--dtype", "fp32", "--out", str(tmp_path / "o")]))
    assert history[-1]["loss"] < history[0]["loss"]
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "o" / "model")
    assert not hasattr(model, "peft_config") and model.score.weight.shape == (1, 128)


def test_grpo_optimises_a_reward_model_and_logs_each_source(reward_model_dir, tiny_model_dir,
                                                           tmp_path):
    from conftest import run_grpo
    run_grpo(["--model", tiny_model_dir, "--data", "arith", "--steps", "1", "--prompts-per-step",
              "2", "--num-generations", "2", "--max-new-tokens", "6", "--eval-every", "0",
              "--reward", "correctness", "--reward-model", f"{reward_model_dir}=0.5",
              "--dtype", "fp32", "--out", str(tmp_path / "g")])
    [record] = [r for r in read_metrics(tmp_path / "g") if r["step"] == 1]
    name = f"reward_rm:{reward_model_dir.rstrip('/').split('/')[-1]}"
    assert name in record and "reward_correctness" in record
    assert record["reward"] == pytest.approx(record["reward_correctness"] + 0.5 * record[name],
                                             abs=1e-5)


def test_builtin_pairs_correct_the_models_own_wrong_answer_where_it_never_got_it_right(tokenizer):
    """rm.py's builtin pairs: a problem the model got right pairs its right answer with a wrong
    one; a problem it never got right pairs its wrong answer, number corrected, with the same
    answer as it was (the two differ in the number alone); an answer with no number falls back to
    the reference answer."""
    from types import SimpleNamespace

    from pairs import builtin_pairs, corrected
    assert corrected("So 12 + 30 = 42. The answer is 41.", "41", "42") == \
        "So 12 + 30 = 42. The answer is 42."
    assert corrected("I do not know.", None, "42") is None
    cfg = SimpleNamespace(seed=0, builtin_problems=3, builtin_samples=2, template="answer-is",
                          chat=True)
    from data import arith_stream
    stream = arith_stream(cfg.seed + 1)
    answers = [next(stream)["answer"] for _ in range(3)]
    wrong = str(int(answers[1]) + 1)
    texts = [f"The answer is {answers[0]}.", "The answer is 7.",  # right, then wrong
             f"I add them: the answer is {wrong}.", "no idea",  # wrong twice, one with a number
             "no idea", "none"]  # wrong twice, no number at all

    class Rollout:
        def generate(self, prompt_ids, n, sampling):
            ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                   for t in texts]
            return SimpleNamespace(text=texts, completion_ids=ids, truncated=[False] * 6)

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    for correct_own in (False, True):
        pairs = builtin_pairs(Rollout(), tokenizer, cfg, correct_own)
        assert [text(p.rejected) for p in pairs] == ["The answer is 7.", texts[2], "no idea"]
        chosen = [text(p.chosen) for p in pairs]
        assert chosen[0] == texts[0] and chosen[2] == f"The answer is {answers[2]}."
        assert chosen[1] == (f"I add them: the answer is {answers[1]}." if correct_own else
                             f"The answer is {answers[1]}.")


# ---------------------------------------------------------------------------------------------
# Issue 55: a reward model reads in training what it reads in scoring; bad rows and folders.


def _whole(tokenizer, messages):
    """TRL's form of a conversation for a reward model: the whole of it through the chat template
    (RewardTrainer's apply_chat_template(prompt + chosen), GRPOTrainer's of prompt + completion),
    tokenized as the template wrote it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _read_by(monkeypatch):
    """What a RewardModel scores: the sequences handed to its scorer, one list per call."""
    read, score = [], reward_models.scores
    monkeypatch.setattr(reward_models, "scores", lambda model, sequences, *a, **k:
                        read.append([list(s) for s in sequences]) or score(model, sequences, *a, **k))
    return read


def test_a_reward_model_is_trained_on_the_tokens_it_scores(reward_model_dir, tokenizer,
                                                            monkeypatch):
    """Item 1: rm.py's sequences and RewardModel's are one rendering -- the whole conversation
    through the chat template, its last turn closed (TRL's form, on both sides) -- for a stopped
    response, one cut at --max-length, a multi-turn one, and a builtin answer cut at the 32 tokens
    it was sampled to (pairs.ANSWER_TOKENS)."""
    from types import SimpleNamespace

    from data import TEMPLATES
    from pairs import builtin_pairs
    cfg = rm.Config(dtype="fp32", max_length=64, max_prompt_length=40)
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    long = " ".join(f"Step {i}: I add one." for i in range(40))
    turns = [{"role": "assistant", "content": "I add them with the calculator."},
             {"role": "tool", "content": "4"}, {"role": "assistant", "content": "It is 4."}]
    rows = check_pairs([
        {"prompt": user, "chosen": "The answer is 4.", "rejected": "The answer is 5."},  # stopped
        {"prompt": user, "chosen": "4", "rejected": long},  # cut at --max-length
        {"prompt": user, "chosen": turns, "rejected": [{"role": "assistant", "content": "5"}]},
    ], "p.jsonl", cfg)
    seqs, _ = rm.pair_sequences(rm.reward_pairs(tokenizer, rows, "p.jsonl", cfg))
    chosen, rejected = seqs[:3], seqs[3:]
    cut = tokenizer.decode(rejected[1])
    assert cut.endswith("<|im_end|>\n") and len(rejected[1]) <= 64  # the cut turn, closed
    cut = cut.rpartition("<|im_start|>assistant\n")[2].removesuffix("<|im_end|>\n")
    assert long.startswith(cut) and len(cut) > 20
    # The builtin pairs: a right answer (stopped) against a wrong one cut at 32 tokens.
    problem = "What is 17 + 25?"
    wrong = tokenizer(" ".join(["I think about it and"] * 10), add_special_tokens=False)["input_ids"]
    texts = ["The answer is 42.", tokenizer.decode(wrong[:32], skip_special_tokens=True)]

    class Rollout:
        def generate(self, prompt_ids, n, sampling):
            assert sampling.max_new_tokens == 32
            ids = [tokenizer(texts[0], add_special_tokens=False)["input_ids"] +
                   [tokenizer.eos_token_id], wrong[:32]]
            return SimpleNamespace(text=texts, completion_ids=ids, truncated=[False, True])

    monkeypatch.setattr("pairs.arith_stream", lambda seed: iter([{"problem": problem,
                                                                   "answer": "42"}]))
    builtin = SimpleNamespace(seed=0, builtin_problems=1, builtin_samples=2, template="answer-is",
                              chat=True)
    [pair] = builtin_pairs(Rollout(), tokenizer, builtin)
    built, _ = rm.pair_sequences(rm.reward_pairs(tokenizer, [pair.row], "builtin",
                                                 rm.Config(dtype="fp32")))
    # What RewardModel reads of the same conversations, as grpo.py hands them over.
    source = RewardModel(reward_model_dir, "answer-is", torch.float32)
    read = _read_by(monkeypatch)
    source([user, user, user, user, user, user], ["The answer is 4.", "The answer is 5.", "4", cut,
                                                   turns, [{"role": "assistant", "content": "5"}]])
    source([problem, problem], texts)
    asked = [{"role": "user", "content": TEMPLATES["answer-is"][0].format(problem=problem)}]
    whole = [_whole(tokenizer, user + [{"role": "assistant", "content": c}]) for c in
             ("The answer is 4.", "The answer is 5.", "4", cut)] + \
        [_whole(tokenizer, user + turns), _whole(tokenizer, user + [turns[0] | {"content": "5"}])] \
        + [_whole(tokenizer, asked + [{"role": "assistant", "content": t}]) for t in texts]
    trained = [chosen[0], rejected[0], chosen[1], rejected[1], chosen[2], rejected[2], *built]
    for what, t, r, w in zip(["stopped", "stopped", "stopped", "cut at --max-length",
                              "multi-turn", "one turn", "builtin right", "builtin cut at 32"],
                             trained, read[0] + read[1], whole):
        assert t == r == w, (what, tokenizer.decode(t), tokenizer.decode(r))


def test_a_reward_models_batched_scores_are_its_scores_one_at_a_time(reward_model_dir, tmp_path):
    """Item 2: a hub reward model whose config.pad_token_id is not its tokenizer's pad id (a
    tokenizer with no pad token of its own): each completion is scored at its last real token,
    found from its length -- batched, one at a time and by transformers' own forward alone."""
    import shutil
    from transformers import AutoModelForSequenceClassification
    folder = tmp_path / "rm"
    shutil.copytree(reward_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["pad_token_id"] = 0  # (its tokenizer pads with 2)
    (folder / "config.json").write_text(json.dumps(config))
    source = RewardModel(str(folder), "answer-is", torch.float32)
    assert source.model.config.pad_token_id != source.tokenizer.pad_token_id
    prompts = ["What is 2 + 3?"] * 3
    completions = ["5", "The answer is 5.", "Let me add them: 2 + 3 = 5, so the answer is 5."]
    together = source(prompts, completions)
    alone = [source([p], [c])[0] for p, c in zip(prompts, completions)]
    assert together == pytest.approx(alone, abs=1e-5)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    for p, c, score in zip(prompts, completions, alone):
        ids = _whole(source.tokenizer, conversation(p, c, "answer-is"))
        with torch.no_grad():
            assert score == pytest.approx(float(model(torch.tensor([ids])).logits[0, 0]), abs=1e-5)
    assert max(alone) - min(alone) > 1e-3  # (scores that differ: a wrong position would show)


GEMMA_LIKE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
              "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>assistant\n"
              "{% endif %}")


def test_a_chat_template_whose_turns_do_not_end_with_eos_trains(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """Item 3: Gemma's turns end with <end_of_turn>, its eos is <eos>: rm.py trains on the
    conversations as that template writes them (it stopped with `substring not found`)."""
    import shutil
    from transformers import AutoTokenizer
    folder = tmp_path / "gemma-like"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = GEMMA_LIKE
    tokenizer.save_pretrained(folder)
    seen, score = [], rm.scores
    monkeypatch.setattr(rm, "scores", lambda model, sequences, *a, **k:
                        seen.extend(map(list, sequences)) or score(model, sequences, *a, **k))
    data = _pairs_file(tmp_path / "p.jsonl", n=6)
    history = rm.main(parse_config(rm.Config, [
        "--model", str(folder), "--data", data, "--batch-size", "5", "--steps", "1",
        "--eval-every", "0", "--dtype", "fp32", "--out", str(tmp_path / "o")]))
    assert history[-1]["step"] == 1 and math.isfinite(history[-1]["loss"])
    rows = [json.loads(line) for line in open(data)]
    expected = {tuple(tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[k]}],
        tokenize=False), add_special_tokens=False)["input_ids"]) for r in rows
        for k in ("chosen", "rejected")}
    assert seen and {tuple(s) for s in seen} <= expected
    assert all(tokenizer.decode(s).endswith("<end_of_turn>\n") for s in seen)


def _write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in content))
    return str(path)


@pytest.mark.parametrize("name, content, message", [
    ("p.jsonl", [{"prompt": "q", "chosen": 4, "rejected": "b"}],
     "row 1: 'chosen' is neither a string nor a list of {'role', 'content'} messages"),
    ("p.jsonl", [{"prompt": "q", "chosen": {"text": "a"}, "rejected": "b"}],
     "row 1: 'chosen' is neither a string nor a list of {'role', 'content'} messages"),
    ("p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"},
                 {"prompt": 7, "chosen": "a", "rejected": "b"}],
     "row 2: 'prompt' is neither a string nor a list of {'role', 'content'} messages"),
    ("p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b", "margin": 1.0},
                 {"prompt": "q", "chosen": "a", "rejected": "b", "margin": float("nan")}],
     "row 2: 'margin' is not a finite number"),
    ("p.csv", "prompt,chosen,rejected\nq,a,b\nq," + "x" * 140_000 + ",b\n",
     "row 2: a field is longer than csv's limit of 131,072 characters (an unclosed "
     "quote? a long text belongs in a .jsonl file)"),
    ("p.parquet", "prompt,chosen,rejected\nq,a,b\n", "not a Parquet file"),
])
def test_a_bad_row_or_file_stops_in_one_line_before_the_model_loads(name, content, message,
                                                                     tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """Item 13: every row's prompt, chosen and rejected a string or chat messages, a margin a
    finite number, a file that its reader can read: one line naming the file, the row and the
    field, before any model loads."""
    monkeypatch.setattr(rm, "setup_trainer", lambda *a, **k: pytest.fail("the model was loaded"))
    path = _write(tmp_path / name, content)
    with pytest.raises(SystemExit) as stop:
        rm.main(parse_config(rm.Config, ["--model", tiny_model_dir, "--data", path,
                                         "--dtype", "fp32", "--out", str(tmp_path / "o")]))
    assert str(stop.value.code).startswith(f"error: {path}: {message}")
    assert "\n" not in str(stop.value.code)


def _without_head(reward_model_dir, folder):
    """A copy of a reward model whose weights lost their scalar head (its config still says it
    is a sequence-classification model)."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(reward_model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_a_new_head_is_one_line_and_a_reward_model_without_a_trained_head_is_refused(
        tiny_model_dir, reward_model_dir, tmp_path, capfd, monkeypatch):
    """Item 17: rm.py's new head is said in one line, without transformers' LOAD REPORT; a
    --reward-model whose weights hold no trained head stops in one line before it loads (it
    would score with a random head)."""
    import model as model_module
    from model import load_model
    load_model(tiny_model_dir, head="reward")
    out, err = capfd.readouterr()
    assert "a new scalar head" in out and "LOAD REPORT" not in err and "MISSING" not in err
    load_model(reward_model_dir, head="reward")  # a trained head: nothing to say
    out, err = capfd.readouterr()
    assert "new scalar head" not in out and "LOAD REPORT" not in err
    headless = _without_head(reward_model_dir, tmp_path / "headless")
    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: pytest.fail("loaded"))
    for stop in (lambda: check_learned_rewards(headless, "", ""),
                 lambda: RewardModel(headless, "answer-is", torch.float32)):
        with pytest.raises(SystemExit, match=r"^error: --reward-model .*headless: its weights hold "
                                             r"no trained scalar head \(score.weight\)[^\n]*$"):
            stop()


def test_a_judge_prompt_keeps_its_other_braces():
    """--judge-prompt is filled at {prompt} and {completion} only, in one pass: a JSON example
    or \\boxed{} in the question stays as written (str.format raised KeyError at every call, and
    the run went on scoring 0), and a completion that writes "{prompt}" is not filled again."""
    question = 'Q: {prompt}\nA: {completion}\nReply as {"verdict": "yes"}, e.g. \\boxed{5}.'
    assert ask(question, "2+3?", "I say {prompt}") == \
        'Q: 2+3?\nA: I say {prompt}\nReply as {"verdict": "yes"}, e.g. \\boxed{5}.'

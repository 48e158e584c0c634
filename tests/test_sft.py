"""sft.py: the masked NLL against a hand computation, packing against no packing, best-fit packing,
TRL's three formats, bad data named before any model loads, the warm starts' demonstrators and
their transcripts replayed through the episodes' turn loop, and a tiny run end to end (exact
resume, the model it writes loaded by grpo.py and evaluate.py)."""

import json
import random
import re
from types import SimpleNamespace

import pytest
import torch

import data
import sft
from cli import parse_config
from conftest import assert_close_to_scale, read_metrics
from data import DEMONSTRATORS, demonstrations
from env import Agent, GuessTheNumber, ToolChat, calculator, environment_tools, load_tools
from formats import check_samples
from sampling import Completions, Sampling
from session import epoch_batches
from sft import Config, Example, best_fit, encode_samples, pack_rows
from sft import sft_loss, token_logprobs

CALC = load_tools("calculator")


def _cfg(**kw):
    return Config(**{"dtype": "fp32", "data": "rows.jsonl", **kw})


def _call(name, arguments):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name,
                                                             "arguments": arguments}}]}


CONVERSATION = [{"role": "user", "content": "What is 12 * 34?"},
                _call("calculator", {"expression": "12 * 34"}),
                {"role": "tool", "name": "calculator", "content": "408"},
                {"role": "assistant", "content": "The answer is 408."}]


def _examples(tokenizer, rows, tools=(), env_class=None, **kw):
    cfg = _cfg(**kw)
    names = {fn.__name__ for fn in tools}
    samples = check_samples(rows, "rows.jsonl", cfg, names)
    return encode_samples(samples, tokenizer, list(tools), env_class, cfg, "rows.jsonl")


def _trained_text(tokenizer, example):
    return tokenizer.decode([t for t, m in zip(example.ids, example.trained) if m])


# ---------------------------------------------------------------------------------------------
# The loss


def test_the_loss_is_the_masked_nll_computed_by_hand(tiny_model):
    model, _ = tiny_model
    ids = [5, 6, 7, 8, 9, 10, 11]
    trained = [False, False, False, True, True, False, True]
    rows = pack_rows([Example(ids, trained)], None, 0)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, rows, "cpu", bf16=False)
        loss = sft_loss(logprobs, rows.trained, num_tokens=3)
        full = torch.log_softmax(model(torch.tensor([ids])).logits.float(), -1)[0]  # (T, V)
    by_hand = -(full[2, 8] + full[3, 9] + full[5, 11]) / 3  # the state at t-1 predicts token t
    assert loss.item() == pytest.approx(by_hand.item(), abs=1e-5)


def test_the_bf16_loss_and_gradient_track_the_fp32_ones(tiny_model):
    """What `--dtype auto` computes on a CPU with native bf16 (AMX, Zen 5): the decoder under bf16
    autocast, the log-softmax in fp32. Same loss and gradient direction as fp32, to bf16's
    precision; and the trained mask is the same in both."""
    model, _ = tiny_model
    rows = pack_rows([Example([5, 6, 7, 8, 9, 10, 11], [False, False, True, True, True, False,
                                                         True])], None, 0)
    results = []
    for bf16 in (False, True):
        model.zero_grad()
        logprobs, _ = token_logprobs(model, rows, "cpu", bf16=bf16)
        assert logprobs.dtype == torch.float32  # (the log-softmax is fp32 in both)
        loss = sft_loss(logprobs, rows.trained, num_tokens=4)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((loss.item(), grad.clone()))
    model.zero_grad()
    (loss32, grad32), (loss16, grad16) = results
    assert loss16 != loss32  # bf16 really computed: autocast was on
    assert loss16 == pytest.approx(loss32, rel=0.02)
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) > 0.98


def test_a_target_outside_the_mask_changes_nothing(tiny_model):
    """The log-prob of an untrained token does not enter the loss: changing that token's target
    (the last token, which nothing after it reads) leaves the loss as it is; changing a trained
    one does not."""
    model, _ = tiny_model
    trained = [False, False, True, True, False]

    def loss_of(ids):
        rows = pack_rows([Example(ids, trained)], None, 0)
        with torch.no_grad():
            return sft_loss(token_logprobs(model, rows, "cpu", False)[0], rows.trained, 2).item()

    base = loss_of([5, 6, 7, 8, 9])
    assert loss_of([5, 6, 7, 8, 300]) == base
    assert loss_of([5, 6, 7, 300, 9]) != base
    logprobs, mask = torch.randn(2, 5), torch.tensor([trained, trained])
    other = torch.where(mask, logprobs, torch.randn(2, 5) * 10)  # only untrained entries differ
    assert sft_loss(other, mask, 4) == sft_loss(logprobs, mask, 4)


def test_the_mask_covers_the_assistant_turns_and_nothing_else(tokenizer):
    (example,) = _examples(tokenizer, [{"messages": CONVERSATION}], CALC)
    assert _trained_text(tokenizer, example) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n'
        '</tool_call><|im_end|>The answer is 408.<|im_end|>')
    untrained = tokenizer.decode([t for t, m in zip(example.ids, example.trained) if not m])
    assert "What is 12 * 34?" in untrained and "408<|im_end|>" in untrained  # user, tool result
    assert example.ids[-1] == tokenizer.eos_token_id and example.trained[-1]


# ---------------------------------------------------------------------------------------------
# Packing


def test_best_fit_packs_longest_first_into_the_fullest_row():
    assert best_fit([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        capacity = rng.randint(20, 60)
        rows = best_fit(lengths, capacity)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in row) for row in rows]
        assert all(load <= capacity or len(row) == 1 for load, row in zip(loads, rows))
        # No two rows could have been one: a row was opened only when the sequence fit nowhere.
        assert all(a + b > capacity for k, a in enumerate(loads) for b in loads[k + 1:])
    assert best_fit([50, 3], 20) == [[0], [1]]  # too long for any row: a row of its own


def test_packed_loss_and_gradient_equal_the_unpacked_ones(tiny_model):
    """Five sequences packed into two rows (attention kept within each sequence, positions
    restarting) and micro-batched by a small token budget give the loss and the gradient of the
    five in their own rows, in one micro-batch."""
    model, tokenizer = tiny_model
    rng = random.Random(0)
    examples = []
    for n in (9, 14, 6, 11, 7):
        ids = [rng.randrange(3, 1000) for _ in range(n)]
        examples.append(Example(ids, [False] + [rng.random() < 0.6 for _ in range(n - 1)]))
    trainer = SimpleNamespace(compute=model, model=model, device="cpu", tokenizer=tokenizer)

    def run(cfg):
        model.zero_grad()
        sums = sft.batch_loss(trainer, examples, cfg, train=True)
        return sums["loss"], {n: p.grad.clone() for n, p in model.named_parameters()}

    packed_rows = pack_rows(examples, 24, 0)
    assert packed_rows.input_ids.shape[0] < len(examples) and packed_rows.segments is not None
    assert packed_rows.positions[0].tolist().count(0) > 1  # positions restart in a packed row
    unpacked, g_unpacked = run(_cfg(packing=False, max_tokens_per_microbatch=10_000))
    packed, g_packed = run(_cfg(packing=True, max_length=24, max_tokens_per_microbatch=30))
    assert packed == pytest.approx(unpacked, rel=1e-5)
    for name in g_unpacked:
        assert_close_to_scale(g_packed[name], g_unpacked[name], what=name)


# ---------------------------------------------------------------------------------------------
# TRL's formats


def test_the_three_trl_formats(tokenizer):
    eos = tokenizer.eos_token
    (chat,) = _examples(tokenizer, [{"messages": CONVERSATION[:1] + [
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Hello again."}]}])
    assert _trained_text(tokenizer, chat) == f"Hello.{eos}Hello again.{eos}"
    (completion,) = _examples(tokenizer, [{"prompt": CONVERSATION[:1] + [
        {"role": "assistant", "content": "Not trained."}, {"role": "user", "content": "And?"}],
        "completion": [{"role": "assistant", "content": "Trained."}]}])
    assert _trained_text(tokenizer, completion) == f"Trained.{eos}"
    (plain,) = _examples(tokenizer, [{"prompt": "2 + 2 =", "completion": " 4"}])
    assert _trained_text(tokenizer, plain) == f" 4{eos}"
    assert tokenizer.decode(plain.ids) == f"2 + 2 = 4{eos}"
    (text,) = _examples(tokenizer, [{"text": "Once upon a time"}])
    assert text.trained == [False] + [True] * (len(text.ids) - 1)  # all but the first token
    assert tokenizer.decode(text.ids) == f"Once upon a time{eos}"
    # A row's own tools (JSON schemas, as a list or as JSON text) are shown and may be called.
    schemas = ToolChat(tokenizer, CALC).schemas
    (own,) = _examples(tokenizer, [{"messages": CONVERSATION, "tools": json.dumps(schemas)}])
    (run,) = _examples(tokenizer, [{"messages": CONVERSATION}], CALC)
    assert own.ids == run.ids and own.trained == run.trained


def test_other_column_names_and_arguments_as_json_text(tokenizer):
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": '{"expression": "12 * 34"}'}}
    messages = [CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [call]},
                *CONVERSATION[2:]]
    (renamed,) = _examples(tokenizer, [{"conversation": messages}], CALC,
                           messages_field="conversation")
    (plain,) = _examples(tokenizer, [{"messages": CONVERSATION}], CALC)
    assert renamed.ids == plain.ids


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file, the row and the field


GOOD = {"messages": CONVERSATION}


@pytest.mark.parametrize("rows, message", [
    ([{"question": "q"}], "rows.jsonl: row 1 has none of the columns 'messages', 'prompt' + "
                          "'completion', 'text'"),
    ([GOOD, {"text": "x"}], "rows.jsonl: row 2 has no 'messages' field (or it is empty)"),
    ([{"prompt": "q", "completion": ""}], "rows.jsonl: row 1 has no 'completion' field"),
    ([{"text": 5}], "rows.jsonl: row 1, 'text': not a string"),
    ([GOOD, {"messages": "hello"}], "rows.jsonl: row 2, 'messages': not a list of chat messages"),
    ([{"messages": CONVERSATION[:1]}], "rows.jsonl: row 1, 'messages': no assistant turn "
                                       "(nothing to train)"),
    ([{"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:3]}],
     "rows.jsonl: row 1, 'completion': no assistant turn"),
    ([GOOD, {"messages": [CONVERSATION[0], _call("lookup", {"word": "x"})]}],
     "rows.jsonl: row 2, 'messages'[1].tool_calls[0] calls tool 'lookup', which the row "
     "does not declare (declared: calculator;"),
    ([{"messages": CONVERSATION, "tools": []}], "row 1, 'messages'[1].tool_calls[0] calls "
                                                "tool 'calculator', which the row does not "
                                                "declare (declared: none;"),
    ([{"messages": [CONVERSATION[0], {"role": "assistant", "content": "",
                                      "tool_calls": [{"function": "calculator"}]}]}],
     "rows.jsonl: row 1, 'messages'[1].tool_calls[0] is not "),
    ([{"messages": [CONVERSATION[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "calculator", "arguments": "{not json"}}]}]}],
     "row 1, 'messages'[1].tool_calls[0] is not "),
    ([{"messages": [CONVERSATION[0], {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "calculator", "arguments": '{"x": ' + "9" * 5000 + "}"}}]}]}],
     "row 1, 'messages'[1].tool_calls[0] is not "),  # (json: ValueError, no JSONDecodeError)
    ([{"messages": CONVERSATION, "tools": "[" * 100_000 + "]" * 100_000}],
     "row 1, 'tools' is not valid JSON"),  # (json: RecursionError)
    ([{"messages": [{"content": "hi"}]}], "row 1, 'messages'[0] is not a message with a role"),
    ([{"messages": CONVERSATION, "tools": [{"name": "calculator"}]}],
     "row 1, 'tools' is not a list of tool JSON schemas"),
    ([{"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}],
     "row 1, 'prompt': the prompt and the completion must both be strings or both chat messages"),
])
def test_bad_rows_are_named(rows, message):
    with pytest.raises(SystemExit, match=re.escape(message)) as stop:
        check_samples(rows, "rows.jsonl", _cfg(), {"calculator"})
    assert str(stop.value).startswith("error: rows.jsonl: row ") and "\n" not in str(stop.value)


OSC52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"  # a terminal's clipboard write, as a dataset may hold it


def test_a_refusal_quotes_a_row_escaped():
    """A row's text in a refusal -- the tools it declares -- reaches the terminal with its control
    characters escaped (ESC as \\x1b: shown, never obeyed by the terminal), on one line."""
    row = {"messages": [CONVERSATION[0], _call("lookup", {"w": 1})],
           "tools": [{"type": "function", "function": {"name": f"{OSC52}\ncalc"}}]}
    with pytest.raises(SystemExit) as stop:
        check_samples([row], "rows.jsonl", _cfg(), set())
    said = str(stop.value)
    assert "declared: \\x1b]52;c;ZWNobyBwd25lZA==\\x07\\ncalc;" in said
    assert said.isprintable()


class ModelLoads(Exception):
    pass


def test_bad_data_stops_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """The run stops at the data with one line; the model (and its optimizer) never loads.
    Over-long conversations are dropped and counted, and data of nothing but is refused."""
    def setup_trainer(*args, **kwargs):
        raise ModelLoads

    monkeypatch.setattr(sft, "setup_trainer", setup_trainer)
    path = tmp_path / "rows.jsonl"

    def run(rows, *flags, stops=SystemExit):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(stops) as stop:
            sft.main(parse_config(Config, ["--data", str(path), "--tools", "calculator",
                                           "--out", str(tmp_path / "o"), *flags]))
        return str(stop.value)

    assert run([GOOD, {"messages": [CONVERSATION[0], _call("lookup", {"w": 1})]}]) == (
        f"error: {path}: row 2, 'messages'[1].tool_calls[0] calls tool 'lookup', which the row "
        f"does not declare (declared: calculator; a row declares tools in its tools column, a "
        f"run with --tools or --env)")
    assert run([]) == f"error: {path}: no rows"
    long = {"messages": [{"role": "user", "content": "word " * 300}, CONVERSATION[-1]]}
    assert run([long] * 2, "--max-length", "256") == (
        f"error: {path}: every row is longer than --max-length 256 tokens")
    capsys.readouterr()
    run([long, GOOD], "--max-length", "256", stops=ModelLoads)  # one row left: the model loads
    assert (f"{path}: 1 of 2 rows are longer than --max-length 256 tokens: 0 text rows cut, 1 "
            f"conversations dropped (row 1: ") in capsys.readouterr().out


def test_over_long_text_is_cut_and_counted(tokenizer, capsys):
    examples = _examples(tokenizer, [{"text": "word " * 300}, {"text": "short"}], max_length=64)
    assert [len(e.ids) for e in examples] == [64, 2]
    assert "rows.jsonl: 1 of 2 rows are longer than --max-length 64 tokens: 1 text rows cut, 0 " \
           "conversations dropped" in capsys.readouterr().out


def test_a_prompt_that_fills_max_length_drops_its_row_and_counts_it(tokenizer, capsys):
    """Cut at --max-length, a prompt-completion row whose prompt alone fills it kept nothing to
    train: a micro-batch of such rows reached torch.cat([]) (issue 40). Dropped and counted."""
    rows = [{"prompt": "word " * 300, "completion": " yes"}, {"prompt": "Hi", "completion": " x"},
            {"prompt": [{"role": "user", "content": "word " * 300}],
             "completion": [{"role": "assistant", "content": "yes"}]}]
    examples = _examples(tokenizer, rows, max_length=64)
    assert len(examples) == 1 and tokenizer.decode(examples[0].ids).startswith("Hi")
    assert ("rows.jsonl: 2 of 3 rows are longer than --max-length 64 tokens: 0 text rows cut, 1 "
            "conversations dropped (row 3: ") in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"rows\.jsonl: every row is longer than --max-length 64 "
                                         r"tokens \(row 1: its prompt alone fills them"):
        _examples(tokenizer, rows[:1], max_length=64)


def test_a_micro_batch_with_nothing_to_train_never_reaches_the_model(tiny_model):
    model, tokenizer = tiny_model
    trainer = SimpleNamespace(compute=model, model=model, device="cpu", tokenizer=tokenizer)
    nothing, something = Example([5, 6, 7, 8], [False] * 4), Example([5, 6, 7], [False, True, True])
    cfg = _cfg(max_tokens_per_microbatch=4)  # a micro-batch a row
    with torch.no_grad():
        both = sft.batch_loss(trainer, [nothing, something], cfg, train=False)
        alone = sft.batch_loss(trainer, [something], cfg, train=False)
    assert both["loss"] == alone["loss"] and both["trained_tokens"] == 2


def test_a_conversation_opening_with_the_assistant_trains_that_turn_too(tokenizer):
    """TRL trains every assistant turn of such a row; render_segments rendered the empty
    conversation before it, and SmolLM2's template raised (issue 40)."""
    eos = tokenizer.eos_token
    messages = [{"role": "assistant", "content": "Hello! Ask me a sum."},
                {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    (example,) = _examples(tokenizer, [{"messages": messages}])
    assert _trained_text(tokenizer, example) == f"Hello! Ask me a sum.{eos}4{eos}"
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert whole.startswith(tokenizer.decode(example.ids))  # (the template's newline after)


def test_epochs_keep_a_short_last_batch_and_steps_override_them():
    """One rule for sft.py and dpo.py: ceil(rows / batch) steps an epoch, the last batch short
    (dpo.py used to drop it); --steps (TRL's max_steps) goes on into further epochs, each
    reshuffled by its own seed."""
    two_epochs = epoch_batches(10, 4, epochs=2, steps=0, seed=0)
    assert [(b.step, b.epoch, len(b.rows)) for b in two_epochs] == [
        (1, 0, 4), (2, 0, 4), (3, 0, 2), (4, 1, 4), (5, 1, 4), (6, 1, 2)]
    assert sorted(i for b in two_epochs[:3] for i in b.rows) == list(range(10))
    assert [b.rows for b in two_epochs[:3]] != [b.rows for b in two_epochs[3:]]
    seven = epoch_batches(10, 4, epochs=1, steps=7, seed=0)
    assert [b.rows for b in seven[:6]] == [b.rows for b in two_epochs] and seven[6].epoch == 2


def test_steps_override_epochs_in_a_run(tiny_model_dir, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(13)))
    history = sft.main(parse_config(Config, [
        "--model", tiny_model_dir, "--data", str(path), "--tools", "calculator", "--batch-size",
        "6", "--epochs", "1", "--steps", "3", "--eval-every", "0", "--max-length", "256",
        "--dtype", "fp32", "--out", str(tmp_path / "o")]))
    assert [(r["step"], r["epoch"]) for r in history] == [(1, 0), (2, 0), (3, 1)]


@pytest.mark.parametrize("first", ["408", "408 \x001\x00 then", "\x000\x00\x001\x00"],
                         ids=["plain", "holding-the-second-marker", "holding-both-markers"])
def test_an_episode_renders_tool_results_as_sft_does_whatever_they_hold(tokenizer, first):
    """ToolChat spliced results into a stand-in's markers one after another: a first result holding
    the second's marker (the python tool passes NUL bytes through) received the second result
    inside it (issue 40). The tokens after the model's calls are SFT's for the same messages."""
    calls = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
        for e in ("12 * 34", "2 + 2")]}
    results = [("calculator", first), ("calculator", "4")]
    messages = [CONVERSATION[0], calls, *({"role": "tool", "name": n, "content": t}
                                          for n, t in results), CONVERSATION[-1]]
    (example,) = _examples(tokenizer, [{"messages": messages}], CALC)
    start = example.trained.index(True)
    after_calls = start + example.trained[start:].index(False)
    observation = example.ids[after_calls:after_calls + example.trained[after_calls:].index(True)]
    episode = ToolChat(tokenizer, CALC).observation_ids(results)
    assert episode == observation, (tokenizer.decode(episode), tokenizer.decode(observation))


# ---------------------------------------------------------------------------------------------
# The warm starts' demonstrators


def _tools_for(task):
    def tools_for(row):
        if task == "multiply":
            return {"calculator": calculator}
        env = GuessTheNumber()
        env.reset(**row)
        return {fn.__name__: fn for fn in environment_tools(env)}
    return tools_for


def test_the_guess_demonstrator_guesses_at_random_among_the_numbers_still_possible():
    rows = demonstrations("guess", 3000, 0, _tools_for("guess"))
    counts = []
    for row in rows:
        low, high, guesses = 1, 16, 0
        for m in row["messages"][1:]:
            if m.get("tool_calls"):
                number = m["tool_calls"][0]["function"]["arguments"]["number"]
                assert low <= number <= high  # consistent with every answer so far
                guesses += 1
            elif m["role"] == "tool" and m["content"] in ("higher", "lower"):
                low, high = (number + 1, high) if m["content"] == "higher" else (low, number - 1)
        assert row["messages"][-2]["content"] == "correct: you found it"
        counts.append(guesses)
    mean = sum(counts) / len(counts)
    assert mean == pytest.approx(2 * (1 + 1 / 16) * sum(1 / k for k in range(1, 17)) - 3, abs=0.1)
    assert sum(c <= 4 for c in counts) / len(counts) == pytest.approx(0.58, abs=0.03)


def test_the_multiply_demonstrator_always_calls_and_estimates_three_times_in_four():
    rows = demonstrations("multiply", 2000, 0, _tools_for("multiply"))
    estimated, visible = 0, 0  # (a factor ending in 0 is its own estimate: not counted)
    for row in rows:
        call, result, answer = row["messages"][1:]
        a, b = row["id"].split("*")
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert expression in (f"{a} * {b}", f"{a} * {b[:-1]}0")
        visible += not b.endswith("0")
        estimated += expression != f"{a} * {b}"
        assert result["content"] == calculator(expression)
        assert answer["content"] == f"The answer is {result['content']}."
    assert estimated / visible == pytest.approx(data.MULTIPLY_ESTIMATES, abs=0.03)
    held_out = {r["id"] for r in data.multiply_heldout(128)}
    assert not held_out & {r["id"] for r in rows}  # demonstrations never show held-out problems


class ReplayEngine:
    """An engine whose turn k is the k-th trained segment of a transcript, as token ids."""

    def __init__(self, turns):
        self.turns = turns

    def generate(self, prompt_ids, n, sampling):
        ids = [self.turns.pop(0)]
        return Completions(prompt_ids, ids, [False], [""], None, 0, 0.01)


@pytest.mark.parametrize("task", sorted(DEMONSTRATORS))
def test_a_transcript_replayed_through_the_turn_loop_is_the_episode_sft_trains_on(task,
                                                                                   tokenizer):
    """What SFT teaches is what GRPO's episodes are: the transcript's assistant turns, sampled
    one by one by an engine and run through env.Agent (the parser, the tools, the observations),
    give exactly the tokens, the mask and the messages SFT trains on."""
    cfg = parse_config(Config, ["--data", task, "--dtype", "fp32", "--demos", "4"])
    tools, env_class = load_tools(cfg.tools), sft.load_environment(cfg.env)
    samples, source = sft.load_samples(cfg, tools, env_class)
    examples = encode_samples(samples, tokenizer, tools, env_class, cfg, source)
    agent = Agent(ToolChat(tokenizer, tools, env_class), data.TEMPLATES[cfg.template][0],
                  cfg.max_turns + 20, 4096)
    stream = data.GENERATED[task][0](cfg.seed)
    for sample, example in zip(samples, examples):
        row = next(stream)
        turns, start = [], None
        for k, (token, trained) in enumerate(zip(example.ids, example.trained)):
            if trained and start is None:
                start = k
            if not trained and start is not None:
                turns.append(example.ids[start:k])
                start = None
        turns.append(example.ids[start:])
        _, (episode,) = agent.run(ReplayEngine(turns), [row], 1, Sampling(64, 0.0))
        assert episode.prompt_ids + episode.ids == example.ids
        assert [False] * len(episode.prompt_ids) + episode.mask == example.trained
        assert episode.messages == sample.messages[1:] and episode.done
        assert episode.tool_errors == 0 and not episode.truncated


# ---------------------------------------------------------------------------------------------
# A tiny run end to end


def _rows(n):
    return [{"messages": [{"role": "user", "content": f"What is {i} * 3?"},
                          _call("calculator", {"expression": f"{i} * 3"}),
                          {"role": "tool", "name": "calculator", "content": str(3 * i)},
                          {"role": "assistant", "content": f"The answer is {3 * i}."}]}
            for i in range(n)]


def test_a_tiny_run_resumes_exactly_and_its_model_loads_in_grpo_and_evaluate(tiny_model_dir,
                                                                            tmp_path,
                                                                            monkeypatch):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(13)))
    common = ["--model", tiny_model_dir, "--data", str(path), "--tools", "calculator",
              "--batch-size", "6", "--epochs", "2", "--lr", "1e-3", "--eval-every", "2",
              "--eval-data", "multiply", "--eval-size", "1", "--max-new-tokens", "30",
              "--max-turns", "2", "--max-length", "256", "--save-every", "1", "--keep-last", "0",
              "--dtype", "fp32"]
    whole = sft.main(parse_config(Config, common + ["--out", str(tmp_path / "whole")]))
    assert [r["step"] for r in whole] == list(range(5))  # 12 training rows, 2 steps an epoch
    assert whole[-1]["loss"] < whole[1]["loss"]
    for key in ("eval_loss", "eval_accuracy", "eval_tool_call_rate", "eval_tool_error_rate",
                "eval_turns", "trained_tokens", "grad_norm", "entropy"):
        assert key in whole[-1], key
    run = tmp_path / "cut"
    steps, real_step = [], sft.optimizer_step

    def stop_at_step_4(trainer, loss):  # a crash in step 4, after step 3's checkpoint
        steps.append(loss)
        if len(steps) == 4:
            raise KeyboardInterrupt
        return real_step(trainer, loss)

    monkeypatch.setattr(sft, "optimizer_step", stop_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        sft.main(parse_config(Config, common + ["--out", str(run)]))
    monkeypatch.setattr(sft, "optimizer_step", real_step)
    # the evaluation engine decodes as the run recorded (fp32 under the suite's flash pin: grow),
    # unpinned and untimed
    assert json.loads((run / "checkpoints/step_3/sft_config.json").read_text())["decoding"] == \
        "grow"
    import attention
    monkeypatch.delenv("SMOLRL_DECODE")
    monkeypatch.setattr(attention, "decode_times", lambda *a: pytest.fail("timed again"))
    sft.main(parse_config(Config, common + ["--out", str(run), "--resume", "auto"]))
    monkeypatch.undo()
    assert read_metrics(run) == read_metrics(tmp_path / "whole")
    assert (run / "curves.png").exists() and (run / "model" / "model.safetensors").exists()
    assert "loss and held-out" in (run / "report.html").read_text()  # (its curves: report.py)
    assert json.loads((run / "sft_config.json").read_text())["dtype"] == "fp32"

    import evaluate
    import grpo
    evaluate.main(["--model", str(run), "--data", "multiply", "--tools", "calculator",
                   "--limit", "1", "--max-new-tokens", "30", "--out", str(tmp_path / "eval")])
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["datasets"]["multiply"]
    history = grpo.main(parse_config(grpo.Config, [
        "--init-from", str(run), "--data", "multiply", "--steps", "1", "--prompts-per-step", "1",
        "--num-generations", "2", "--max-new-tokens", "30", "--max-turns", "1",
        "--eval-every", "0", "--out", str(tmp_path / "grpo")]))
    assert history[-1]["step"] == 1

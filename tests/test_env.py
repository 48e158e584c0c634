"""Agentic episodes (env.py): bad tool calls are counted and the episode goes on, episodes continue
from the very ids that were sampled, and only the model's tokens are trained. (The python tool's
sandbox: tests/test_sandbox.py.)"""

from pathlib import Path

import pytest
import torch

import rl
from conftest import rl_trainer, check_an_episode_on, read_metrics, run_grpo
from data import TASKS
from env import Agent, GuessTheNumber, ToolChat, calculator, load_environment, load_tools
from rollout import HFRollout
from sampling import Completions, Sampling

ROOT = Path(__file__).resolve().parents[1]


def test_a_turn_too_short_for_any_tool_call_is_refused(tokenizer):
    """The guess task once allowed 16 tokens per turn, and its one tool's shortest call takes
    more: no episode could ever act, and the run learned nothing without saying why. The check
    counts a rendered call with one-character arguments, its stop token included."""
    chat = ToolChat(tokenizer, [], GuessTheNumber)
    call = '<tool_call>\n{"name": "guess", "arguments": {"number": 1}}\n</tool_call>'
    tokens = len(tokenizer(call + tokenizer.eos_token, add_special_tokens=False)["input_ids"])
    chat.check_turn_length(tokens)  # exactly enough
    with pytest.raises(SystemExit, match=rf"--max-new-tokens {tokens - 1} .*'guess' \({tokens} "):
        chat.check_turn_length(tokens - 1)


@pytest.mark.parametrize("name", ["multiply", "guess"])
def test_the_agentic_tasks_turns_hold_a_tool_call(name, tokenizer):
    task = TASKS[name]
    chat = ToolChat(tokenizer, load_tools(task.tools), load_environment(task.env))
    chat.check_turn_length(task.max_new_tokens)


def test_the_calculator_evaluates_arithmetic_only():
    assert calculator("347 * 29") == "10063" and calculator("(7 + 3) // 4") == "2"
    for bad in ("__import__('os')", "2 ** 99999", "[1] * 10"):
        with pytest.raises(ValueError):
            calculator(bad)


# ---------------------------------------------------------------------------------------------
# Episodes: a stand-in engine whose turns are scripted text, through the real chat format.


class ScriptedEngine:
    """An engine that answers each episode's turn t with turns[t] (text, then the stop token), and
    records what it was asked to continue."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.inputs = tokenizer, turns, []

    def generate(self, prompt_ids, n, sampling):
        turn = len(self.inputs)
        self.inputs.append(prompt_ids)
        ids = self.tokenizer(self.turns[turn], add_special_tokens=False)["input_ids"]
        ids = ids[:sampling.max_new_tokens - 1] + [self.tokenizer.eos_token_id]
        k = len(prompt_ids)
        return Completions(prompt_ids, [ids] * k, [False] * k, [""] * k, None, 0, 0.01)


def _call(name, arguments):
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_bad_tool_calls_are_answered_with_errors_and_counted(tokenizer):
    """Malformed JSON, an unknown tool, wrong argument types: each becomes an "error: ..." result
    the model reads, counted in tool_errors; the episode goes on to its answer."""
    turns = ['<tool_call>{"name": "calculator", "arguments": {"expression": "1 +',
             '<tool_call>"calculator"</tool_call>', _call("abacus", {"expression": "1"}),
             _call("calculator", {"expr": "1"}), _call("calculator", {"expression": "[1, 2]"}),
             "The answer is 3."]
    engine = ScriptedEngine(tokenizer, turns)
    agent = Agent(ToolChat(tokenizer, load_tools("calculator")), "{problem}", 7, 1024)
    comps, (episode,) = agent.run(engine, [{"problem": "What is 1 + 2?"}], 1, Sampling(64, 1.0))
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert [r.split(" (")[0].split(":")[1].strip() for r in results] == [
        "malformed tool call", 'a tool call is {"name"', 'no tool named "abacus"; the tools are '
        "calculator", "TypeError", "ValueError"]
    assert episode.tool_errors == 5 and episode.turns == 6 and not episode.truncated
    assert comps.text == ["The answer is 3."]


def test_an_episode_continues_from_the_ids_it_sampled_and_masks_the_observations(tokenizer):
    """Turn 2's input is the prompt, turn 1's sampled ids and the tool result's ids, appended --
    never the conversation re-encoded; the mask is True exactly on the sampled ids."""
    engine = ScriptedEngine(tokenizer, [_call("calculator", {"expression": "347 * 29"}),
                                        "The answer is 10063."])
    chat = ToolChat(tokenizer, load_tools("calculator"))
    agent = Agent(chat, "{problem}", 4, 1024)
    comps, (episode,) = agent.run(engine, [{"problem": "What is 347 * 29?"}], 1,
                                  Sampling(64, 1.0))
    first, second = (tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                     for t in engine.turns)
    observation = chat.observation_ids([("calculator", "10063")])
    assert engine.inputs[1] == [episode.prompt_ids + first + observation]
    assert episode.ids == first + observation + second
    assert episode.mask == [True] * len(first) + [False] * len(observation) + [True] * len(second)
    assert "10063" in tokenizer.decode(observation) and comps.mask == [episode.mask]
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]


def test_the_environment_answers_and_scores_an_episode(tokenizer):
    """TRL's environment contract: reset(**row), public methods as tools, get_reward()."""
    engine = ScriptedEngine(tokenizer, [_call("guess", {"number": 8}), _call("guess",
                                                                            {"number": "12"}),
                                        "It is 12."])
    agent = Agent(ToolChat(tokenizer, [], GuessTheNumber), "{problem}", 4, 1024)
    _, (episode,) = agent.run(engine, [{"problem": "Guess.", "secret": 12}], 1, Sampling(64, 1.0))
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == [
        "higher", "correct: you found it"]  # ("12" arrives as 12: the tool's schema says int)
    assert episode.env.get_reward() == pytest.approx(0.9)


# ---------------------------------------------------------------------------------------------
# Training: the environment's tokens are never trained.


def test_observation_tokens_get_no_gradient(tiny_model_dir, monkeypatch):
    """The loss and its gradient cover the model's tokens only: the gradient of the loss with
    respect to every observation token's log-prob is exactly 0, and the loss is the token-mean
    over the model's tokens, by hand."""
    import grpo
    from trainer import finish_metrics
    trainer = rl_trainer(grpo.Config(data="arith", model=tiny_model_dir, dtype="fp32",
                                        beta=0.0, lr=1e-3))
    # two episodes: model 3 tokens, observation 2, model 2; and model 4 tokens, no observation
    prompts, completions = [[5, 6], [7, 8, 9]], [[20, 21, 22, 30, 31, 23, 2], [24, 25, 26, 2]]
    masks = [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1]]
    comps = Completions(prompts, completions, [False, False], ["", ""],
                        mask=[[bool(m) for m in row] for row in masks])
    advantages = torch.tensor([1.0, -0.5])
    batch = rl.train_batch(comps, advantages, trainer.cfg, pad_id=2)
    assert batch.denom == 9.0  # the model's tokens only

    seen = []

    def keeping_grad(*args, **kwargs):
        logprobs, entropy = real(*args, **kwargs)
        logprobs.retain_grad()
        seen.append(logprobs)
        return logprobs, entropy

    real = grpo.policy_logprobs
    monkeypatch.setattr(grpo, "policy_logprobs", keeping_grad)
    metrics = finish_metrics([grpo.train_on_rollout(trainer, batch)])
    grad = seen[0].grad  # (2, 7): d loss / d log-prob of each completion token
    model = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.all(grad[~model] == 0)
    expected = (-advantages[:, None] / 9.0).expand(2, 7)[model]  # token-mean: -A / 9 each
    torch.testing.assert_close(grad[model], expected)
    # ratio 1 on-policy: the loss is -A summed over the model's tokens, over their count
    assert metrics["loss"] == pytest.approx(-(5 * 1.0 + 4 * -0.5) / 9, abs=1e-6)


def test_trl_style_tools_and_environment_train_unchanged(tiny_model_dir, tmp_path):
    """A TRL-style tool file and environment class, as TRL users write them, through the command
    line on the tiny model; metrics carry turns and tool figures."""
    common = ["--model", tiny_model_dir, "--steps", "1", "--prompts-per-step", "2",
              "--num-generations", "2", "--max-new-tokens", "32", "--eval-every", "0",
              "--max-turns", "2"]
    run_grpo([*common, "--data", "multiply", "--tools", "tests.trl_tools:add,calculator",
              "--out", str(tmp_path / "tools")])
    run_grpo([*common, "--data", "guess", "--env", "tests.trl_tools:CounterEnv", "--reward",
              "tests.trl_tools:reached_target", "--out", str(tmp_path / "env")])
    for run in ("tools", "env"):
        record = read_metrics(tmp_path / run)[-1]
        assert {"turns", "tool_calls", "tool_errors", "truncated_episodes"} <= set(record)


def test_an_episode_on_the_hf_engine(tiny_model, monkeypatch):
    """The turn loop through the HF engine (check_an_episode_on, conftest.py)."""
    model, tokenizer = tiny_model
    engine = HFRollout(model, tokenizer, dtype=torch.float32, logprobs=True)
    check_an_episode_on(engine, model, tokenizer, monkeypatch, atol=1e-4)


def test_episodes_continue_from_kept_keys_and_values_with_nothing_changed(tiny_model_dir,
                                                                         monkeypatch):
    """The HF engine keeps each episode's keys and values between turns and prefills only the tool
    result: the episodes (tokens, masks, engine log-probs) and the losses and gradient norms they
    train with are those of prefilling every turn whole (fp32, seeded). Turns end at many lengths
    (a one-in-six chance of stopping per token), so episodes leave the batch mid-turn and finish after
    different numbers of turns. The kept keys really serve: after the first turn only the new
    tokens run, and a weight update drops them."""
    import grpo
    from logprobs import check_head_logits
    from model import load_model
    model, tokenizer = load_model(tiny_model_dir)
    check_head_logits(model)  # (what lets the engine put padding between cached and new tokens)
    stops = set(range(1000, 1000 + len(tokenizer) // 6)) | {tokenizer.eos_token_id}
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": {"expression": "6 * 7"}}}

    def play(keep: bool):
        engine = HFRollout(model, tokenizer, dtype=torch.float32, logprobs=True)
        engine.stop_ids = stops
        if not keep:
            monkeypatch.setattr(engine, "_can_keep", lambda cache: False)
        chat = ToolChat(tokenizer, load_tools("calculator"))
        # a tiny random model writes no tool calls: every turn that stopped "calls" one
        monkeypatch.setattr(chat, "parse", lambda prefix, turn: {"content": "", "tool_calls": [
            call]} if turn[-1] in stops else {"content": "42"})
        agent = Agent(chat, "{problem}", 4, 120)
        rows = [{"problem": f"What is {a} * 7?"} for a in (3, 6, 9)]
        comps, episodes = agent.run(engine, rows, 4, Sampling(10, 1.0, seed=5))
        return engine, comps, episodes

    kept_engine, kept, episodes = play(keep=True)
    _, whole, _ = play(keep=False)
    assert kept.completion_ids == whole.completion_ids and kept.mask == whole.mask
    torch.testing.assert_close(torch.tensor(sum(kept.engine_logprobs, [])),
                               torch.tensor(sum(whole.engine_logprobs, [])), atol=1e-5, rtol=0)
    turns = [e.turns for e in episodes]
    assert max(turns) >= 3 and min(turns) < 3 and len(set(map(len, kept.completion_ids))) > 6
    # every turn after the first starts from the episode so far: of the same prompt tokens, the
    # ones that ran are the first turn's and each later turn's tool result (and the token before
    # it), where prefilling whole shares only the prompts' common prefix (the tool list)
    assert kept.prompt_tokens == whole.prompt_tokens
    ran = [c.prompt_tokens - c.cached_tokens for c in (kept, whole)]
    assert ran[0] < ran[1] / 2
    assert kept_engine.kept == {}  # released when the episodes ended

    losses = []
    for comps in (kept, whole):
        trainer = rl_trainer(grpo.Config(data="arith", model=tiny_model_dir, dtype="fp32",
                                         beta=0.0, lr=1e-3))
        advantages = torch.linspace(-1, 1, len(comps))
        batch = rl.train_batch(comps, advantages, trainer.cfg, pad_id=tokenizer.pad_token_id)
        metrics = grpo.train_on_rollout(trainer, batch)
        losses.append((metrics["loss"], metrics["grad_norm"]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)


def test_kept_keys_and_values_are_handed_on_not_copied(tiny_model, monkeypatch):
    """An episode's keys and values exist about once, not twice (128 multiply episodes kept
    ~2.4 GB on SmolLM2, and a grpo.py run from the SFT model peaked at 6.5 GB): a kept row is
    freed layer by layer as the next call's cache takes it, and the last step's cache likewise
    as the rows are kept."""
    import rollout
    model, tokenizer = tiny_model
    engine = HFRollout(model, tokenizer, dtype=torch.float32)
    engine.share_prefix = True
    caches = []
    keep = rollout.HFRollout._keep
    monkeypatch.setattr(rollout.HFRollout, "_keep", lambda self, cache, *a, **k: (
        caches.append((cache, k.get("last", False))), keep(self, cache, *a, **k))[1])
    engine.generate([[5, 6, 7, 8]], 2, Sampling(4, 1.0, seed=0, keep_cache=True))
    last = [cache for cache, is_last in caches if is_last]
    assert last and all(layer.keys is None and layer.values is None
                        for cache in last for layer in cache.layers)
    rows = [row for kept in engine.kept.values() for row in kept]
    assert len(rows) == 2 and all(k is not None for row in rows for k in row.layers)
    out = engine.generate([rows[0].tokens + [9]], 1, Sampling(4, 1.0, seed=0, keep_cache=True))
    assert out.cached_tokens == len(rows[0].tokens)
    assert all(layer is None for layer in rows[0].layers)  # handed on to the new cache


def test_kept_keys_and_values_never_outlive_the_weights(tiny_model):
    """A kept sample is continued only by the weights that computed it: a weight update drops
    the engine's kept keys and values."""
    from model import full_weights
    model, tokenizer = tiny_model
    engine = HFRollout(model, tokenizer, dtype=torch.float32)
    engine.share_prefix = True
    engine.generate([[5, 6, 7, 8]], 2, Sampling(4, 1.0, seed=0, keep_cache=True))
    assert sum(map(len, engine.kept.values())) == 2
    engine.update_weights(full_weights(model), version=1)
    assert engine.kept == {}
    out = engine.generate([[5, 6, 7, 8, 9]], 1, Sampling(4, 1.0, seed=0))
    assert out.cached_tokens == 0


# ---------------------------------------------------------------------------------------------
# Episodes never crash the run, and each is limited and scored on its own.


class PerEpisodeEngine:
    """An engine that answers episode i's turn t with scripts[i][t] (token ids), cut at the turn's
    max_new_tokens as an engine cuts: truncated when the script is longer."""

    def __init__(self, scripts):
        self.scripts, self.turn, self.asked = scripts, 0, []

    def generate(self, prompt_ids, n, sampling):
        self.asked.append(sampling.max_new_tokens)
        rows = [self.scripts[i][self.turn] for i in range(len(prompt_ids))]
        self.turn += 1
        cut = sampling.max_new_tokens
        return Completions(prompt_ids, [r[:cut] for r in rows], [len(r) > cut for r in rows],
                           [""] * len(rows), None, 0, 0.01)


def test_each_episode_has_its_own_room(tokenizer):
    """Turn 2 of two episodes: one has used most of its --max-episode-tokens, the other little.
    Each turn is cut at its own episode's room, not the fullest episode's (a short episode was once
    cut, and marked truncated, with 400 of its 512 tokens left)."""
    chat = ToolChat(tokenizer, load_tools("calculator"))
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [tokenizer.eos_token_id]
    long_call = ids(_call("calculator", {"expression": " + ".join(["1"] * 40)})) + eos
    short_call = ids(_call("calculator", {"expression": "1 + 1"})) + eos
    answer = ids("The answer is " + "two " * 20) + eos
    max_tokens = len(long_call) + len(chat.observation_ids([("calculator", "40")])) + 10
    engine = PerEpisodeEngine([[long_call, answer], [short_call, answer]])
    agent = Agent(chat, "{problem}", 4, max_tokens)
    turn = max(len(long_call), len(answer)) + 5  # --max-new-tokens
    _, (full, roomy) = agent.run(engine, [{"problem": "a"}, {"problem": "b"}], 1,
                                 Sampling(turn, 1.0))
    assert full.turns == 2 and full.truncated and len(full.ids) == max_tokens  # its own room
    assert not roomy.truncated and roomy.ids[-len(answer):] == answer  # whole: it had room
    # one call a turn, as long as the roomiest episode may go (the old rule asked for 10 here)
    assert engine.asked == [turn, max_tokens - (len(roomy.ids) - len(answer))]


class SizedEngine(ScriptedEngine):
    """A ScriptedEngine that holds sequences of at most max_model_len tokens, as vLLM does: a
    prompt that long fails the call (rollout.VLLMRollout.generate stops the run), a sample stops
    when its sequence reaches it (truncated)."""

    def __init__(self, tokenizer, turns: list[str], max_model_len: int):
        super().__init__(tokenizer, turns)
        self.max_model_len = max_model_len

    def generate(self, prompt_ids, n, sampling):
        assert max(map(len, prompt_ids)) < self.max_model_len, "a prompt the engine cannot hold"
        out = super().generate(prompt_ids, n, sampling)
        rooms = [self.max_model_len - len(p) for p in prompt_ids]
        out.completion_ids = [ids[:room] for ids, room in zip(out.completion_ids, rooms)]
        out.truncated = [len(ids) == room for ids, room in zip(out.completion_ids, rooms)]
        return out


def test_an_episode_ends_where_the_engine_can_hold_no_more(tokenizer):
    """A vLLM engine holds --max-prompt-tokens and --max-episode-tokens after them only as far as
    the model's positions go (rollout.engine_length; said at start), and an environment's reset
    text lengthens a prompt beyond what was measured: an episode whose prompt and turns fill the
    engine ends there, truncated -- a late turn once asked for more than it holds, and the run
    stopped with "a prompt of N tokens does not fit"."""
    chat = ToolChat(tokenizer, load_tools("calculator"))
    agent = Agent(chat, "{problem}", 10, 300)
    prompt = len(agent.start([{"problem": "1 + 1"}], 1)[0].prompt_ids)
    call = _call("calculator", {"expression": "1 + 1"})
    turn = len(tokenizer(call, add_special_tokens=False)["input_ids"]) + 1
    result = len(chat.observation_ids([("calculator", "2")]))
    # (the positions' cap: the third turn fits, its tool result does not)
    engine = SizedEngine(tokenizer, [call] * 10, prompt + 3 * turn + 2 * result + result // 2)
    _, (episode,) = agent.run(engine, [{"problem": "1 + 1"}], 1, Sampling(48, 1.0))
    assert episode.truncated and episode.turns == 3
    assert len(episode.prompt_ids) + len(episode.ids) < engine.max_model_len


def test_the_overlong_penalty_of_an_episode_is_against_its_own_budget():
    """--overlong-buffer: a completion is measured against --max-new-tokens, an episode (all its
    turns and tool results) against --max-episode-tokens: a correct 62-token two-turn episode
    with 48 tokens a turn is not overlong (it once lost its whole reward, 1.0 -> 0.0)."""
    import grpo
    cfg = grpo.Config(data="multiply", max_new_tokens=48, max_episode_tokens=512,
                      overlong_buffer=16)
    comps = Completions([[1]] * 3, [[5] * 62, [5] * 500, [5] * 512], [False] * 3, [""] * 3)
    assert rl.overlong(comps, cfg, True, cfg.overlong_buffer) == [0.0, -0.25, -1.0]
    assert rl.overlong(comps, cfg, False, 16)[0] == -1.0  # as a single completion: long
    with pytest.raises(SystemExit, match="--overlong-buffer 600 is longer than "
                                         "--max-episode-tokens 512"):
        grpo.Config(data="multiply", overlong_buffer=600)


HOSTILE = [
    _call(["calculator"], {"expression": "1"}),  # a name that is a list: unhashable
    _call({"name": "calculator"}, {"expression": "1"}),  # an object
    _call(None, {}), _call(7, {}), _call("calculator", ["1 + 1"]), _call("calculator", "1 + 1"),
    '<tool_call>\n' + "[" * 600 + "]" * 600 + '\n</tool_call>',  # nested 600 deep: RecursionError
    '<tool_call>\n{"name": "calculator", "arguments": ' + '{"a": ' * 400 + "1" + "}" * 401 +
    '\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + "(" * 300 + "1" +
    ")" * 300 + '"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + "9" * 4400 + '"}}'
    '\n</tool_call>',
    '<tool_call>\n{"name": "guess", "arguments": {"number": NaN}}\n</tool_call>',
    '<tool_call>\n{"name": "guess", "arguments": {"number": 1e999}}\n</tool_call>',
    '<tool_call>\n{"name": "guess", "arguments": {"number": "x", "self": 1}}\n</tool_call>',
    '<tool_call>\n{"name": "guess", "arguments": {"number": ' + "1" * 4400 + '}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>' * 30,
]
ODD = ["<tool_call><tool_call></tool_call></tool_call>", "<tool_call>", "</tool_call>" * 3,
       "\ufffd<|im_start|>assistant\n<tool_call>\x00</tool_call><|im_end|>"]


def test_whatever_the_model_writes_becomes_an_observation_never_an_exception(tokenizer):
    """Hostile JSON (names that are lists or objects, arrays nested 600 deep, huge numbers, NaN)
    and 300 random token sequences, as turns of episodes with a tool and an environment: every
    episode ends, none raises, and every failed call is told to the model as an error."""
    import random
    chat = ToolChat(tokenizer, load_tools("calculator"), GuessTheNumber)
    rng = random.Random(0)
    hostile = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in HOSTILE + ODD]
    noise = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))]
             for _ in range(300)]
    scripts = [[turn, turn] for turn in hostile + noise]
    agent = Agent(chat, "{problem}", 2, 12000)
    rows = [{"problem": "p", "secret": 3}] * len(scripts)
    comps, episodes = agent.run(PerEpisodeEngine(scripts), rows, 1, Sampling(12000, 1.0))
    assert all(e.done for e in episodes) and len(comps.completion_ids) == len(scripts)
    for e in episodes[:len(HOSTILE)]:  # each a call that cannot run: the model reads why
        results = [m["content"] for m in e.messages if m["role"] == "tool"]
        assert results and all(r.startswith("error:") for r in results), e.messages


def test_tool_metrics_match_trls_on_trls_own_case(tokenizer):
    """TRL's tools test, as three episodes: a valid call, a call that fails (a wrong argument) and
    a plain answer: calls in 2 of 3 episodes (tool_calls 2/3, TRL's tools/call_frequency), one
    failure in two calls (tool_failure_frequency 1/2, TRL's tools/failure_frequency)."""
    from env import episode_metrics
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    done = ids("The answer is 4.") + [tokenizer.eos_token_id]
    scripts = [[ids(_call("calculator", {"expression": "2 + 2"})), done],
               [ids(_call("calculator", {"text": "2 + 2"})), done], [done]]
    agent = Agent(ToolChat(tokenizer, load_tools("calculator")), "{problem}", 4, 1024)
    _, episodes = agent.run(PerEpisodeEngine(scripts), [{"problem": "2 + 2?"}] * 3, 1,
                            Sampling(64, 1.0))
    metrics = episode_metrics(episodes)
    assert metrics["tool_calls"] == pytest.approx(2 / 3) and metrics["tool_errors"] == 1
    assert metrics["tool_failure_frequency"] == 0.5 and metrics["tool_use"] == pytest.approx(2 / 3)


class EnvWithHelpers:
    """An environment as TRL users write them: a tool, a private helper, a property."""

    def reset(self, **row):
        self.value = 0

    def add(self, n: int) -> str:
        """Add to the value.

        Args:
            n: how much
        """
        self.value += n
        return str(self.value)

    @staticmethod
    def _clamp(n):
        return max(0, n)

    @property
    def doubled(self):
        raise AssertionError("a property is no tool, and must not run")

    def get_reward(self) -> float:
        return float(self.value)


class EnvWithAPublicHelper(EnvWithHelpers):
    @staticmethod
    def clamp(n):
        return max(0, n)


def test_an_environments_tools_follow_trls_rule(monkeypatch):
    """TRL's GRPOTrainer (trl 1.16) takes as tools the class's functions by inspect.getmembers(
    type(env), inspect.isfunction) -- staticmethods included -- less reset, get_reward and names
    starting with "_" (properties are not evaluated). The same rule here; an undocumented public
    staticmethod is a tool to both, and is refused before any model loads, naming the way out."""
    import inspect
    import env as env_module

    def trls_rule(instance):  # as trl/trainer/grpo_trainer.py reads an environment
        return sorted(name for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
                      if name not in ("reset", "get_reward") and not name.startswith("_"))

    for cls in (EnvWithHelpers, EnvWithAPublicHelper):
        ours = sorted(fn.__name__ for fn in env_module.environment_tools(cls()))
        assert ours == trls_rule(cls()), cls
    monkeypatch.setattr(env_module, "load_function", lambda spec, **kw: EnvWithAPublicHelper)
    with pytest.raises(SystemExit, match=r"error: tool 'clamp': .*every public function of "
                                         r"m:EnvWithAPublicHelper is a tool .*name a helper _clamp"):
        load_environment("m:EnvWithAPublicHelper")
    monkeypatch.setattr(env_module, "load_function", lambda spec, **kw: EnvWithHelpers)
    assert load_environment("m:EnvWithHelpers") is EnvWithHelpers


def test_an_unknown_tool_lists_the_tools_not_the_rewards():
    """--tools a.py:f,g: the bare g is neither a built-in tool nor a module:function."""
    with pytest.raises(SystemExit) as stop:
        load_tools("tests/trl_tools.py:add,g")
    assert str(stop.value) == ("error: unknown tool 'g': use one of ['calculator', 'python'], "
                               "module:function, path/to/file.py:function or module.function")


def test_an_episodes_engine_holds_its_longest_turn_and_counts_only_sampled_tokens():
    """vLLM's max_model_len is sized from the most tokens after a prompt: an episode's late turn
    continues from every earlier turn and tool result (--max-episode-tokens), not one turn's
    --max-new-tokens; gen_tokens_per_s counts the sampled tokens, not the tool results."""
    import grpo
    from evaluate import step_record
    from rollout import tokens_after_prompt
    assert tokens_after_prompt(grpo.Config(data="multiply", max_episode_tokens=3000)) == 3000
    assert tokens_after_prompt(grpo.Config(data="arith", max_new_tokens=64)) == 64
    comps = Completions([[1], [1]], [[5] * 10, [5] * 6], [False, False], ["", ""],
                        mask=[[True] * 4 + [False] * 6, [True] * 6])
    sampled = rl.Scored([{}, {}], comps, torch.tensor([1.0, 0.0]), [], {}, gen_seconds=2.0)
    update = {"trained_tokens": 0}
    assert step_record(1, sampled, update, 1.0, 0.0, 2)["gen_tokens_per_s"] == 5.0
    # mfu: the update's FLOPs over the update's own seconds, the rollout log's pass left out
    update = {"trained_tokens": 0, "model_flops": 6e9, "peak_flops": 1e10, "detail_seconds": 0.5}
    assert step_record(1, sampled, update, 2.0, 0.0, 2)["mfu"] == pytest.approx(0.4)


def test_held_out_episodes_are_played_no_more_at_a_time_than_a_step_plays(tiny_model_dir,
                                                                           tmp_path, monkeypatch):
    """The engine keeps each episode's keys and values between turns: the held-out evaluation
    plays its episodes in batches of a training step's (prompts x generations), so it never holds
    more of them than the rollout does (all 128 multiply problems at once were a run's peak)."""
    import env
    played, real = [], env.Agent.run

    def counting(self, engine, rows, n, sampling):
        played.append(len(rows) * n)
        return real(self, engine, rows, n, sampling)

    monkeypatch.setattr(env.Agent, "run", counting)
    run_grpo(["--model", tiny_model_dir, "--data", "multiply", "--steps", "1",
              "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "32",
              "--max-turns", "2", "--eval-every", "1", "--eval-size", "5",
              "--out", str(tmp_path / "run")])
    # evaluation at step 0 (5 problems: 4 + 1), the step's rollout (2 x 2), evaluation again
    assert played == [4, 1, 4, 4, 1]

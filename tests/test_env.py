"""Agentic episodes (env.py, sandbox.py): the sandbox ends every bad call within its limits as an
error the model reads, bad tool calls are counted and the episode goes on, episodes continue from
the very ids that were sampled, and only the model's tokens are trained."""

import sys
from pathlib import Path

import pytest
import torch

from conftest import check_an_episode_on, read_metrics, run_grpo
from data import TASKS
from env import Agent, GuessTheNumber, ToolChat, calculator, load_environment, load_tools
from rollout import Completions, HFRollout, Sampling
from sandbox import OUTPUT, run_python

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# The sandbox: every bad input ends within its limit, as an error, and changes nothing outside.

BAD_CODE = {
    "an infinite loop": ("while True: pass", "timed out"),
    "a sleeping process": ("import time\ntime.sleep(60)", "timed out"),
    "a fork bomb": ("import os\nwhile True: os.fork()", "os.fork is not allowed"),
    "1 GB of output": ("import sys\nwhile True: sys.stdout.write('x' * 65536)",
                       f"output over {OUTPUT} bytes"),
    "a memory bomb": ("x = bytearray(8 << 30)", "MemoryError"),
    "the network": ("import socket", "import socket is not allowed"),
    "a file outside its folder": ("print(open('/etc/hostname').read())", "outside the scratch"),
    "a secret in the environment": ("import os\nprint(os.environ['SMOLRL_TEST_SECRET'])",
                                    "KeyError"),
    "a write outside its folder": ("open('{outside}', 'w').write('x')", "outside the scratch"),
    "a subprocess": ("import subprocess", "import subprocess is not allowed"),
}


@pytest.mark.parametrize("name", list(BAD_CODE))
def test_the_sandbox_ends_every_bad_call_as_an_error(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SMOLRL_TEST_SECRET", "hunter2")
    code, error = BAD_CODE[name]
    outside = tmp_path / "not-yours"
    result = run_python(code.format(outside=outside), timeout=2.0)
    assert error in result.error, result
    assert result.seconds < 4.0 and len(result.output) <= OUTPUT
    assert "hunter2" not in result.output and not outside.exists()


def test_the_sandbox_runs_ordinary_code_in_a_scratch_folder_of_its_own():
    result = run_python("open('notes.txt', 'w').write('347 * 29')\n"
                        "print(eval(open('notes.txt').read()))")
    assert (result.output, result.error) == ("10063", "")


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
        "malformed tool call", 'a tool call is {"name"', "no tool named 'abacus'; the tools are "
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
    from trainer import finish_metrics, setup_trainer
    trainer = setup_trainer(grpo.Config(data="arith", model=tiny_model_dir, dtype="fp32",
                                        beta=0.0, lr=1e-3))
    # two episodes: model 3 tokens, observation 2, model 2; and model 4 tokens, no observation
    prompts, completions = [[5, 6], [7, 8, 9]], [[20, 21, 22, 30, 31, 23, 2], [24, 25, 26, 2]]
    masks = [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1]]
    comps = Completions(prompts, completions, [False, False], ["", ""],
                        mask=[[bool(m) for m in row] for row in masks])
    advantages = torch.tensor([1.0, -0.5])
    batch = grpo.train_batch(comps, advantages, trainer.cfg, pad_id=2)
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

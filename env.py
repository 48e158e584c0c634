"""Agentic episodes: the model acts, tools and environments answer, and only the model's own tokens
are trained.

An episode starts from a data row; each turn the model writes one assistant message; if it calls
tools, their results are appended and the model goes on; a message without a tool call ends the
episode (so do --max-turns and --max-episode-tokens: then it is `truncated`). Two ways in, in the
shapes of TRL's GRPOTrainer (`tools=`, `environment_factory=`), so that TRL users' code runs as is:

    --tools module:fn,...   plain functions with type hints and a docstring (their JSON schema comes
                            from them); `calculator` and `python` (sandbox.py) are built in
    --env module:Class      one instance per episode: reset(**row) -> str | None (a string is
                            appended to the prompt), its public methods are its tools, and an
                            optional get_reward() -> float scores the episode

The chat template shows the tools and the results (apply_chat_template(tools=...)), and
transformers' response parser reads the calls (tokenizer.parse_response with a response
template): the tokenizer's own, or -- for a template that ignores tools, as SmolLM2's does --
smolrl's ChatML one below, said on the first screen.

The ids that are trained are the ids that were sampled: a turn's input is the previous input, the
sampled tokens and the observation's tokens, appended -- never the conversation re-encoded. An
episode's `mask` marks each token after the prompt: True where the model sampled it (trained),
False for the environment's (tool results, the template's turn markers: never trained).
"""

import ast
import functools
import inspect
import json
import operator
import time
from dataclasses import dataclass, field, replace

from reward import load_function, run_coroutine
from sampling import Completions, Sampling, request_seed
from sandbox import check_sandbox, run_python

# ---------------------------------------------------------------------------------------------
# Built-in tools.


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % and parentheses, e.g. "347 * 29"
    """
    return str(_arithmetic(ast.parse(expression, mode="eval").body))


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _arithmetic(node):
    """The value of an expression tree of numbers and + - * / // %: nothing else is evaluated."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _arithmetic(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if max(abs(left), abs(right)) > 1e100:
            raise ValueError("numbers too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: the program; print the result you need
    """
    result = run_python(code)
    if result.error:
        raise RuntimeError(f"{result.error}\n{result.output[-500:]}".strip())
    return result.output


BUILTIN_TOOLS = {"calculator": calculator, "python": python}


def load_tools(spec: str) -> list:
    """--tools: built-in names and module:function specs, comma-separated; each one's schema is
    made now, so that a tool without a docstring or type hints stops the run before it starts."""
    tools = [BUILTIN_TOOLS.get(name) or load_function(name, what="tool", builtins=BUILTIN_TOOLS)
             for name in (s.strip() for s in spec.split(",")) if name]
    for fn in tools:
        _schema(fn)
    if python in tools:
        check_sandbox()  # the kernel's wall, or one line saying what is missing: never a weaker one
    return tools


def load_environment(spec: str):
    """--env module:Class: TRL's environment contract, checked before any model loads."""
    env_class = load_function(spec, what="environment", builtins=()) if spec else None
    if env_class is not None:
        if not callable(getattr(env_class, "reset", None)):
            raise SystemExit(f"error: environment {spec!r} has no reset(**row) method (TRL's "
                             f"environment_factory contract)")
        for fn in environment_tools(env_class()):
            _schema(fn, hint=f"; every public function of {spec} is a tool (TRL's rule, "
                             f"staticmethods included): name a helper _{fn.__name__}")
    return env_class


def environment_tools(env) -> list:
    """An environment's tools, by TRL's rule (GRPOTrainer, trl 1.16): the functions of its class
    -- methods and staticmethods, found on the class so that no property runs -- whose names do not
    start with "_", reset and get_reward excepted; bound to this instance."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


# ---------------------------------------------------------------------------------------------
# The chat format of tool calls: rendering (a chat template) and parsing (a response template).

# For chat templates that ignore tools: ChatML with the tools' JSON schemas in the system message,
# calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results as `tool` messages.
TOOL_TEMPLATE = """\
{%- set first = messages[0] if messages else none -%}
<|im_start|>system
{{ first.content if first and first.role == 'system' else 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' }}
{%- if tools %}

You can call these tools:
{% for tool in tools -%}
{{ tool | tojson }}
{% endfor %}
To call a tool, write:
<tool_call>
{"name": "<tool name>", "arguments": {"<argument>": <value>}}
</tool_call>
Its result comes back in a message from `tool`.
{%- endif %}<|im_end|>
{% for message in messages -%}
{%- if not (loop.first and message.role == 'system') -%}
<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""

# How transformers' parser reads such a turn: text, and repeated JSON tool calls.
TOOL_RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {},  # what is not a tool call
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json",
                       "repeats": True, "transform": {"type": "function", "function": "{content}"}},
    },
}


class ToolChat:
    """The tools of a run and the chat format that carries them: which chat template renders the
    tools and results, and which response template parses the model's calls."""

    def __init__(self, tokenizer, tools: list, env_class=None):
        self.tokenizer, self.tools, self.env_class = tokenizer, tools, env_class
        shown = tools + (environment_tools(env_class()) if env_class else [])
        if not shown:
            raise SystemExit("error: --env: the environment has no tools (public methods) and "
                             "no --tools are given: the model could never act")
        self.schemas = [_schema(fn) for fn in shown]  # checked now: a missing docstring stops here
        self.template = tokenizer.chat_template if _renders_tools(tokenizer) else TOOL_TEMPLATE
        self.response_template = getattr(tokenizer, "response_template", None) or \
            TOOL_RESPONSE_TEMPLATE
        if self.template is TOOL_TEMPLATE:
            print("tools: the model's chat template does not show tools; using smolrl's ChatML "
                  "tool format (<tool_call> JSON, env.TOOL_TEMPLATE)")
        self.eos = tokenizer.eos_token

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  chat_template=self.template)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer(self.render(messages, True), add_special_tokens=False)["input_ids"]

    def parse(self, prefix_ids: list[int], turn_ids: list[int]) -> dict:
        """The model's message: {"content": ..., "tool_calls": [...]}; a call the parser cannot
        read is kept as {"malformed": why}."""
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=False)
        text = text.removesuffix(self.eos)  # the stop token ends the turn; it is not content
        try:
            message = self.tokenizer.parse_response(text, schema=self.response_template,
                                                    prefix=self.tokenizer.decode(prefix_ids),
                                                    tools=self.schemas)
            content, calls = message.get("content") or "", message.get("tool_calls") or []
        except Exception as e:  # whatever the model wrote (JSON nested 500 deep: RecursionError)
            # is the model's problem, told to it as an observation, never the trainer's
            why = (str(e).splitlines() or [""])[0][:200]
            return {"content": text, "malformed": f"{type(e).__name__}: {why}".rstrip(": ")}
        if not isinstance(content, str):
            content = json.dumps(content, default=str)
        return {"content": content, "tool_calls": calls if isinstance(calls, list) else [calls]}

    @functools.cache
    def _results_suffix(self, n: int) -> list[str]:
        """The text the template appends after the model's turn for n tool results, as the n + 1
        pieces around them: found by rendering a stand-in conversation with and without markers
        for results (the real history could render differently, e.g. reasoning stripped)."""
        call = {"type": "function", "function": {"name": "f", "arguments": {}}}
        turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "",
                                                    "tool_calls": [call] * n}]
        marks = [f"\x00{i}\x00" for i in range(n)]
        results = [{"role": "tool", "name": "f", "content": m} for m in marks]
        before, after = self.render(turn, False), self.render(turn + results, True)
        cut = before.rindex(self.eos) + len(self.eos)  # where the model's sampled turn ends
        suffix = after[cut:]
        if not after.startswith(before[:cut]) or [suffix.count(m) for m in marks] != [1] * n:
            raise SystemExit("error: --tools: the chat template renders a conversation "
                             "differently once tool results follow it; use a model whose "
                             "template appends them")
        pieces = []
        for mark in marks:
            piece, suffix = suffix.split(mark)
            pieces.append(piece)
        return pieces + [suffix]

    def check_turn_length(self, max_new_tokens: int):
        """Stop, with one line, when a turn of max_new_tokens cannot hold even the shortest call
        of any tool (every required argument one character long): the model could never act."""
        shortest = min(self._call_tokens(schema["function"]) for schema in self.schemas)
        if max_new_tokens < shortest[0]:
            raise SystemExit(f"error: --max-new-tokens {max_new_tokens} (tokens per turn) is "
                             f"shorter than the shortest call of tool {shortest[1]!r} "
                             f"({shortest[0]} tokens): the model could never call a tool")

    def _call_tokens(self, function: dict) -> tuple[int, str]:
        """(tokens, name) of a turn that calls `function` with one-character arguments, its
        stop token included: rendered with and without that turn, the difference counted."""
        smallest = {"integer": 1, "number": 1, "string": "x", "boolean": True, "array": []}
        parameters = function.get("parameters", {})
        arguments = {name: smallest.get(spec.get("type")) for name, spec in
                     parameters.get("properties", {}).items() if name in
                     parameters.get("required", [])}
        call = {"type": "function", "function": {"name": function["name"],
                                                 "arguments": arguments}}
        asked = [{"role": "user", "content": "u"}]
        before = self.render(asked, True)
        after = self.render(asked + [{"role": "assistant", "content": "",
                                      "tool_calls": [call]}], False)
        turn = after[len(before):after.rindex(self.eos) + len(self.eos)]
        return len(self.tokenizer(turn, add_special_tokens=False)["input_ids"]), function["name"]

    def observation_ids(self, results: list[tuple[str, str]]) -> list[int]:
        """The tokens appended after the model's turn for its tool results [(name, text)]: the
        template's own markup around them, ending with the next assistant turn's opening."""
        pieces = self._results_suffix(len(results))
        # Each result in its own place, whatever it holds (a result holding the text of a
        # marker would draw the next one into itself if they were substituted one by one).
        texts = [text for _, text in results] + [""]
        suffix = "".join(piece + text for piece, text in zip(pieces, texts))
        return self.tokenizer(suffix, add_special_tokens=False)["input_ids"]


def _schema(fn, hint: str = "") -> dict:
    if isinstance(fn, dict):  # a tool given by its JSON schema (an SFT row's `tools`): shown as is
        return fn
    from transformers.utils import get_json_schema
    try:
        return get_json_schema(fn)
    except Exception as e:  # no docstring, an argument without a type hint or a description
        raise SystemExit(f"error: tool {getattr(fn, '__name__', fn)!r}: {e}{hint}") from None


def _renders_tools(tokenizer) -> bool:
    """Does the model's own chat template show tools to the model? (SmolLM2's ignores them.)"""
    if not tokenizer.chat_template:
        return False

    def smolrl_probe_tool(x: int) -> int:
        """Probe.

        Args:
            x: a number
        """
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}],
                                         tools=[smolrl_probe_tool], tokenize=False,
                                         add_generation_prompt=True)
    return "smolrl_probe_tool" in text


# ---------------------------------------------------------------------------------------------
# Episodes.


@dataclass
class Episode:
    row: dict
    env: object | None  # this episode's environment instance
    prompt: list[dict]  # the prompt's messages (with reset()'s text appended)
    prompt_ids: list[int]
    messages: list[dict] = field(default_factory=list)  # what followed: assistant and tool turns
    ids: list[int] = field(default_factory=list)  # every token after the prompt
    mask: list[bool] = field(default_factory=list)  # per token of `ids`: sampled by the model
    logprobs: list[float] = field(default_factory=list)  # the engine's, per token (0: not sampled)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    done: bool = False
    truncated: bool = False

    @property
    def answer(self) -> str:
        """The text graded by answer-checking rewards: the last assistant message's content."""
        last = [m for m in self.messages if m["role"] == "assistant"]
        return last[-1]["content"] if last else ""


@dataclass
class Agent:
    """How a run's episodes go: its tools and chat format, the user-message template for a row's
    problem, and the limits of an episode."""
    chat: ToolChat
    template: str  # e.g. "{problem}\nReply with one sentence: The answer is <number>."
    max_turns: int
    max_tokens: int  # tokens after the prompt, tool results included

    @staticmethod
    def for_run(cfg, template: str, tools: list, env_class) -> "Agent | None":
        """The episodes of a run with --tools or --env (None without), from its config; checked
        with the tokenizer alone, so a turn too short for any tool call stops before the model
        loads."""
        if not (tools or env_class):
            return None
        from model import load_tokenizer
        agent = Agent(ToolChat(load_tokenizer(cfg.model), tools, env_class), template,
                      cfg.max_turns, cfg.max_episode_tokens)
        agent.chat.check_turn_length(cfg.max_new_tokens)
        return agent

    def messages(self, row: dict) -> list[dict]:
        """An episode's first messages: a conversational row's own, else its problem in the
        template (before an environment's reset text, which start appends)."""
        return [dict(m) for m in row["prompt"]] if isinstance(row.get("prompt"), list) \
            else [{"role": "user", "content": self.template.format(problem=row["problem"])}]

    def start(self, rows: list[dict], n: int) -> list[Episode]:
        """n episodes per row, row-major, each with its own environment, reset with the row."""
        episodes = []
        for row in rows:
            for _ in range(n):
                env = self.chat.env_class() if self.chat.env_class else None
                prompt = self.messages(row)
                text = env.reset(**row) if env is not None else None
                if isinstance(text, str):  # as TRL does: appended to the last message
                    prompt[-1]["content"] += text
                episodes.append(Episode(row, env, prompt, self.chat.prompt_ids(prompt)))
        return episodes

    def budget(self, e: Episode, longest: int) -> int:
        """The most tokens episode e may hold after its prompt: --max-episode-tokens, and no more
        than an engine that holds sequences of `longest` tokens (vLLM's max_model_len; 0: no
        limit) holds beside the prompt -- where the model's positions cut it, or the prompt is
        longer than measured (an environment's reset text). There the episode ends, truncated: a
        later turn would ask the engine for more than it holds."""
        return min(self.max_tokens, longest - len(e.prompt_ids)) if longest else self.max_tokens

    def run(self, engine, rows: list[dict], n: int,
            sampling: Sampling) -> tuple[Completions, list[Episode]]:
        """n episodes of each row, played to the end: the turn loop. Each turn is one
        engine.generate over the episodes still running, each continuing from its own ids.
        Returns them as completions (everything after the prompt, the mask of the model's
        tokens, the graded answer as text), and the episodes themselves."""
        episodes, seconds, version, logprobs = self.start(rows, n), 0.0, None, False
        longest = getattr(engine, "max_model_len", 0)  # (the HF engine has no limit)
        prompt_tokens = cached_tokens = 0
        compute_floor = memory_floor = 0.0
        for turn in range(self.max_turns):
            running = [e for e in episodes if not e.done]
            if not running:
                break
            # Each turn draws anew; the HF engine keeps each episode's keys and values for the
            # next turn, which then prefills only the tool result (vLLM: prefix caching).
            seeded = replace(sampling, seed=None if sampling.seed is None else
                             request_seed(sampling.seed, turn),
                             keep_cache=turn + 1 < self.max_turns)
            # Each episode's room is its own: one generate call, as long as the roomiest needs,
            # and each turn cut to its episode's room (the tokens before a cut are sampled as
            # they would be without it), as TRL truncates each sample.
            budgets = [self.budget(e, longest) for e in running]
            rooms = [max(1, min(budget - len(e.ids), seeded.max_new_tokens))
                     for e, budget in zip(running, budgets)]
            out = engine.generate([e.prompt_ids + e.ids for e in running], 1,
                                  replace(seeded, max_new_tokens=max(rooms)))
            seconds += out.seconds
            prompt_tokens, cached_tokens = prompt_tokens + out.prompt_tokens, \
                cached_tokens + out.cached_tokens
            compute_floor, memory_floor = compute_floor + out.compute_floor, \
                memory_floor + out.memory_floor
            version = out.policy_version if version is None else min(version, out.policy_version)
            logprobs = out.engine_logprobs is not None
            for i, (e, room, budget) in enumerate(zip(running, rooms, budgets)):
                tokens = out.completion_ids[i]
                turn_logprobs = out.engine_logprobs[i] if logprobs else [0.0] * len(tokens)
                cut = out.truncated[i] or len(tokens) > room
                _model_turn(self.chat, e, tokens[:room], turn_logprobs[:room], cut,
                            last=turn + 1 == self.max_turns, max_tokens=budget)
        release = getattr(engine, "release_kept", None)  # (engines that keep nothing have none)
        if release:
            release()
        comps = Completions([e.prompt_ids for e in episodes], [e.ids for e in episodes],
                            [e.truncated for e in episodes], [e.answer for e in episodes],
                            [e.logprobs for e in episodes] if logprobs else None, version or 0,
                            seconds, [e.mask for e in episodes], prompt_tokens, cached_tokens,
                            compute_floor, memory_floor)
        return comps, episodes


def _model_turn(chat: ToolChat, e: Episode, tokens, logprobs, cut: bool, last: bool,
                max_tokens: int):
    """Append one sampled turn to episode `e`, run its tool calls and append their results."""
    message = chat.parse(e.prompt_ids + e.ids, tokens)
    e.ids += tokens
    e.mask += [True] * len(tokens)
    e.logprobs += logprobs
    e.turns += 1
    calls = message.pop("tool_calls", [])
    malformed = message.pop("malformed", None)
    e.messages.append({"role": "assistant", **message, **({"tool_calls": calls} if calls else {})})
    if cut or last or not (calls or malformed):  # the answer, or out of room
        e.done, e.truncated = True, cut or bool(last and (calls or malformed))
        return
    results = [("error", f"error: malformed tool call ({malformed})")] if malformed else \
        [call_tool(chat, e, call) for call in calls]
    e.tool_errors += sum(text.startswith("error:") for _, text in results)
    e.messages += [{"role": "tool", "name": name, "content": text} for name, text in results]
    observation = chat.observation_ids(results)
    if len(e.ids) + len(observation) >= max_tokens:  # no room for another turn
        e.done = e.truncated = True
        return
    e.ids += observation
    e.mask += [False] * len(observation)
    e.logprobs += [0.0] * len(observation)


def call_tool(chat: ToolChat, e: Episode, call: dict) -> tuple[str, str]:
    """(tool name, result text) for one call; whatever goes wrong becomes an "error: ..." result
    the model reads, never an exception in the trainer."""
    function = call.get("function") if isinstance(call, dict) else None
    e.tool_calls += 1
    if not isinstance(function, dict):  # e.g. <tool_call>"calculator"</tool_call>
        return "error", 'error: a tool call is {"name": <tool name>, "arguments": {...}}'
    name, arguments = function.get("name"), function.get("arguments")
    tools = {fn.__name__: fn for fn in chat.tools + (environment_tools(e.env) if e.env else [])}
    if not isinstance(name, str) or name not in tools:  # (a list or an object is no name)
        shown = json.dumps(name)[:100]
        return "error", f"error: no tool named {shown}; the tools are {', '.join(tools)}"
    if not isinstance(arguments, dict):
        return name, "error: the arguments must be a JSON object"
    t0 = time.perf_counter()
    try:
        result = tools[name](**arguments)
        if inspect.isawaitable(result):
            result = run_coroutine(result)
        text = result if isinstance(result, str) else json.dumps(result, default=str)
    except Exception as error:  # a wrong argument, a failing tool: the model is told
        text = f"error: {type(error).__name__}: {error}"
    e.tool_seconds += time.perf_counter() - t0
    return name, text


def episode_metrics(episodes: list[Episode]) -> dict:
    """Per batch of episodes. tool_calls (calls per episode) and tool_failure_frequency (failed
    calls per call) are TRL's tools/call_frequency and tools/failure_frequency; tool_use is the
    fraction of episodes that called a tool at all."""
    n, calls = max(len(episodes), 1), sum(e.tool_calls for e in episodes)
    errors = sum(e.tool_errors for e in episodes)
    return {"turns": sum(e.turns for e in episodes) / n,
            "tool_calls": calls / n,
            "tool_use": sum(e.tool_calls > 0 for e in episodes) / n,
            "tool_errors": errors,
            "tool_failure_frequency": errors / calls if calls else 0.0,
            "tool_seconds": sum(e.tool_seconds for e in episodes),
            "truncated_episodes": sum(e.truncated for e in episodes) / n}


# ---------------------------------------------------------------------------------------------
# A built-in environment, in TRL's shape (the `guess` task, data.GENERATED).


class GuessTheNumber:
    """Find a secret whole number from 1 to 16; every guess is answered "higher" or "lower". The
    episode scores 1 for finding it, 0.1 less for every guess after the first, 0 if not found."""

    def reset(self, secret, **row):
        self.secret, self.guesses, self.found = int(secret), 0, False

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: your guess, a whole number from 1 to 16
        """
        self.guesses += 1
        if int(number) == self.secret:
            self.found = True
            return "correct: you found it"
        return "higher" if self.secret > int(number) else "lower"

    def get_reward(self) -> float:
        return max(0.0, 1.0 - 0.1 * (self.guesses - 1)) if self.found else 0.0

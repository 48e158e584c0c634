"""TRL's dataset formats, checked row by row before any model loads: one line that names the file,
the row and the field for anything wrong. sft.py reads the SFT formats, dpo.py and rm.py the
preference format -- unchanged from TRL's, so a dataset made for TRL works as it is:

    SFT         messages (conversational: assistant tool_calls, tool messages, an optional tools
                column of JSON schemas) | prompt + completion (strings, or chat messages) | text
    preference  prompt, chosen, rejected: strings, or lists of chat messages (implicit prompt:
                chosen and rejected as whole conversations, without a prompt column)

What the rows mean -- which tokens are trained, how a pair is tokenized -- is the algorithm's.
"""

import json
import math
from dataclasses import dataclass

from data import InputError


# ---------------------------------------------------------------------------------------------
# SFT: messages, prompt-completion, text.


@dataclass
class Sample:
    """One data row, checked: chat messages, or plain text."""
    row: int  # the row's number in the data (from 1), for the messages that name it
    messages: list[dict]  # conversational rows ([] for plain text)
    trained_from: int  # messages before this one are the prompt: context, never trained
    tools: list[dict] | None  # the tools the row declares (JSON schemas); None: the run's
    prompt: str = ""  # plain text: the context (a prompt-completion's prompt; "" for `text`)
    completion: str = ""  # plain text: what is trained (the whole `text`)


ROLES = ("system", "user", "assistant", "tool")
CALL_SHAPE = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'


def check_samples(rows: list, source: str, cfg, run_tools: set[str]) -> list[Sample]:
    """Every row, before any model loads, in the format the first row's columns name: messages,
    prompt + completion, or text (TRL's). A missing column, a row with nothing to train, a
    malformed tool call or one to a tool the row does not declare stops with one line that names
    the row and the field. run_tools: the names of --tools/--env's tools."""
    first = rows[0] if rows and isinstance(rows[0], dict) else {}
    kind = ("messages" if cfg.messages_field in first else
            "prompt-completion" if cfg.prompt_field in first else
            "text" if cfg.text_field in first else None)
    if kind is None:
        raise InputError(f"{source}: row 1 has none of the columns '{cfg.messages_field}', "
                         f"'{cfg.prompt_field}' + '{cfg.completion_field}', '{cfg.text_field}' "
                         f"(TRL's SFT formats; other names: --messages-field, --prompt-field, ...)")
    fields = {"messages": [cfg.messages_field], "text": [cfg.text_field],
              "prompt-completion": [cfg.prompt_field, cfg.completion_field]}[kind]
    samples = []
    for i, row in enumerate(rows, start=1):
        where = f"{source}: row {i}"
        for field in fields:
            if not isinstance(row, dict) or row.get(field) in (None, "", []):
                raise InputError(f"{where} has no '{field}' field (or it is empty)")
        tools = _declared_tools(row.get(cfg.tools_field), f"{where}, '{cfg.tools_field}'")
        if kind == "text":
            if not isinstance(row[cfg.text_field], str):
                raise InputError(f"{where}, '{cfg.text_field}': not a string")
            samples.append(_plain(row[cfg.text_field], "", i, f"{where}, '{cfg.text_field}'"))
            continue
        prompt = row[cfg.prompt_field] if kind == "prompt-completion" else []
        body = row[cfg.completion_field if kind == "prompt-completion" else cfg.messages_field]
        if kind == "messages" and not isinstance(body, list):
            raise InputError(f"{where}, '{cfg.messages_field}': not a list of chat messages")
        if isinstance(prompt, str) and isinstance(body, str):  # plain prompt-completion
            samples.append(_plain(body, prompt, i, f"{where}, '{cfg.completion_field}'"))
            continue
        names = run_tools if tools is None else {t["function"]["name"] for t in tools}
        prompt = _messages(prompt, f"{where}, '{cfg.prompt_field}'", names)
        body = _messages(body, f"{where}, '{fields[-1]}'", names)
        if not any(m["role"] == "assistant" for m in body):
            raise InputError(f"{where}, '{fields[-1]}': no assistant turn (nothing to train)")
        samples.append(Sample(i, prompt + body, len(prompt), tools))
    return samples


def _plain(completion, prompt, row: int, where: str) -> Sample:
    if not isinstance(completion, str) or not isinstance(prompt, str):
        raise InputError(f"{where}: the prompt and the completion must both be strings or both "
                         f"chat messages")
    return Sample(row, [], 0, None, prompt, completion)


def _declared_tools(value, where: str) -> list[dict] | None:
    """A row's `tools`: JSON schemas, as a list or a JSON string of one (TRL accepts both)."""
    if value is None:
        return None
    try:
        tools = json.loads(value) if isinstance(value, str) else value
    except (ValueError, RecursionError):  # (also a number past 4,300 digits, too deep a nesting)
        raise InputError(f"{where} is not valid JSON") from None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise InputError(f"{where} is not a list of tool JSON schemas "
                         f'({{"type": "function", "function": {{"name": ..., ...}}}})')
    return tools


def _messages(value, where: str, tools: set[str]) -> list[dict]:
    """Chat messages, checked; tool-call arguments given as a JSON string become an object, as
    the model is to write them."""
    if isinstance(value, str) or not isinstance(value, list):
        raise InputError(f"{where}: the prompt and the completion must both be strings or both "
                         f"chat messages")
    out = []
    for j, m in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InputError(f"{at} is not a message with a role ({', '.join(ROLES)})")
        calls = m.get("tool_calls") or []
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise InputError(f"{at} has no 'content' string")
        if calls and m["role"] != "assistant":
            raise InputError(f"{at}: only assistant messages make tool calls")
        if not isinstance(calls, list):
            raise InputError(f"{at}: 'tool_calls' is not a list of {CALL_SHAPE}")
        m = {**m, "content": m.get("content") or ""}
        if calls:
            m["tool_calls"] = [_tool_call(c, f"{at}.tool_calls[{k}]", tools)
                               for k, c in enumerate(calls)]
        else:
            m.pop("tool_calls", None)
        out.append(m)
    return out


def _tool_call(call, where: str, tools: set[str]) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # (also a number past 4,300 digits, too deep a nesting)
            arguments = None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(arguments, dict) and call.get("type", "function") == "function"):
        raise InputError(f"{where} is not {CALL_SHAPE}")
    if function["name"] not in tools:
        raise InputError(f"{where} calls tool {function['name']!r}, which the row does not "
                         f"declare (declared: {', '.join(sorted(tools)) or 'none'}; a row declares "
                         f"tools in its tools column, a run with --tools or --env)")
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


# ---------------------------------------------------------------------------------------------
# Preference pairs: prompt, chosen, rejected.


def check_pairs(rows, source, cfg, need_prompt: bool = True, margin_field: str = "") -> list[dict]:
    """Every row, before any model loads: {prompt, chosen, rejected, margin} from the configured
    columns, each a non-empty string or a list of {role, content} messages (TRL's preference
    format). Without a prompt column in row 1 the prompt is implicit (TRL's): conversations share
    it as their common first messages; plain strings have none ("": an error where need_prompt).
    margin_field: an optional numeric column (TRL's RewardTrainer's `margin`), else 0."""
    first = rows[0] if rows and isinstance(rows[0], dict) else {}
    explicit = cfg.prompt_field in first
    out = []
    for i, row in enumerate(rows, start=1):
        pair = {}
        fields = (("prompt", cfg.prompt_field),) if explicit else ()
        for key, field in fields + (("chosen", cfg.chosen_field), ("rejected", cfg.rejected_field)):
            value = row.get(field) if isinstance(row, dict) else None
            if value is None or value in ("", []) or (isinstance(value, str) and not value.strip()):
                raise InputError(f"{source}: row {i} has no '{field}' field (or it is empty)")
            if not isinstance(value, (str, list)):  # (a number, an object: no text to render)
                raise InputError(f"{source}: row {i}: '{field}' is neither a string nor a list of "
                                 f"{{'role', 'content'}} messages")
            if isinstance(value, list) and not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]
                    and isinstance(m.get("content"), str) for m in value):
                raise InputError(f"{source}: row {i}: '{field}' is a list but not of "
                                 f"{{'role', 'content'}} messages")
            pair[key] = value
        if not explicit:
            pair.update(_implicit_prompt(pair["chosen"], pair["rejected"], f"{source}: row {i}",
                                         need_prompt, cfg.prompt_field))
        out.append({**pair, "margin": _margin(row, margin_field, f"{source}: row {i}")})
    return out


def _margin(row: dict, field: str, where: str) -> float:
    """A row's margin: a finite number (a numeric string too: a CSV's cells are text); 0 without
    the column. NaN or inf would make every loss it enters NaN or inf."""
    value = row.get(field, 0.0) if field else 0.0
    try:
        margin = float(value) if isinstance(value, (int, float, str)) and \
            not isinstance(value, bool) else None
    except ValueError:
        margin = None
    if margin is None:
        raise InputError(f"{where}: '{field}' is not a number")
    if not math.isfinite(margin):
        raise InputError(f"{where}: '{field}' is not a finite number ({value})")
    return margin


def _implicit_prompt(chosen, rejected, where: str, need_prompt: bool, prompt_field: str) -> dict:
    """TRL's implicit prompt: the messages both conversations begin with."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        k = 0
        while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
            k += 1
        if k and chosen[k:] and rejected[k:]:
            return {"prompt": chosen[:k], "chosen": chosen[k:], "rejected": rejected[k:]}
    if need_prompt:
        raise InputError(f"{where} has no '{prompt_field}' field, and chosen and rejected share no "
                         f"first messages to take as the prompt (TRL's implicit prompt)")
    return {"prompt": "", "chosen": chosen, "rejected": rejected}

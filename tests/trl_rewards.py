"""Reward functions written the way TRL's documentation writes them, to show they run unchanged.

Each takes the completions (and any dataset column it needs) by keyword and swallows the rest in
**kwargs; for conversational data a completion is [{"role": "assistant", "content": ...}].
"""

import asyncio
import re


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def length_penalty(completions, **kwargs):
    """Prefer answers of about 20 characters."""
    return [-abs(20 - len(_text(c))) / 20 for c in completions]


def tagged_format(completions, **kwargs):
    """1 when the completion wraps its answer in <answer>...</answer>."""
    return [1.0 if re.search(r"<answer>.*?</answer>", _text(c), re.DOTALL) else 0.0
            for c in completions]


def matches_solution(completions, solution, **kwargs):
    """1 when the solution column's number appears in the completion."""
    return [float(str(s).strip() in _text(c)) for c, s in zip(completions, solution)]


def only_for_long_prompts(prompts, completions, **kwargs):
    """None ("does not apply") for prompts of fewer than 5 words."""
    words = [len((p[-1]["content"] if isinstance(p, list) else p).split()) for p in prompts]
    return [None if n < 5 else 0.5 for n in words]


async def judged_remotely(completions, **kwargs):
    """An async reward, as one that calls a judge model over the network would be."""
    await asyncio.sleep(0.01)
    return [float(len(_text(c)) % 3 == 0) for c in completions]


def needs_a_label(completions, label):
    """Mis-declared for data without a `label` column: must stop the run at startup."""
    return [float(x) for x in label]

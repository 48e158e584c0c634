"""Reward functions that grpo.py subprocesses in the tests load by name (--reward tests.rewards:fn)."""


def parity_reward(prompts, completions, **_):
    """A random model earns it about half the time: groups have signal, every step updates."""
    return [float(len(c) % 2) for c in completions]


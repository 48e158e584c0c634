"""Reward functions that grpo.py subprocesses in the tests load by name (--reward tests.rewards:fn)."""


def parity_reward(prompts, completions, **_):
    """A random model earns it about half the time: groups have signal, every step updates."""
    return [float(len(c) % 2) for c in completions]



def slow_reward(prompts, completions, **_):
    """A run that holds its --out for ten minutes (the lock test ends it sooner, by kill -9)."""
    import time
    time.sleep(600)
    return [0.0] * len(completions)

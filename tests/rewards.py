"""Reward functions that grpo.py subprocesses in the tests load by name (--reward tests.rewards:fn)."""


def parity_reward(prompts, completions, **_):
    """A random model earns it about half the time: groups have signal, every step updates."""
    return [float(len(c) % 2) for c in completions]



def slow_reward(prompts, completions, **_):
    """A run that holds its --out for ten minutes (the lock test ends it sooner, by kill -9)."""
    import time
    time.sleep(600)
    return [0.0] * len(completions)


def parity_held_at_step_2(prompts, completions, **_):
    """parity_reward; in a run started with $SMOLRL_TEST_HOLD naming a file, step 2's call (its
    second) waits until that file exists -- a test makes it after its signal, so that the signal
    lands inside step 2 -- or, with $SMOLRL_TEST_HOLD=stuck, for ten minutes (a step that outlasts
    the grace after a signal). $SMOLRL_TEST_HELD names a file made as the wait begins: a test
    signals only then, however slowly a loaded machine gets the run there."""
    import os
    import time
    _calls.append(1)
    hold = os.environ.get("SMOLRL_TEST_HOLD")
    if hold and len(_calls) == 2:
        if os.environ.get("SMOLRL_TEST_HELD"):
            open(os.environ["SMOLRL_TEST_HELD"], "w").close()
        until = time.time() + 600
        while time.time() < until and (hold == "stuck" or not os.path.exists(hold)):
            time.sleep(0.02)
    return parity_reward(prompts, completions)


_calls = []

"""A tool and an environment written as TRL's GRPOTrainer takes them (tools=[add],
environment_factory=CounterEnv), to show they run unchanged with --tools and --env."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer

    Returns:
        Their sum.
    """
    return a + b


class CounterEnv:
    """Count up to a target: each episode gets a fresh instance, reset with its data row."""

    def reset(self, **kwargs) -> str:
        self.count, self.target = 0, 3
        return f" Reach {self.target} by calling increment."

    def increment(self, step: int) -> int:
        """Add a step to the counter.

        Args:
            step: how much to add

        Returns:
            The counter's new value.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


def reached_target(completions, environments, **kwargs):
    """A reward function reading the environments, as TRL passes them."""
    return [0.5 * float(env.count >= env.target) for env in environments]

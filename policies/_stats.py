"""Discounted per-(bucket, arm) statistics of the reward every learning policy shares.

The reward of an observation is ``log(goodput / b)``: the log of tokens per second per running
request. Goodput itself grows with ``b`` inside a bucket, and a bucket covers a range of batch
sizes; per request, it varies slowly there, so arms seen at slightly different batch sizes
stay comparable. On a log scale a difference of 0.02 is "2 % more goodput" on every profile,
so one set of parameters fits an 8B model on an H200 and a 1T MoE on PCIe cards alike.

Each observation weighs as many decode steps as it holds, so a 1000-step interval counts 100
times a 10-step one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies._base import Observation

__all__ = ["ArmStats", "discount", "forgetting", "reward"]


def discount(memory: float) -> float:
    """The factor one unit (a decode step, a request-step) ages counts by under a memory of
    ``memory`` units; 1 for an infinite memory."""
    return 1.0 if math.isinf(memory) else 1.0 - 1.0 / memory


def forgetting(per_steps: float, busy_s: float, memory_s: float) -> float:
    """The discount of one observation: ``per_steps`` (its decode steps' discount) or, where
    that forgets more slowly, its busy seconds' against a memory of ``memory_s``. A server
    that runs a few decode steps a second would otherwise remember for many minutes."""
    return min(per_steps, math.exp(-busy_s / memory_s))


def reward(obs: Observation) -> float:
    """``log(emitted / (b * busy_s))`` of a usable observation (see the module docstring)."""
    return math.log(obs.emitted_tokens / (obs.b * obs.busy_s))


@dataclass(slots=True)
class ArmStats:
    """Discounted sufficient statistics of one arm in one bucket.

    ``w`` is the discounted weight in decode steps, ``s``/``q`` the weighted sums of the reward
    and its square, ``n`` the discounted number of observations, ``wb`` the weighted sum of
    batch sizes (to turn the per-request reward back into tokens/s), ``steps`` the raw decode
    steps ever seen (never discounted).
    """

    w: float = 0.0
    s: float = 0.0
    q: float = 0.0
    n: float = 0.0
    wb: float = 0.0
    steps: int = 0

    def decay(self, factor: float) -> None:
        self.w *= factor
        self.s *= factor
        self.q *= factor
        self.n *= factor
        self.wb *= factor

    def add(self, r: float, weight: float, obs_weight: float, b: int, steps: int) -> None:
        self.w += weight
        self.s += weight * r
        self.q += weight * r * r
        self.n += obs_weight
        self.wb += weight * b
        self.steps += steps

    @property
    def seen(self) -> bool:
        return self.w > 0.0

    @property
    def mean(self) -> float:
        return self.s / self.w if self.w > 0 else float("nan")

    @property
    def mean_b(self) -> float:
        return self.wb / self.w if self.w > 0 else float("nan")

    @property
    def resid(self) -> float:
        """Weighted squared residuals of the observations about their mean."""
        return max(self.q - self.s * self.s / self.w, 0.0) if self.w > 0 else 0.0

    def step_sd(self, prior_sd: float, prior_obs: float) -> float:
        """Standard deviation of one decode step's reward, shrunk towards ``prior_sd``.

        An observation aggregating ``m`` steps has variance ``sd**2 / m``, so the weighted
        squared residuals estimate ``(n - 1) * sd**2``.
        """
        dof = max(self.n - 1.0, 0.0)
        return math.sqrt((prior_obs * prior_sd * prior_sd + self.resid) / (prior_obs + dof))

    def mean_sd(self, prior_sd: float, prior_obs: float) -> float:
        """Posterior standard deviation of :attr:`mean` (infinite when unseen)."""
        if self.w <= 0:
            return math.inf
        return self.step_sd(prior_sd, prior_obs) / math.sqrt(self.w)

    def goodput(self) -> float:
        """The mean reward back in tokens/s at this arm's mean batch size."""
        return self.mean_b * math.exp(self.mean) if self.w > 0 else float("nan")

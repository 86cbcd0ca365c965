"""Discounted Thompson sampling per bucket over arms.

Each arm's mean log goodput per request has a Gaussian posterior (mean and spread from the
discounted, step-weighted statistics of :mod:`policies._stats`); each decision draws one
sample per arm and runs the largest. Discounting lets an arm's posterior widen again when it
has not been run for a while, so a workload that changes gets re-explored. An arm never run in
a bucket borrows its gap to the best arm from the nearest bucket that ran it (goodput is
smooth in the batch size), widened with the distance; with no such bucket it is drawn around
the bucket's best mean. So a new bucket tries the arms its neighbours found close, and
rarely the ones they found far behind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies._learning import LearnerParams, LearningPolicy, _require

__all__ = ["DEFAULT_SAMPLE_SCALE", "DEFAULT_UNTRIED_SD", "ThompsonParams", "ThompsonPolicy"]

# Posterior draws are scaled by this; > 1 explores more.
DEFAULT_SAMPLE_SCALE = 1.0
# Spread (log goodput) of an arm never run in a bucket around the bucket's best mean.
DEFAULT_UNTRIED_SD = 0.3


@dataclass(frozen=True, kw_only=True)
class ThompsonParams(LearnerParams):
    """:class:`LearnerParams` plus ``sample_scale`` and ``untried_sd`` (both > 0)."""

    sample_scale: float = DEFAULT_SAMPLE_SCALE
    untried_sd: float = DEFAULT_UNTRIED_SD

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 < self.sample_scale < math.inf, "sample_scale", "positive and finite",
                 self.sample_scale)
        _require(0 < self.untried_sd < math.inf, "untried_sd", "positive and finite",
                 self.untried_sd)


class ThompsonPolicy(LearningPolicy):
    """Discounted Thompson sampling (name ``"thompson"``). See the module docstring."""

    name = "thompson"
    params_class = ThompsonParams
    params: ThompsonParams

    def _explore(self, j: int, greedy: int) -> int:
        p, st, gauss = self.params, self._state[j], self._rng.gauss
        seen = [st.stats[a].mean for a in self.arms if st.stats[a].seen]
        base = max(seen) if seen else 0.0
        best_arm, best_draw = greedy, -math.inf
        for arm in self.arms:  # fixed order: one draw per arm, reproducible for a seed
            a = st.stats[arm]
            if a.seen:
                draw = a.mean + p.sample_scale * self._mean_sd(a) * gauss(0, 1)
            else:
                prior = self._borrowed(j, arm)
                mean, sd = prior if prior is not None else (base, p.untried_sd)
                draw = mean + sd * gauss(0, 1)
            if draw > best_draw:
                best_arm, best_draw = arm, draw
        return best_arm

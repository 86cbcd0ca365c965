"""Discounted UCB-tuned per bucket over arms.

Index of an arm: ``mean + c · sd · sqrt(2 · ln(W) / w)`` where ``mean`` is its discounted
mean log goodput per request, ``sd`` the *measured* per-step standard deviation (the "tuned"
part, after Auer et al.: noisy arms get wider bonuses than steady ones), ``w`` its discounted
decode steps and ``W`` the bucket's. Discounting (Garivier & Moulines) lets old evidence fade,
so a changed workload is re-explored. Arms never run in a bucket come first, nearest to the
greedy arm first. Deterministic: no random draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies._learning import LearnerParams, LearningPolicy, _require

__all__ = ["DEFAULT_UCB_C", "UCBParams", "UCBPolicy"]

# Scales the confidence bonus; 1 is the textbook width.
DEFAULT_UCB_C = 1.0


@dataclass(frozen=True, kw_only=True)
class UCBParams(LearnerParams):
    """:class:`LearnerParams` plus ``c`` (> 0), the width of the confidence bonus."""

    c: float = DEFAULT_UCB_C

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 < self.c < math.inf, "c", "positive and finite", self.c)


class UCBPolicy(LearningPolicy):
    """Discounted UCB-tuned (name ``"ucb"``). See the module docstring."""

    name = "ucb"
    params_class = UCBParams
    params: UCBParams

    def _explore(self, j: int, greedy: int) -> int:
        p, st = self.params, self._state[j]
        untried = [a for a in self.arms if not st.stats[a].seen]
        if untried:
            return min(untried, key=lambda a: (abs(a - greedy), a))
        total = sum(st.stats[a].w for a in self.arms)
        log_total = math.log(max(total, math.e))
        best_arm, best_index = greedy, -math.inf
        for arm in self.arms:
            a = st.stats[arm]
            # mean_sd * sqrt(w) is the (tuned) per-step spread of this arm.
            index = a.mean + p.c * self._mean_sd(a) * math.sqrt(2.0 * log_total)
            if index > best_index:
                best_arm, best_index = arm, index
        return best_arm

"""What a decode step costs the engine: padded batch sizes and step times, computed once."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from tuner.sim.graphs import pad_batch_size
from tuner.sim.profiles import CostProfile
from tuner.sim.tree import TreeArm

__all__ = ["StepCosts"]


class StepCosts:
    """Padded size and step time for every batch size and arm up to the running cap.

    Computing them up front both speeds the engine's hot loop and refuses, before anything
    runs, a profile that cannot cost the cap. With ``step_noise`` σ > 0 each step's time is
    multiplied by a mean-one lognormal factor ``exp(σ·Z − σ²/2)`` drawn from ``noise_rng``.

    Raises:
        ProfileRangeError: the profile cannot cost a batch up to ``max_running``.
    """

    def __init__(
        self,
        profile: CostProfile,
        arms: Iterable[int],
        *,
        max_running: int,
        graph_bs: list[int],
        skip_zero_draft_extend: bool,
        tree: TreeArm | None,
        step_noise: float,
        noise_rng: np.random.Generator,
    ) -> None:
        self.graph_bs = graph_bs
        self.graph_max = graph_bs[-1] if graph_bs else 0
        self.pad = [0] + [pad_batch_size(b, graph_bs) for b in range(1, max_running + 1)]
        self._arms = tuple(arms)
        self._cost: dict[tuple[int, int], float] = {}
        for pb in set(self.pad[1:]):
            for k in self._arms:
                self._cost[(pb, k)] = profile.step_s(
                    pb, k, skip_zero_draft_extend=skip_zero_draft_extend
                )
        # A tree server's non-zero arm is its tree (tuner.sim.tree), with its own cost.
        if tree is not None:
            for pb in set(self.pad[1:]):
                self._cost[(pb, tree.steps)] = tree.step_s(profile, pb)
        self.step_noise = step_noise
        self._noise_rng = noise_rng

    def padded(self, b: int) -> int:
        """The CUDA-graph batch size a decode of ``b`` requests runs at."""
        return self.pad[b] if b < len(self.pad) else pad_batch_size(b, self.graph_bs)

    def expected_s(self, pb: int, k: int) -> float:
        """Expected (noise-free) time of a decode step padded to ``pb`` at arm ``k``."""
        return self._cost[(pb, k)]

    def step_s(self, n: int, pb: int, k: int) -> float:
        """Time of one decode step of ``n`` requests (padded to ``pb``) at arm ``k``."""
        dt = self._cost.get((pb, k))
        if dt is None:  # an arm outside the built set cannot come from a validated table
            raise RuntimeError(
                f"table gave arm {k} not among built arms {self._arms} (b={n}, padded {pb})"
            )
        if self.step_noise:
            z = self._noise_rng.standard_normal()
            dt *= math.exp(self.step_noise * z - self.step_noise**2 / 2)
        return dt

"""What a decode step costs the engine: padded batch sizes and step times, computed once."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tuner.sim.graphs import pad_batch_size
from tuner.sim.profiles import CostProfile
from tuner.sim.tree import TreeArm

__all__ = ["MachineDrift", "StepCosts"]


@dataclass(frozen=True, slots=True)
class MachineDrift:
    """A machine whose speed wanders over minutes (a loaded CPU server, other tenants): every
    decode step's time is multiplied by ``exp(x - sd²/2)``, ``x`` an Ornstein-Uhlenbeck
    process in the engine's busy seconds, stationary spread ``sd`` (log), correlation time
    ``tau_s``. Arms run at different times then meet different machines, as on a real one.
    """

    sd: float
    tau_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sd) and 0.0 <= self.sd <= 1.0):
            raise ValueError(f"machine drift sd must be in [0, 1], got {self.sd}")
        if not (math.isfinite(self.tau_s) and self.tau_s > 0):
            raise ValueError(f"machine drift time must be positive, got {self.tau_s}")

    @classmethod
    def parse(cls, text: str) -> MachineDrift:
        """``"SD:TAU_S"``, e.g. ``"0.2:60"``: 20 % spread, correlated over a minute."""
        sd, sep, tau = text.partition(":")
        try:
            return cls(float(sd), float(tau) if sep else 60.0)
        except ValueError as exc:
            raise ValueError(f"machine drift {text!r}: expected SD:SECONDS ({exc})") from None


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
        machine_drift: MachineDrift | None = None,
        drift_rng: np.random.Generator | None = None,
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
        self.machine_drift = machine_drift
        self._drift_rng = drift_rng if drift_rng is not None else np.random.default_rng(0)
        self._drift_x = 0.0  # the machine's log speed now (its stationary mean is 0)

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
        md = self.machine_drift
        if md is not None and md.sd:
            dt *= math.exp(self._drift_x - md.sd**2 / 2)
            keep = math.exp(-dt / md.tau_s)
            self._drift_x = (keep * self._drift_x
                             + md.sd * math.sqrt(1.0 - keep * keep)
                             * self._drift_rng.standard_normal())
        return dt

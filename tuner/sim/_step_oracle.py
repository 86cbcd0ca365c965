"""The per-step oracle: each decode step's best arm for the very requests in that batch.

The per-bucket oracle (:mod:`tuner.sim.oracle`) picks one arm per batch size from the
workload's acceptance distribution. This one knows every running request's own acceptance
row — its α, the shape the world gives its class, its drift at its progress, a stale draft
state — and picks, per step, the arm with the highest expected goodput of that batch:
``(n + expected accepted drafts) / expected step time`` at the padded size. It is myopic, as
the per-bucket oracle is: it does not weigh what a step at ``k = 0`` does to later steps when
the draft extend is skipped.

The engine calls :meth:`StepOracle.step` at every decode launch. The values of every arm for
the running batch are cached until a row changes (an admission, a finish, stale draft state,
drift), so a step costs a comparison and an addition. Sums are kept per batch size and taken
by the bench once per reading: busy seconds, and busy-weighted expected goodput of every arm,
of the best arm per step, and of the arm that ran; every arm's also per acceptance band the
step was decided in, so that a banded table can be judged on steps it did not run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["StepOracle", "StepOracleSums"]


class _Rows(Protocol):
    version: int

    def sync(self, n: int) -> None: ...

    def expected_drafts(self, n: int, arms: tuple[int, ...]) -> list[float]: ...


@dataclass(frozen=True)
class StepOracleSums:
    """Decode steps of one batch size since the last :meth:`StepOracle.take`.

    Attributes:
        busy_s: the steps' time.
        arm_tokens: per arm (in :attr:`StepOracle.arms`' order), ``Σ dt · goodput`` had every
            step run that arm: expected tokens per busy second, times busy seconds.
        best_tokens: the same with each step's best arm (the per-step oracle).
        ran_tokens: the same with the arm each step ran.
        band_tokens: ``arm_tokens`` split by the acceptance band each step's arm was looked
            up in (0: unknown); what a banded table would have yielded on these steps.
    """

    busy_s: float
    arm_tokens: tuple[float, ...]
    best_tokens: float
    ran_tokens: float
    band_tokens: Mapping[int, tuple[float, ...]] = field(default_factory=dict)


class StepOracle:
    """Per decode step, every arm's expected goodput for the batch that runs.

    Plain floats rather than numpy past the one column sum: a handful of arms, recomputed at
    nearly every step of a large batch (some request joins or leaves), where numpy's per-call
    cost would dominate.

    Args:
        arms: the arms the server built.
        step_s: expected (noise-free) time of a step padded to ``pb`` at arm ``k``.
    """

    def __init__(self, arms: Iterable[int], step_s: Callable[[int, int], float]) -> None:
        self.arms = tuple(sorted(set(arms)))
        self._index = {k: i for i, k in enumerate(self.arms)}
        self._step_s = step_s
        self._inv_cost: dict[int, list[float]] = {}
        self._sums: dict[int, list[float]] = {}  # b -> [busy, best, ran]
        # b -> band -> arm tokens (summed over bands at take(): the arm tokens of b)
        self._bands: dict[int, dict[int, list[float]]] = {}
        # The batch being accumulated: its cache key, arm values and best, the arm it runs
        # and the busy seconds not yet added to the sums.
        self._key: tuple[int, int, int] | None = None
        self._values: list[float] = [0.0] * len(self.arms)
        self._best = 0.0
        self._b = 0
        self._k = -1
        self._band = 0
        self._w = 0.0

    def step(self, rows: _Rows, n: int, pb: int, k: int, dt: float, band: int = 0) -> None:
        """A decode step of the first ``n`` rows of ``rows``, padded to ``pb``, launched at
        arm ``k`` (looked up in acceptance band ``band``) and lasting ``dt`` seconds."""
        rows.sync(n)
        key = (n, pb, rows.version)
        if key != self._key:
            if self._w:
                self._flush()
            self._key = key
            inv = self._inv_cost.get(pb)
            if inv is None:
                inv = self._inv_cost[pb] = [1.0 / self._step_s(pb, a) for a in self.arms]
            drafts = rows.expected_drafts(n, self.arms)
            self._values = values = [(n + d) * c for d, c in zip(drafts, inv, strict=True)]
            self._best = max(values)
            self._b = n
        elif (k != self._k or band != self._band) and self._w:
            self._flush()
        self._k, self._band = k, band
        self._w += dt

    def _flush(self) -> None:
        w = self._w
        s = self._sums.get(self._b)
        if s is None:
            s = self._sums[self._b] = [0.0, 0.0, 0.0]
        s[0] += w
        s[1] += w * self._best
        s[2] += w * self._values[self._index[self._k]]
        per_band = self._bands.setdefault(self._b, {})
        t = per_band.get(self._band)
        if t is None:
            t = per_band[self._band] = [0.0] * len(self.arms)
        for i, v in enumerate(self._values):
            t[i] += w * v
        self._w = 0.0

    def take(self) -> dict[int, StepOracleSums]:
        """The sums per batch size since the last call; they start again from zero."""
        if self._w:
            self._flush()
        out = {}
        for b, (busy, best, ran) in self._sums.items():
            bands = {band: tuple(t) for band, t in self._bands[b].items()}
            out[b] = StepOracleSums(busy, tuple(map(sum, zip(*bands.values(), strict=True))),
                                    best, ran, bands)
        self._sums, self._bands = {}, {}
        return out

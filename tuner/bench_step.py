"""The bench's step-level scoring: the per-step oracle, and banded tables scored on their steps.

Part of :mod:`tuner.bench`. Each reading, the engine's :class:`~tuner.sim._step_oracle.StepOracle`
hands over, per batch size, what every arm, each step's best arm and the arm that ran would
have yielded in expectation on the steps that ran (each step's expectation given its own
requests' acceptance rows). Both are turned into factors on the per-bucket oracle's arm over
the same steps, so the luck of which requests happened to run cancels:

- the per-step oracle's goodput at ``b`` is the per-bucket oracle's times
  ``best / oracle arm`` (the headroom, never below one);
- a *banded* table chooses its arm from the batch's acceptance, so its choice is not
  independent of the batch and the workload's expectation per ``(b, k)`` would miss what the
  choice gained: its goodput at ``b`` is the per-bucket oracle's times ``ran / oracle arm``,
  which exceeds the per-bucket oracle where the bands pick better per step. A table that
  decides from ``b`` alone keeps the expectation per ``(b, k)``, exact and noise-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from policies import BasePolicy, band_observations
from tuner.protocol import (
    BAND_EDGES,
    DEPTH_EVERY,
    BandCounter,
    DepthCounter,
    Table,
    band_agnostic,
    band_counter_deltas,
    depth_counter_deltas,
    lookup,
)
from tuner.sim._step_oracle import StepOracleSums

__all__ = ["BandFeed", "StepScore", "greedy_arms", "single_arm_view"]


class BandFeed:
    """Drives a policy as the daemon does a protocol v2 server: one that learns per
    acceptance band (``set_bands``) is fed the band counters' deltas and asked for banded
    tables; any other gets its plain tables. Tree servers stay unbanded."""

    def __init__(self, pol: BasePolicy | None, tree: bool) -> None:
        self.pol: Any = pol
        self.on = pol is not None and not tree and callable(getattr(pol, "set_bands", None))
        if self.on:
            self.pol.set_bands(BAND_EDGES)
        self._prev: tuple[BandCounter, ...] = ()
        self._prev_depths: tuple[DepthCounter, ...] = ()
        update = getattr(pol, "update_depths", None)
        self._update_depths = update if callable(update) else None

    def read(self, bands: tuple[BandCounter, ...], depths: tuple[DepthCounter, ...] = ()) -> None:
        if self.on:  # the engine never restarts, so its counters never go backwards
            for obs in band_observations(band_counter_deltas(self._prev, bands) or ()):
                self.pol.update_bands(obs)
        if self._update_depths is not None:
            for d in depth_counter_deltas(self._prev_depths, depths) or ():
                self._update_depths(d.k, d.counts, DEPTH_EVERY)
        self._prev, self._prev_depths = bands, depths

    def propose(self) -> Any:
        return self.pol.propose_bands() if self.on else self.pol.propose()

    def greedy(self) -> Any:
        return self.pol.greedy_bands() if self.on else self.pol.greedy()


class StepScore:
    """The step-level factors per batch size from the last reading that saw it (telemetry
    commits a step one step late, so a row may carry a step the oracle handed over before).

    Args:
        arms: the arms in the step oracle's order.
    """

    def __init__(self, arms: tuple[int, ...]) -> None:
        self.arms = arms
        self.headroom: dict[int, float] = {}
        self.ran: dict[int, float] = {}

    def read(self, sums: Mapping[int, StepOracleSums], good: Callable[[int, int], float]) -> None:
        """Take one reading's sums; ``good(b, k)`` is the expected goodput of ``k`` at ``b``
        (its first best arm is the per-bucket oracle's, as ``oracle_arm`` breaks ties)."""
        arms = self.arms
        for b, s in sums.items():
            ref = max(range(len(arms)), key=lambda i: (good(b, arms[i]), -i))
            base = s.arm_tokens[ref]
            if base > 0:
                self.headroom[b] = max(s.best_tokens / base, 1.0)
                self.ran[b] = s.ran_tokens / base

    def step_oracle(self, b: int, g_best: float) -> float:
        """The per-step oracle's goodput at ``b`` (``g_best``: the per-bucket oracle's)."""
        return g_best * self.headroom.get(b, 1.0)

    def banded(self, b: int, g_best: float, g_run: float) -> float:
        """A banded table's goodput at ``b`` on the steps it ran (``g_run``, the expectation
        of the arm the row ran, until the oracle has seen ``b``)."""
        r = self.ran.get(b)
        return g_run if r is None else g_best * r


def _is_banded(table: Table) -> bool:
    return bool(table) and isinstance(table[0][1], tuple)


def greedy_arms(table: Table, b: int) -> tuple[int, ...]:
    """The arms a (possibly banded) table gives batch size ``b``: its one arm, or its arm
    per band (unknown band first); a step on any of them is not exploration."""
    if _is_banded(table):
        for bound, ks in table:
            if bound is None or b <= bound:
                return tuple(ks)  # type: ignore[arg-type]
        return tuple(table[-1][1])  # type: ignore[arg-type]
    return (lookup(table, b),)


def single_arm_view(table: Table) -> Table:
    """A banded table's unknown-band arm per row (what a v1 reader sees), else the table."""
    return band_agnostic(table) if _is_banded(table) else table  # type: ignore[arg-type]

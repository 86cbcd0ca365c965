"""The bench's convergence measure: how much of a bucket's traffic passed before its greedy
decision stayed near the oracle (part of :mod:`tuner.bench`).

"Converged" is judged each reading over the bucket's traffic so far in the episode (a new
episode starts when the workload's mix changes), so a few ticks of a load ramp through the
bucket's edge do not outweigh the batch sizes it mostly runs. The greedy decision is
converged when, on that traffic, it yields within :data:`CONVERGE_TOLERANCE` of the
per-bucket oracle, or, where the bucket's two best arms are within :data:`CONVERGE_TIE` of
each other, runs only those two (issue 13: a near tie is not a miss).

A decision by batch size alone is valued, as the phases are, at its arm's expected goodput.
A banded one (an arm per acceptance band) is valued on the steps themselves, as
:mod:`tuner.bench_step` scores a phase: at each batch size, what the row's arm of each band
would have yielded on the steps decided in that band, against the per-bucket oracle's arm on
the same steps, the steps of the estimate's unknown band left out (see ``_value``). Judging
only its band-agnostic arm (what a protocol v1 reader sees) would call a bucket unconverged
whose steps beat the per-bucket oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tuner.bench_results import BucketConvergence
from tuner.bench_step import greedy_arms
from tuner.protocol import Table

__all__ = ["CONVERGE_TIE", "CONVERGE_TOLERANCE", "BucketTrack"]

# "Converged" = the greedy decision within 2 % of the oracle's goodput, or, where the
# bucket's two best arms are within 3 % of each other, either of them.
CONVERGE_TOLERANCE = 0.02
CONVERGE_TIE = 0.03

# good(b, k, mix, t): an arm's expected goodput; best(b, mix, t): the per-bucket oracle's.
Good = Callable[[int, int, int, float], float]
Best = Callable[[int, int, float], float]


@dataclass
class _Episode:
    mix: int
    start_ticks: int
    start_steps: int
    good_since: tuple[int, int] | None = None
    occupancy: dict[int, float] = field(default_factory=dict)  # b -> decode busy seconds
    # b -> band -> per arm, the step oracle's expected tokens on the steps decided in it
    bands: dict[int, dict[int, list[float]]] = field(default_factory=dict)


@dataclass
class BucketTrack:
    """One bucket's convergence bookkeeping over a run: :meth:`tick` per reading with
    traffic, :meth:`result` at the end."""

    ticks: int = 0
    steps: int = 0
    episode: _Episode | None = None
    done: list[tuple[bool, int, int]] = field(default_factory=list)  # (converged, ticks, steps)

    def tick(
        self, mix: int, seen: Sequence[tuple[int, float]], table: Table,
        padded: Callable[[int], int], good: Good, best: Best, t: float, arms: Sequence[int],
        band_tokens: Mapping[int, Mapping[int, Sequence[float]]] | None = None,
    ) -> None:
        """One reading: ``seen`` the bucket's (batch size, busy seconds), ``table`` the
        greedy decision in force, ``band_tokens`` the step oracle's tokens per arm (in
        ``arms``' order) per band, per batch size, for the steps of this reading."""
        if self.episode is not None and self.episode.mix != mix:
            self.close()
        if self.episode is None:
            self.episode = _Episode(mix, self.ticks, self.steps)
        ep = self.episode
        occ = ep.occupancy
        for b, busy in seen:
            occ[b] = occ.get(b, 0.0) + busy
        for b, per_band in (band_tokens or {}).items():
            mine = ep.bands.setdefault(b, {})
            for band, tokens in per_band.items():
                have = mine.setdefault(band, [0.0] * len(arms))
                for i, v in enumerate(tokens):
                    have[i] += v
        rows = {b: greedy_arms(table, padded(b)) for b in occ}
        got = sum(busy * self._value(ep, b, rows[b], good, mix, t, arms)
                  for b, busy in occ.items())
        top = sum(busy * best(b, mix, t) for b, busy in occ.items())
        ok = top <= 0 or got >= (1 - CONVERGE_TOLERANCE) * top
        if not ok and len(arms) > 1:
            # The bucket's arms over its traffic; a near tie of the best two is either's win.
            by_arm = sorted(
                ((sum(busy * good(b, k, mix, t) for b, busy in occ.items()), k) for k in arms),
                reverse=True,
            )
            (g1, k1), (g2, k2) = by_arm[0], by_arm[1]
            ran = {k for row in rows.values() for k in row}
            ok = g2 >= (1 - CONVERGE_TIE) * g1 and ran <= {k1, k2}
        if ok and ep.good_since is None:
            ep.good_since = (self.ticks, self.steps)
        elif not ok:
            ep.good_since = None
        self.ticks += 1

    @staticmethod
    def _value(ep: _Episode, b: int, row: Sequence[int], good: Good, mix: int, t: float,
               arms: Sequence[int]) -> float:
        """The expected goodput of ``row`` (one arm, or one per band, unknown band first)
        at batch size ``b`` over the episode's steps."""
        if len(set(row)) == 1:
            return good(b, row[0], mix, t)
        # The known bands' steps only: the unknown band is a state of the estimate, not of
        # the requests (nearly every step under a row that is off everywhere, nearly none
        # under one that drafts), so its steps say nothing of how another row would fare.
        known = {band: tokens for band, tokens in ep.bands.get(b, {}).items() if band > 0}
        values = [good(b, k, mix, t) for k in arms]
        ref = values.index(max(values))  # the per-bucket oracle's arm (its first best)
        base = sum(tokens[ref] for tokens in known.values())
        if base <= 0:  # no known band's step of b seen yet: the unknown band's arm
            return values[arms.index(row[0])]
        ran = sum(tokens[arms.index(row[band])] for band, tokens in known.items())
        return values[ref] * ran / base

    def close(self) -> None:
        """End the current episode (the workload's mix changed, or the run ended)."""
        ep = self.episode
        if ep is None:
            return
        if ep.good_since is None:
            self.done.append((False, self.ticks - ep.start_ticks, self.steps - ep.start_steps))
        else:
            self.done.append((True, ep.good_since[0] - ep.start_ticks,
                              ep.good_since[1] - ep.start_steps))
        self.episode = None

    def result(self, label: str, interval_s: float) -> BucketConvergence | None:
        """The bucket's figures once the run is over (None if it never had traffic)."""
        self.close()
        if not self.done:
            return None
        done = [(t_, s_) for ok, t_, s_ in self.done if ok]
        stuck = [t_ for ok, t_, _ in self.done if not ok]
        return BucketConvergence(
            bucket=label,
            traffic_s=max((t_ for t_, _ in done), default=0) * interval_s,
            steps=max((s_ for _, s_ in done), default=0),
            unconverged_s=max(stuck, default=0) * interval_s,
            episodes=len(self.done),
        )

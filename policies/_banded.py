"""Acceptance bands: an arm per (batch-size bucket, acceptance band), for protocol v2 servers.

The server tells each decode step which band the running batch's acceptance is in (its live
per-position estimate, cut at fixed edges) and counts accepted drafts per band and arm. Step
time does not depend on the band, acceptance hardly on the batch size, so the two factor:

    goodput(bucket, band, k) = b · (1 + E[accepted | band, k]) / T(b, k)

``T`` is the model policy's step-time posterior (every bucket's measurements); a band's
acceptance is its own accepted drafts per request-step per arm where it has enough of them,
else a chain through the arms it has run, shrunk towards the band's middle, of the shape
(δ) the policy's pooled acceptance fits: acceptance that rises with depth, or falls off past
a horizon, is followed instead of forced onto the default chain. One band's evidence serves
every bucket, as the policy's acceptance already does.

A band's arm departs from its row's only on the row's greedy arm (an exploring row explores
in every band), by more than the switch margin, and only where the chain through the band's
arms (fitted on all of them and the band's middle) agrees. A cell stands on its own mean once
it holds :data:`_MIN_REQUEST_STEPS` request-steps, and under diverse traffic those are a
handful of requests: a cell that read low or high by their luck would alone move the band off
its row, and keep it off, since a band that departs no longer runs the row's arm. Where the
row's arm is wrong for the band, its cells and its chain say so together, and it still
departs (a row decides on the pooled acceptance, which carries the selection of the bands
that ran each arm, so bands also mend rows). That holds where the row is off too: a
band of high acceptance may draft in a row that does not. The protocol then wants the
row's unknown band to draft (``ModelPolicy._banded`` gives it the shallowest arm a band
drafts), so a stale estimate measures again instead of locking speculation off.

Those probes are not free: after every :data:`_STALE_STEPS` steps in a band that says "off",
the plugin runs the unknown band's arm (twice under the overlap scheduler, which looks the
next arm up before the probe's result is in). So a row that is off lets its bands draft only
where, weighed by how often the bucket's batches sit in each band (its occupancy, any arm),
the drafting bands gain more than the probes cost. A band of high acceptance that batches of
that size never reach buys nothing and would cost the probes.

Occupancy forgets with the bucket's busy time, whatever arm runs: a row that is off measures
no band, so what it knows of where its batches sit is what the requests of its last drafting
said. At one request those may be one or two requests of low acceptance, long gone; held for
good, they would keep the row off for good. Once they have faded the bands' spread returns to
its prior (every bucket's counts, and before them every band alike), the bands of high
acceptance draft again, and the probes measure where the batches of now sit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from policies._acceptance import chain_accepted, fit_chain

__all__ = ["BandBook", "BandObservation", "BandTable", "band_observations"]

# Rows of (upper bound, (k of the unknown band, k of band 1, ...)); the last bound None.
BandTable = tuple[tuple[int | None, tuple[int, ...]], ...]
# Request-steps of drafting at one arm of a band before its mean stands for itself (about
# ten independent acceptance samples at the model's request-steps per sample) ...
_MIN_REQUEST_STEPS = 300.0
# ... and the weight, in request-steps, of the band's middle as its α before it has any.
_PRIOR_REQUEST_STEPS = 100.0
# The plugin's steps without drafting before its band goes unknown
# (``tuner.plugin.acceptance.STALE_STEPS``, docs/protocol.md), and the probe steps that follow:
# two, since the overlap scheduler launches the next step before the probe's result is in.
_STALE_STEPS = 32
_PROBE_STEPS = 2
# Decode steps of a bucket's own band occupancy that weigh as much as the pooled occupancy of
# every bucket, its prior (a bucket never seen takes the others' spread of bands); the pool's
# own prior, every band alike, weighs as much.
_PRIOR_OCCUPANCY_STEPS = 64.0
# The δ a band's measured shape may take: the chain fit's grid (policies._acceptance.DELTAS)
# and a little beyond.
_DELTA_LOW, _DELTA_HIGH = 0.7, 1.3


@dataclass(frozen=True, slots=True)
class BandObservation:
    """Drafting in one known acceptance band (1..) at arm ``k`` over one interval; of its
    request-steps, ``first_rejected`` of the ``first_counted`` looked at accepted no draft."""

    band: int
    k: int
    decode_steps: int
    request_steps: int
    accepted_drafts: int
    first_counted: int = 0
    first_rejected: int = 0

    def problem(self) -> str | None:
        """Why this observation must not reach a policy, or None if it is usable."""
        if min(self.band, self.k, self.decode_steps, self.request_steps,
               self.accepted_drafts, self.first_counted, self.first_rejected) < 0:
            return "negative counter"
        if self.accepted_drafts > self.k * self.request_steps:
            return "more accepted drafts than drafted"
        if self.first_rejected > self.first_counted or self.first_counted > self.request_steps:
            return "more first-draft rejections than requests"
        return None


def band_observations(rows: Iterable[Any]) -> list[BandObservation]:
    """Band counter rows (anything with ``band``, ``k``, ``decode_steps``, ``requests`` and
    ``accepted_drafts``, and optionally ``first_counted`` and ``first_rejected``, e.g.
    ``tuner.protocol.BandCounter`` deltas) as observations: the known bands' steps (the
    unknown band says nothing of a band). Steps at ``k = 0`` count only for the band's
    occupancy; they say nothing of its acceptance."""
    return [BandObservation(r.band, r.k, r.decode_steps, r.requests, r.accepted_drafts,
                            getattr(r, "first_counted", 0), getattr(r, "first_rejected", 0))
            for r in rows if r.band > 0 and r.decode_steps > 0]


class BandBook:
    """What a policy knows of acceptance per band: discounted counts and the arm each band
    of a bucket should run given the bucket's step times."""

    def __init__(self, edges: Sequence[float], arms: Sequence[int], delta: float) -> None:
        if any(not 0 < e < 1 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"band edges must increase within (0, 1), got {list(edges)}")
        cuts = [0.3, *edges, 1.0]
        self.mid = tuple((lo + hi) / 2 for lo, hi in zip(cuts, cuts[1:], strict=False))
        self.arms, self.delta = tuple(arms), delta
        # per known band (index band - 1), per arm k > 0: discounted accepted, request-steps
        self._acc = [{k: [0.0, 0.0] for k in self.arms if k > 0} for _ in self.mid]
        # per (band, arm k > 1) where first drafts are counted: accepted, request-steps, and
        # those that accepted no draft (the shape: see shape())
        self._first = {(i, k): [0.0, 0.0, 0.0] for i in range(len(self.mid))
                       for k in self.arms if k > 1}
        self._shape = delta
        self._delta_measured = True
        # per bucket: discounted decode steps in each known band, at any arm
        self._occ: dict[int, list[float]] = {}
        # per band, fitted on demand: emitted per arm, request-steps, emitted per arm by chain
        self._emitted: list[tuple[dict[int, float], float, dict[int, float]]] | None = None

    @property
    def bands(self) -> int:
        return len(self.mid)

    def set_delta(self, delta: float, measured: bool = True) -> None:
        """The policy's pooled fit of the chain's δ: the bands' shape until they measure
        their own (:meth:`shape`), and its prior after; ``measured`` if arms at two depths
        fitted it (else it is the policy's prior, and bounds nothing)."""
        if delta != self.delta or measured != self._delta_measured:
            self.delta, self._delta_measured, self._emitted = delta, measured, None

    def update(self, obs: BandObservation, discount: float, shape_discount: float = 1.0) -> bool:
        """Count one observation, after ageing the acceptance by ``discount`` and the shape's
        evidence by ``shape_discount``."""
        if (obs.problem() is not None or not 1 <= obs.band <= self.bands
                or obs.k not in self.arms or obs.k == 0 or obs.request_steps == 0):
            return False
        for per_arm in self._acc:
            for cell in per_arm.values():
                cell[0] *= discount
                cell[1] *= discount
        cell = self._acc[obs.band - 1][obs.k]
        cell[0] += obs.accepted_drafts
        cell[1] += obs.request_steps
        if obs.first_counted and obs.k > 1:
            for first in self._first.values():
                first[:] = [x * shape_discount for x in first]
            first = self._first[(obs.band - 1, obs.k)]
            first[0] += obs.accepted_drafts * obs.first_counted / obs.request_steps
            first[1] += obs.first_counted
            first[2] += obs.first_rejected
        self._emitted = None
        return True

    def occupy(self, bucket: int, obs: BandObservation, discount: float) -> bool:
        """Count where ``bucket``'s batches sat: ``obs``'s steps in its band, after ageing
        the bucket's occupancy by ``discount``."""
        if obs.problem() is not None or not 1 <= obs.band <= self.bands or obs.decode_steps == 0:
            return False
        self.age_occupancy(bucket, discount)
        self._occ.setdefault(bucket, [0.0] * self.bands)[obs.band - 1] += obs.decode_steps
        return True

    def age_occupancy(self, bucket: int, discount: float) -> None:
        """Age ``bucket``'s occupancy by ``discount``: per step in :meth:`occupy`, and per
        busy second at any arm (see the module docstring: a row that is off measures no band)."""
        cell = self._occ.get(bucket)
        if cell is not None:
            cell[:] = [n * discount for n in cell]

    def occupancy(self, bucket: int) -> list[float]:
        """The share of ``bucket``'s steps in each known band: its own counts, shrunk towards
        every bucket's pooled counts, and those towards every band alike."""
        pool = [sum(c[i] for c in self._occ.values()) for i in range(self.bands)]
        total = sum(pool) + _PRIOR_OCCUPANCY_STEPS
        prior = [(p + _PRIOR_OCCUPANCY_STEPS / self.bands) / total for p in pool]
        own = self._occ.get(bucket, [0.0] * self.bands)
        n = sum(own) + _PRIOR_OCCUPANCY_STEPS
        return [(o + _PRIOR_OCCUPANCY_STEPS * q) / n for o, q in zip(own, prior, strict=True)]

    def drafting_pays(self, bucket: int, band_arms: Sequence[int],
                      log_t: Sequence[float]) -> bool:
        """Whether, in a bucket whose row is off, drafting as ``band_arms`` (an arm per known
        band, some > 0) beats the row off in every band once the probes are paid for."""
        share, time = self.occupancy(bucket), dict(zip(self.arms, map(math.exp, log_t),
                                                           strict=True))
        probe = min(k for k in band_arms if k > 0)
        tokens = seconds = 0.0
        for band, (s, k) in enumerate(zip(share, band_arms, strict=True), start=1):
            em = self.emitted(band)[0]
            tokens += s * em[k]
            seconds += s * time[k]
            if k == 0:  # a probe per stale stretch of steps in a band that says "off"
                q = s * _PROBE_STEPS / _STALE_STEPS
                tokens += q * em[probe]
                seconds += q * time[probe]
        return tokens / seconds > 1.0 / time[0]

    def shape(self) -> float:
        """The chain δ every band's α is fitted on: the smaller of the pooled fit
        (:meth:`set_delta`) and the shape measured on the requests themselves.

        Of a band's steps at an arm of two drafts or more, the share of requests that
        accepted no draft gives the first draft's acceptance α, and the accepted drafts per
        request-step then the δ of the chain through it; the pooled fit is its prior, of
        :data:`_PRIOR_REQUEST_STEPS` request-steps a draft past the first. Both estimates
        read acceptance that rises with depth where a mixture of requests reaches the deep
        positions on its requests of high acceptance. The pooled fit also reads it from the
        bands a banded row runs its deep arm in (the requests of high acceptance), which the
        measured shape does not, since its α and its accepted drafts come from the same
        steps; so the smaller of the two is the less inflated.

        That holds only once the pooled δ is measured (:meth:`set_delta`). While every bucket
        has run one depth its δ is the policy's prior, and bounding the measured shape by it
        would lock a band in: on acceptance that rises with depth the prior's falling chain
        makes the band's deeper arms look worse than the one it runs, so it never runs them,
        the pooled fit never sees a second depth, and the bound stays.
        """
        self._fits()
        return self._shape

    def _refit(self) -> None:
        num, den = self.delta * _PRIOR_REQUEST_STEPS, _PRIOR_REQUEST_STEPS
        for (_, k), (acc, rs, rejected) in self._first.items():
            if rs <= 0:
                continue
            alpha, mean = 1.0 - rejected / rs, acc / rs
            if not 0.0 < alpha < 1.0:
                continue  # every request or none accepted its first draft: no shape in it
            weight = rs * (k - 1)
            num += weight * _chain_delta(alpha, mean, k)
            den += weight
        own = num / den  # the requests' own shape, shrunk towards the pooled δ
        self._shape = min(own, self.delta) if self._delta_measured else own
        self._emitted = [self._fit(i) for i in range(self.bands)]

    def _fits(self) -> list[tuple[dict[int, float], float, dict[int, float]]]:
        """Every band's fit (:meth:`_fit`), refitted if evidence came in since the last."""
        if self._emitted is None:
            self._refit()
        assert self._emitted is not None
        return self._emitted

    def emitted(self, band: int) -> tuple[dict[int, float], float]:
        """Mean emitted tokens per request-step per arm in ``band``, and the band's
        request-steps of evidence."""
        em, total, _ = self._fits()[band - 1]
        return em, total

    def _fit(self, i: int) -> tuple[dict[int, float], float, dict[int, float]]:
        per_arm = self._acc[i]
        seen = {k: (acc / rs, rs) for k, (acc, rs) in per_arm.items() if rs > 0}
        total = sum(rs for _, rs in seen.values())
        # The chain's α through the band's measured arms, weighed by evidence, with a prior of
        # _PRIOR_REQUEST_STEPS request-steps spread over the arms at the chain through the
        # band's middle (a band is a range of acceptance: it says something before any data).
        # Its δ is every band's (shape()): one band's arms alone, run at different times on
        # different requests, would fit mostly noise.
        drafting = [k for k in self.arms if k > 0]
        prior = [(k, chain_accepted(self.mid[i], self._shape, k),
                  _PRIOR_REQUEST_STEPS / len(drafting)) for k in drafting]
        alpha, delta = fit_chain(drafting, [*prior, *((k, m, rs) for k, (m, rs) in seen.items())],
                                 self._shape, delta_sd=0)
        chain = {0: 1.0, **{k: 1.0 + chain_accepted(alpha, delta, k) for k in per_arm}}
        out = dict(chain)
        for k, (m, rs) in seen.items():
            if rs >= _MIN_REQUEST_STEPS:
                out[k] = 1.0 + m
        return out, total, chain

    def arms_for(self, row_arm: int, log_t: Sequence[float], margin: float) -> tuple[int, ...]:
        """Each known band's arm in a bucket whose row runs ``row_arm`` (its greedy arm) and
        whose mean log step time per arm is ``log_t``."""
        t = dict(zip(self.arms, log_t, strict=True))
        out = []
        for em, _, chain in self._fits():
            value = {k: math.log(em[k]) - t[k] for k in self.arms}
            best = max(self.arms, key=lambda k: (value[k], -k))
            departs = (value[best] > value[row_arm] + margin
                       and math.log(chain[best]) - t[best] > math.log(chain[row_arm]) - t[row_arm])
            out.append(best if departs else row_arm)
        return tuple(out)


def _chain_delta(alpha: float, mean: float, k: int) -> float:
    """The δ in [_DELTA_LOW, _DELTA_HIGH] whose chain from ``alpha`` accepts ``mean`` drafts
    of ``k`` on average (bisection: the chain's mean rises with δ)."""
    lo, hi = _DELTA_LOW, _DELTA_HIGH
    for _ in range(24):
        mid = (lo + hi) / 2
        if chain_accepted(alpha, mid, k) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def band_table(bounds: Sequence[int | None], rows: Sequence[tuple[int, ...]]) -> BandTable:
    """Per-bucket ``(k of the unknown band, k per band)`` -> merged rows, last unbounded."""
    out: list[tuple[int | None, tuple[int, ...]]] = []
    for bound, ks in zip(bounds, rows, strict=True):
        if out and out[-1][1] == ks:
            out[-1] = (bound, ks)
        else:
            out.append((bound, ks))
    out[-1] = (None, out[-1][1])
    return tuple(out)

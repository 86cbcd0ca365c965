"""The model policy's pooled acceptance: one estimate for the whole server.

Acceptance is a property of the requests, not of the batch size, so every bucket's drafting
feeds one count per arm ``k > 0``: the discounted accepted drafts and request-steps, and, where
the plugin counts how many drafts each request accepted, those of every shallower arm. A copy
with a short memory watches for a workload shift (detect and restart), and a chain model
(``P(A ≥ i) = α^i δ^(i(i−1)/2)``) fitted to the per-arm means gives the arms never run. Its
shape δ is read off the counted requests' positions where there are enough of them.
How the means become per-arm predictions is the policy's (``ModelPolicy._acceptance``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from policies._acceptance import ALPHAS, DELTAS, chain_accepted, fit_chain
from policies._stats import discount, forgetting

__all__ = ["PooledAcceptance"]

# Shift detector: the short memory (decode steps) and the evidence it needs.
_FAST_GAMMA = 1.0 - 1.0 / 400.0
_FAST_MIN_REQUEST_STEPS = 2_000.0
# Request-steps (discounted) at the second most measured drafting arm before the fitted δ
# counts as measured (at two depths) rather than as its prior (BandBook.set_delta): about 33
# independent acceptance samples at the policy's default acceptance_corr (30).
_DELTA_MEASURED_REQUEST_STEPS = 1000.0
# Counted request-steps (as weighed by add_depths) that reached a second draft before the
# shape they show replaces the chain's prior: about ten independent samples.
_SHAPE_MIN_REACHED = 300.0
# The least variance a position's acceptance rate is judged by (a rate of 0.9 has 0.09):
# where the chain puts a position at certainty, a few counted misses must not read as misfit.
_RATE_VAR_FLOOR = 0.01
_DELTA_GRID = np.asarray(DELTAS)


@lru_cache(maxsize=8)
def _position_grid(positions: int) -> tuple[np.ndarray, np.ndarray]:
    """``log p`` and ``log(1 - p)`` of a chain's draft positions ``i = 1..positions`` on the
    (α, δ) grid, [α, δ, i]: position i is accepted, given those before it were, with
    ``p = α·δ^(i−1)`` (capped just short of 1, as the chain caps it at 1)."""
    i = np.arange(positions)
    p = np.clip(ALPHAS[:, None, None] * _DELTA_GRID[None, :, None] ** i[None, None, :],
                1e-9, 1 - 1e-9)
    return np.log(p), np.log1p(-p)


class PooledAcceptance:
    """Discounted accepted drafts and request-steps per drafting arm, with shift detection
    and the chain fit through them.

    Args:
        arms: the policy's arms (``k = 0`` holds no acceptance).
        memory_request_steps, memory_steps, memory_s: the three memories that discount the
            counts (per request-step, per decode step, per busy second: the shortest counts).
        corr: request-steps per independent acceptance sample.
        chain_delta: the chain's δ before arms at two depths say otherwise.
        delta_prior_sd: its prior spread.
        shift_z: z-score at which the short memory overrules the long one.
    """

    def __init__(self, arms: Sequence[int], *, memory_request_steps: float,
                 memory_steps: float, memory_s: float, corr: float, chain_delta: float,
                 delta_prior_sd: float, shift_z: float) -> None:
        self.arms = tuple(arms)
        self.gamma_rs = discount(memory_request_steps)
        self._gamma_steps = discount(memory_steps)
        self._memory_s, self._corr, self._shift_z = memory_s, corr, shift_z
        self._chain_delta, self._delta_prior_sd = chain_delta, delta_prior_sd
        # per arm k > 0: discounted accepted drafts and request-steps
        self._acc = {k: [0.0, 0.0] for k in self.arms if k > 0}
        # The same with a short memory: when it disagrees clearly with the long one, the
        # workload changed, and the long memory restarts from it (detect and restart).
        self._fast = {k: [0.0, 0.0] for k in self.arms if k > 0}
        # The same read off deeper drafts: a chain's first k drafts are the same whatever its
        # depth, so a step at arm k' > k tells what k would have accepted on its requests
        # (how many drafts each accepted, counted by the plugin: add_depths).
        self._prefix = {k: [0.0, 0.0] for k in self.arms if k > 0}
        # Per draft position i = 1..: the counted requests that reached it (accepted the
        # i - 1 before it) and those that accepted it too. Every position of a counted
        # request is on the same request, so the ratio's fall with i is the requests' own
        # shape, whichever bands the deep arms ran in.
        deepest = max(self.arms)
        self._reached = np.zeros(deepest)
        self._passed = np.zeros(deepest)

    def add(self, k: int, steps: int, request_steps: int, accepted: int,
            busy_s: float) -> str | None:
        """Count ``steps`` decode steps at arm ``k > 0``, after ageing every arm's counts;
        returns what changed if the short memory overruled the long one (a workload shift).

        Acceptance ages only while it is measured: with nothing drafting nothing new can be
        learned, and forgetting would only buy exploration of arms the last evidence rules
        out."""
        f = forgetting(self.gamma_rs**request_steps * self._gamma_steps**steps, busy_s,
                       self._memory_s)
        fast = _FAST_GAMMA**steps
        for acc, quick, prefix in zip(self._acc.values(), self._fast.values(),
                                      self._prefix.values(), strict=True):
            acc[0] *= f
            acc[1] *= f
            prefix[0] *= f
            prefix[1] *= f
            quick[0] *= fast
            quick[1] *= fast
        self._reached *= f
        self._passed *= f
        for table in (self._acc, self._fast):
            table[k][0] += accepted
            table[k][1] += request_steps
        return self._detect_shift(k)

    def add_depths(self, k: int, counts: Sequence[int], weight: float = 1.0) -> None:
        """Count requests of a chain at arm ``k`` that accepted ``a`` drafts (``counts[a]``,
        ``a = 0..k``), each request-step as ``weight`` of them: for every shallower arm
        ``j < k``, ``min(a, j)`` accepted drafts; for every position ``i <= k``, the requests
        that reached it and those that accepted it (:meth:`shape`). They age with the arms'
        own counts (at :meth:`add`)."""
        # tail[a]: requests that accepted at least a drafts, i.e. reached position a + 1; a
        # request's min(a, j) is its count of positions 1..j passed, so arm j accepts the
        # sum of tail[1..j].
        tail = np.cumsum(np.asarray(counts, dtype=float)[::-1])[::-1]
        passed = np.cumsum(tail[1:])
        for j, prefix in self._prefix.items():
            if j < k:
                prefix[0] += weight * float(passed[j - 1])
                prefix[1] += weight * float(tail[0])
        self._reached[:k] += weight * tail[:k]
        self._passed[:k] += weight * tail[1:k + 1]

    def _detect_shift(self, k: int) -> str | None:
        (a_slow, rs_slow), (a_fast, rs_fast) = self._acc[k], self._fast[k]
        if rs_fast < _FAST_MIN_REQUEST_STEPS or rs_slow <= rs_fast:
            return None
        m_slow, m_fast = a_slow / rs_slow, a_fast / rs_fast
        sd = (k / 2) * math.sqrt(self._corr / rs_fast + self._corr / rs_slow)
        if abs(m_fast - m_slow) <= self._shift_z * sd:
            return None
        # What deeper drafts told of shallower arms and of the shape is long memory of the
        # old requests too; the short memory keeps none of it, so it restarts empty.
        for arm in self._acc:
            self._acc[arm][:] = self._fast[arm]
            self._prefix[arm][:] = [0.0, 0.0]
        self._reached[:] = 0.0
        self._passed[:] = 0.0
        return (f"acceptance changed: k={k} accepts {m_fast:.2f} drafts per request-step, "
                f"was {m_slow:.2f}; the acceptance estimate restarts")

    def direct(self) -> dict[int, tuple[float, float]]:
        """Per measured arm: mean accepted drafts per request-step, and its standard error."""
        out: dict[int, tuple[float, float]] = {}
        for k, (acc, rs) in self._acc.items():
            acc += self._prefix[k][0]
            rs += self._prefix[k][1]
            if rs > 0:
                m = min(max(acc / rs, 0.0), float(k))
                out[k] = (m, (k / 2) * math.sqrt(self._corr / rs))
        return out

    def delta_measured(self) -> bool:
        """Whether the chain's δ is fitted on arms at two depths (the second most measured
        drafting arm has enough request-steps), not its prior alone."""
        second = sorted((rs + self._prefix[k][1] for k, (_, rs) in self._acc.items()),
                        reverse=True)[1:2]
        return bool(second) and second[0] >= _DELTA_MEASURED_REQUEST_STEPS

    def shape(self) -> tuple[float, float] | None:
        """The chain's δ fitted on the counted positions alone (maximum likelihood on the
        grid, each request-step worth ``1/corr`` of a sample), and its standard error, wider
        by as much as the positions stray from that chain beyond their noise; None until the
        second position has been reached ``_SHAPE_MIN_REACHED`` times."""
        reached, passed = self._reached, self._passed
        if reached.size < 2 or reached[1] < _SHAPE_MIN_REACHED:
            return None
        log_p, log_q = _position_grid(reached.size)
        ll = log_p @ passed + log_q @ (reached - passed)
        a, j = np.unravel_index(int(np.argmax(ll)), ll.shape)
        profile = ll.max(axis=0) / self._corr
        # The δs within which the profile falls by at most 1/2: one standard error each way.
        inside = _DELTA_GRID[profile >= profile[j] - 0.5]
        step = float(_DELTA_GRID[1] - _DELTA_GRID[0])
        sd = max((float(inside.max()) - float(inside.min())) / 2, step / 2)
        # Misfit: a cliff (a draft that loses the thread past a horizon) is no chain, and
        # its δ, however precisely fitted, must not hold the arms' own means in.
        seen = reached > 0
        if seen.sum() > 2:
            p = np.exp(log_p[a, j])[seen]
            n = reached[seen] / self._corr
            rate = passed[seen] / reached[seen]
            chi2 = float((n * (rate - p) ** 2 / np.maximum(p * (1 - p), _RATE_VAR_FLOOR)).sum())
            sd *= math.sqrt(max(1.0, chi2 / (seen.sum() - 2)))
        return float(_DELTA_GRID[j]), sd

    def fit(self, direct: dict[int, tuple[float, float]]) -> tuple[float, float, float]:
        """``(α, its standard error, δ)`` of the chain model, fitted by least squares to the
        measured means. δ's prior is the shape the counted positions show (:meth:`shape`)
        once there are enough of them, else the default's: the per-arm means compare arms
        that may have run on different batches (a banded row runs its deep arm where
        acceptance is high), the positions of one counted request do not."""
        if not direct:  # nothing seen yet: a wide prior around typical EAGLE-3 chat
            return 0.7, 0.3, self._chain_delta
        drafting = [k for k in self.arms if k > 0]
        prior, prior_sd = self._chain_delta, self._delta_prior_sd
        measured = self.shape()
        if measured is not None:  # the requests' own shape replaces the prior's
            prior, prior_sd = measured
        coarse, delta = fit_chain(drafting, [(k, m, 1 / (sd * sd + 1e-12))
                                        for k, (m, sd) in direct.items()],
                             prior, prior_sd)

        def loss(a: float) -> float:
            return sum(((m - chain_accepted(a, delta, k)) / sd) ** 2
                       for k, (m, sd) in direct.items())

        # Golden section within the grid's step around its α (a 1e-4 bracket in 12 steps).
        step = float(ALPHAS[1] - ALPHAS[0])
        lo, hi = max(coarse - step, 0.0), min(coarse + step, 1.0)
        g = (math.sqrt(5) - 1) / 2
        x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
        f1, f2 = loss(x1), loss(x2)
        for _ in range(12):
            if f1 < f2:
                hi, x2, f2 = x2, x1, f1
                x1 = hi - g * (hi - lo)
                f1 = loss(x1)
            else:
                lo, x1, f1 = x1, x2, f2
                x2 = lo + g * (hi - lo)
                f2 = loss(x2)
        alpha = (lo + hi) / 2
        # Curvature of the loss gives α's standard error.
        h = 1e-3
        a0, a1, a2 = max(alpha - h, 0.0), alpha, min(alpha + h, 1.0)
        curv = (loss(a2) - 2 * loss(a1) + loss(a0)) / (h * h)
        sd = math.sqrt(2 / curv) if curv > 0 else 0.3
        return alpha, min(sd, 0.3), delta

"""The engine's running requests as numpy columns: tokens still to emit and acceptance rows."""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from tuner.sim._requests import Request
from tuner.sim.acceptance import ShapedRows
from tuner.sim.tree import TreeArm

__all__ = ["RunningRows"]


class RunningRows:
    """Per running request, aligned with the engine's running list: the tokens it still has to
    emit and its survival row ``P(A >= i)`` (and the row it would have drafting from stale
    state), from which one step's accepted drafts are drawn.

    Args:
        capacity: the running cap.
        kmax: the widest drafting step.
        cold_factor: α multiplier for requests drafting from stale state.
        tree: the server's tree arm, whose acceptance is lifted from the chain rows.
        rng: the acceptance draws' stream.
    """

    def __init__(
        self,
        capacity: int,
        kmax: int,
        cold_factor: float,
        tree: TreeArm | None,
        rng: np.random.Generator,
    ) -> None:
        self._kmax = kmax
        self._cold_factor = cold_factor
        self._tree = tree
        self._rng = rng
        self.rem = np.zeros(capacity, dtype=np.int64)  # tokens still to emit
        self._surv = np.zeros((capacity, kmax), dtype=np.float64)  # P(A >= i) per request
        self._cold = np.zeros((capacity, kmax), dtype=np.float64)  # same, stale draft state
        self._stale = np.zeros(capacity, dtype=bool)
        self._shaped = ShapedRows(capacity, kmax, cold_factor)
        # Bumped whenever a running request's row changes: the step oracle's cache key.
        self.version = 0

    def admit(self, n0: int, admit: list[Request]) -> bool:
        """``admit`` (just prefilled, first token out) take rows ``n0..``; True when one of
        them is already done."""
        m = len(admit)
        alphas = np.array([r.alpha for r in admit])
        deltas = np.array([r.delta for r in admit])
        i = np.arange(1, self._kmax + 1, dtype=np.float64)
        dpow = deltas[:, None] ** (i * (i - 1) / 2)[None, :]
        self._surv[n0 : n0 + m] = alphas[:, None] ** i[None, :] * dpow
        self._cold[n0 : n0 + m] = (alphas[:, None] * self._cold_factor) ** i[None, :] * dpow
        self._stale[n0 : n0 + m] = False
        self._shaped.admit(n0, admit, self._surv, self._cold)
        self.rem[n0 : n0 + m] = [r.output_tokens - 1 for r in admit]
        self.version += 1
        return bool((self.rem[n0 : n0 + m] <= 0).any())

    def draft_step(self, n: int, k: int) -> np.ndarray:
        """The first ``n`` requests run a step at arm ``k`` > 0; returns each one's accepted
        drafts."""
        self.sync(n)
        acc = self._draw(n, k)
        rem = self.rem[:n]
        rem -= acc
        rem -= 1
        return acc

    def sync(self, n: int) -> None:
        """Bring drifting requests' rows to their progress (a no-op without drift; idempotent,
        so the step oracle may call it before a step that does not draft)."""
        if self._shaped.drifting:
            self._shaped.refresh(n, self.rem, self._surv, self._cold, self._stale)
            self.version += 1

    def expected_drafts(self, n: int, arms: tuple[int, ...]) -> list[float]:
        """Per arm, the drafts the first ``n`` requests accept in expectation in one step
        (``Σ_i Σ_{j≤k} P(A_i ≥ j)``, the tree's lifted rows at its arm): what each arm would
        emit beyond one token per request, given every request's own acceptance now."""
        surv = self._surv[:n]
        # One numpy call, then plain floats: a handful of arms, computed most steps.
        cum = [0.0, *accumulate(surv.sum(axis=0).tolist())]
        out = [cum[k] for k in arms]
        tree = self._tree
        if tree is not None and tree.steps in arms:
            out[arms.index(tree.steps)] = float(tree.lift_survival(surv[:, : tree.steps]).sum())
        return out

    def _draw(self, n: int, k: int) -> np.ndarray:
        """Accepted drafts of each of the first ``n`` requests in one step at arm ``k``.

        One uniform per request against its survival row ``P(A >= i)``: the count of
        positions it clears is a draw of its accepted length.
        """
        u = self._rng.random(n)
        surv = self._surv[:n, :k]
        if self._tree is not None and k == self._tree.steps:
            surv = self._tree.lift_survival(surv)
        return (u[:, None] < surv).sum(axis=1)

    def plain_step(self, n: int, skip_draft_extend: bool) -> None:
        """The first ``n`` requests run a step at arm 0; with the draft extend skipped they
        draft from stale state from now on."""
        self.rem[:n] -= 1
        if skip_draft_extend:
            stale = self._stale[:n]
            if not stale.all():
                fresh = ~stale
                self._surv[:n][fresh] = self._cold[:n][fresh]
                stale[:] = True
                self.version += 1

    def done(self, n: int) -> np.ndarray:
        """Indices among the first ``n`` of the requests with nothing left to emit."""
        return np.flatnonzero(self.rem[:n] <= 0)

    def compact(self, keep: np.ndarray, n: int) -> None:
        """Drop the finished requests (``keep`` False) from the first ``n`` rows."""
        m = int(keep.sum())
        for col in (self.rem, self._surv, self._cold, self._stale):
            col[:m] = col[:n][keep]
        self._shaped.compact(keep, n)
        self.version += 1

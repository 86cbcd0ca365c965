"""Per-request acceptance beyond the plain chain: position shapes and drift within a request.

The workload presets use the chain of ``anchors.md`` §3.3: a request whose first draft
position is accepted with probability ``a`` accepts position ``i`` with probability
``a·δ^(i−1)`` given the earlier ones. Measured drafts are not always that regular, so a
:class:`AcceptanceShape` gives the conditional acceptance of position ``i`` other forms:

- ``chain``: ``a·δ^(i−1)`` (the presets' model, here with drift available);
- ``horizon``: the chain up to ``horizon`` positions, then each further position also times
  ``cliff`` — a draft trained to a few steps that degrades past them;
- ``rising``: ``1 − (1 − a)·rise^(i−1)`` — rejection shrinks with depth, as when requests mix
  easy and hard stretches (conditional acceptance rising with position, vLLM PR 24243).

``drift`` moves a request's acceptance over its own output: ``a`` becomes
``a·(1 + drift·(f − ½))`` (clipped to [0, 1]) when a share ``f`` of its tokens is out.

The engine draws from :func:`AcceptanceShape.survival` rows; the oracle takes expectations
over the per-request Beta and over ``f`` by Gauss–Legendre quadrature
(:func:`shape_emitted_mean`), exact to far below the bench's resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["SHAPES", "AcceptanceShape", "ShapedRows", "beta_nodes", "shape_emitted_mean"]

SHAPES = ("chain", "horizon", "rising")
# Quadrature nodes per half of the Beta's support and over a request's progress.
_BETA_NODES = 160
_PROGRESS_NODES = 24


@dataclass(frozen=True)
class AcceptanceShape:
    """Conditional acceptance per draft position, and its drift within a request.

    Attributes:
        kind: one of :data:`SHAPES`.
        delta: chain decay per position (``chain`` and ``horizon``), in (0, 1].
        horizon: ``horizon`` shape: positions up to this one follow the chain.
        cliff: ``horizon`` shape: factor per position beyond the horizon, in (0, 1].
        rise: ``rising`` shape: rejection factor per further position, in (0, 1].
        drift: slope of a request's acceptance over its output, in [-1, 1].
    """

    kind: str = "chain"
    delta: float = 1.0
    horizon: int = 1
    cliff: float = 1.0
    rise: float = 1.0
    drift: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SHAPES:
            raise ValueError(f"acceptance shape must be one of {SHAPES}, got {self.kind!r}")
        for name in ("delta", "cliff", "rise"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0.0 < v <= 1.0):
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon}")
        if not (math.isfinite(self.drift) and -1.0 <= self.drift <= 1.0):
            raise ValueError(f"drift must be in [-1, 1], got {self.drift!r}")

    def label(self) -> str:
        """A few words for a world's one-line description."""
        if self.kind == "chain":
            s = f"chain δ={self.delta:.3f}"
        elif self.kind == "horizon":
            s = f"horizon {self.horizon} δ={self.delta:.3f} ×{self.cliff:.2f} beyond"
        else:
            s = f"rising (reject ×{self.rise:.2f}/pos)"
        return s + (f", drift {self.drift:+.2f}" if self.drift else "")

    def conditional(self, a: np.ndarray, k: int) -> np.ndarray:
        """Conditional acceptance of positions ``1..k`` for first-position acceptances ``a``
        (any shape; a trailing axis of length ``k`` is added)."""
        a = _unit(np.asarray(a, dtype=np.float64))[..., None]
        scale, cliff = _position_factors(self, k)
        if self.kind == "rising":
            return 1.0 - (1.0 - a) * scale
        c = a * scale
        if cliff is not None:
            c = c * cliff
        return c

    def survival(self, a: np.ndarray | float, k: int) -> np.ndarray:
        """``P(A ≥ i)`` for ``i = 1..k``, per first-position acceptance in ``a``."""
        return np.cumprod(self.conditional(np.asarray(a, dtype=np.float64), k), axis=-1)

    def drifted(self, a: np.ndarray, progress: np.ndarray) -> np.ndarray:
        """First-position acceptance of requests with base ``a`` at output share ``progress``."""
        return _unit(a * (1.0 + self.drift * (progress - 0.5)))


def _unit(x: np.ndarray) -> np.ndarray:
    """``np.clip(x, 0, 1)`` without its dispatch overhead (the engine calls this every step)."""
    return np.minimum(np.maximum(x, 0.0), 1.0)


@lru_cache(maxsize=256)
def _position_factors(shape: AcceptanceShape, k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-position factors of :meth:`AcceptanceShape.conditional` for positions ``1..k``:
    ``rise^(i−1)`` (rising) or ``δ^(i−1)``, and the horizon's cliff factors (else None)."""
    i = np.arange(k, dtype=np.float64)  # i − 1 for positions 1..k
    if shape.kind == "rising":
        return shape.rise**i, None
    if shape.kind == "horizon":
        return shape.delta**i, shape.cliff ** np.maximum(i + 1 - shape.horizon, 0.0)
    return shape.delta**i, None


@lru_cache(maxsize=64)
def _legendre(n: int) -> tuple[np.ndarray, np.ndarray]:
    x, w = np.polynomial.legendre.leggauss(n)
    return x, w


def beta_nodes(mean: float, kappa: float, n: int = _BETA_NODES) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and normalised weights integrating against ``Beta(κ·mean, κ·(1−mean))``.

    Gauss–Legendre on each half of [0, 1]; where the density is singular at an end (shape
    parameter ``a < 1``), that half is first mapped by ``x = s^(1/a)``, which absorbs
    ``x^(a−1)`` and leaves a smooth integrand. Moments come out exact to ~1e-9.
    """
    if not (0.0 < mean < 1.0 and kappa > 0):
        raise ValueError(f"need 0 < mean < 1 and kappa > 0, got {mean}, {kappa}")
    a, b = kappa * mean, kappa * (1.0 - mean)
    gx, gw = _legendre(n)

    def half(a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
        # Distance from the end, y in [0, 1/2], weight y^(a-1)·(1-y)^(b-1)·dy.
        p = min(a, 1.0)
        hi = 0.5**p
        s = (gx + 1.0) * hi / 2.0
        y = s ** (1.0 / p)
        w = gw * hi / 2.0 / p * s ** ((a - p) / p) * (1.0 - y) ** (b - 1.0)
        return y, w

    yl, wl = half(a, b)
    yr, wr = half(b, a)
    x = np.concatenate([yl, 1.0 - yr])
    w = np.concatenate([wl, wr])
    return x, w / w.sum()


@lru_cache(maxsize=8192)
def shape_emitted_mean(
    shape: AcceptanceShape, mean: float, kappa: float | None, k: int, *, inverse: bool = False
) -> float:
    """``E[emitted]`` per step (bonus included), or ``E[1 / emitted]`` with ``inverse``, for
    requests of mean first-position acceptance ``mean`` drawn from ``Beta`` with
    concentration ``kappa`` (all exactly ``mean`` when None), averaged over each request's
    output progress when the shape drifts (progress counts tokens, so a request spends
    ``1 / emitted`` steps per token at each point of its output).
    """
    if kappa is None:
        x, w = np.array([mean]), np.array([1.0])
    else:
        x, w = beta_nodes(mean, kappa)
    if shape.drift:
        gx, gw = _legendre(_PROGRESS_NODES)
        a = shape.drifted(x[:, None], (gx[None, :] + 1.0) / 2.0)  # (alpha, progress) nodes
        weights = w[:, None] * gw[None, :] / 2.0
    else:
        a, weights = x, w
    em = 1.0 + shape.survival(a, k).sum(axis=-1)
    return float((weights / em).sum() if inverse else (weights * em).sum())


class ShapedRows:
    """The engine's per-request state for shaped and drifting acceptance.

    The engine keeps survival rows ``P(A ≥ i)`` per running request (and the rows it would
    have drafting from stale state); this fills them for requests whose class has a shape,
    and refreshes drifting ones from their progress — vectorised per distinct shape, since
    it runs before every drafting step. Columns are aligned with the engine's running list.
    """

    def __init__(self, capacity: int, kmax: int, cold_factor: float) -> None:
        self.kmax = kmax
        self.cold_factor = cold_factor
        self._alpha = np.zeros(capacity)
        self._out = np.ones(capacity)
        self._shape = np.full(capacity, -1, dtype=np.int64)  # index into _shapes; -1: chain
        self._drift = np.zeros(capacity, dtype=bool)
        self._shapes: list[AcceptanceShape] = []
        self._index: dict[AcceptanceShape, int] = {}
        self.drifting = 0  # running requests whose rows move with progress

    def admit(self, start: int, requests: list, surv: np.ndarray, cold: np.ndarray) -> None:
        """Requests ``requests`` now occupy rows ``start..``; fill the rows of shaped ones."""
        for j, r in enumerate(requests):
            i = start + j
            shape = r.shape
            if shape is None:
                self._shape[i] = -1
                self._drift[i] = False
                continue
            ix = self._index.get(shape)
            if ix is None:
                ix = self._index[shape] = len(self._shapes)
                self._shapes.append(shape)
            self._shape[i] = ix
            self._alpha[i] = r.alpha
            self._out[i] = r.output_tokens
            self._drift[i] = shape.drift != 0.0
            self.drifting += bool(shape.drift)
            surv[i] = shape.survival(r.alpha, self.kmax)
            cold[i] = shape.survival(r.alpha * self.cold_factor, self.kmax)

    def refresh(
        self, n: int, rem: np.ndarray, surv: np.ndarray, cold: np.ndarray, stale: np.ndarray
    ) -> None:
        """Rows of the first ``n`` requests' drifting ones at their share of output emitted
        (``rem`` tokens still to come)."""
        drift = self._drift[:n]
        groups: list[tuple[int, np.ndarray | slice]]
        if len(self._shapes) == 1:  # the usual case: one shape for the whole workload ...
            # ... and, drifting, every running request: a slice, no copies.
            groups = [(0, slice(0, n) if drift.all() else np.flatnonzero(drift))]
        else:
            groups = [(ix, np.flatnonzero(drift & (self._shape[:n] == ix)))
                      for ix in np.unique(self._shape[:n][drift]).tolist()]
        for ix, rows in groups:
            shape = self._shapes[ix]
            a = shape.drifted(self._alpha[rows], 1.0 - rem[rows] / self._out[rows])
            # Cold and warm rows in one pass (the same arithmetic, half the calls).
            both = shape.survival(np.stack([a * self.cold_factor, a]), self.kmax)
            cold[rows] = both[0]
            surv[rows] = np.where(stale[rows, None], both[0], both[1])

    def compact(self, keep: np.ndarray, n: int) -> None:
        """Drop the finished requests (``keep`` False) from the first ``n`` rows."""
        m = int(keep.sum())
        self.drifting -= int(self._drift[:n][~keep].sum())
        for col in (self._alpha, self._out, self._shape, self._drift):
            col[:m] = col[:n][keep]

"""Fit a cost table from what a server reported: busy seconds per decode step at each (b, k).

A server's history gives one number per ``(b, k)``: the step time ``T(b, k)`` (busy seconds
over decode steps). The table format has two per ``(b, q)``: ``target`` and ``draft``, with

    T(b, 0) = target(b, 1) + draft(b, 1)        (SGLang's default: the draft extend still runs)
    T(b, 0) = target(b, 1)                      (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1)
    T(b, k) = k·draft(b, 1) + target(b, k+1) + draft(b, k+1)

Step times alone cannot tell the two apart, so the fit assumes the draft costs a fixed share
``draft_ratio`` of the target at the same ``(b, q)`` (``draft = ρ·target``; about 0.045 on the
measured H200 table, whose draft is one layer and a 32k head against 32 layers and a 128k head).
Given ``target(b, 1)``, every measured arm then has exactly one solution, and loading the table
back reproduces every measured step time exactly:

    target(b, k+1) = (T(b, k) − k·ρ·target(b, 1)) / (1 + ρ)

``target(b, 1)`` comes from ``k = 0`` at the same ``b`` when measured, else from neighbouring
batch sizes (linear in b), else from a line through the measured arms at that ``b``.

Batch sizes are the ones forwards run at: observed batch sizes are first padded to the server's
CUDA-graph sizes (a batch of 17 runs, and costs, as 18), pooling their steps.

The table is rectangular over the padded batch sizes seen and ``q ∈ {1} ∪ {k+1}``; every cell
says where it came from in ``source``: ``measured`` (a measured step time at that ``(b, k)``;
for ``q = 1``, at ``k = 0``), ``interpolated`` (linear between measured cells in b, else in q),
or ``extrapolated`` (scaled from the nearest batch size by the ratio of their ``q = 1`` cells,
or ``target(b, 1)`` from the arms at ``b``).

Pure apart from :func:`fit_from_storage`, which reads a :class:`storage.Storage`.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tuner.calibrate._table import CostRow
from tuner.errors import ConfigError, DynspecError

if TYPE_CHECKING:
    from storage import Storage

__all__ = [
    "DEFAULT_DRAFT_RATIO",
    "DEFAULT_MIN_STEPS",
    "SOURCES",
    "FitResult",
    "StepCell",
    "fit_from_storage",
    "fit_observations",
]

log = logging.getLogger(__name__)

# Draft forward / target forward at the same (b, q) on the measured H200 Llama-3-8B table:
# 0.044..0.048 over the whole grid. Same order for other dense EAGLE-3 pairs (a one-layer
# draft against tens of layers).
DEFAULT_DRAFT_RATIO = 0.045
# A (b, k) needs this many decode steps before its step time counts as measured.
DEFAULT_MIN_STEPS = 20
SOURCES = ("measured", "interpolated", "extrapolated")


@dataclass(frozen=True, kw_only=True)
class StepCell:
    """Decode steps and busy seconds at one ``(b, k)``, summed over observations."""

    b: int
    k: int
    decode_steps: int
    busy_s: float

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.busy_s / self.decode_steps


@dataclass(frozen=True, kw_only=True)
class FitResult:
    """The fitted rows (each with ``source``), the info row, and what was left out and why."""

    info: dict[str, Any]
    rows: tuple[CostRow, ...]
    used: tuple[StepCell, ...]
    ignored: tuple[tuple[StepCell, str], ...] = field(default=())

    def count(self, source: str) -> int:
        return sum(1 for r in self.rows if r.source == source)


def _interp(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _bracket(xs: Sequence[int], x: int) -> tuple[int, int] | None:
    """Indices of the nearest elements of sorted ``xs`` strictly below and above ``x``."""
    i = bisect_left(xs, x)
    if 0 < i < len(xs) and xs[i] != x:
        return i - 1, i
    return None


def _pool(
    cells: Iterable[StepCell], graph_bs: Sequence[int] | None, min_steps: int
) -> tuple[dict[tuple[int, int], StepCell], list[tuple[StepCell, str]]]:
    pooled: dict[tuple[int, int], tuple[int, float]] = {}
    ignored: list[tuple[StepCell, str]] = []
    sizes = sorted(graph_bs) if graph_bs else None
    for c in cells:
        if c.b < 1 or c.k < 0:
            ignored.append((c, "batch size < 1 or arm < 0"))
            continue
        if c.decode_steps <= 0 or not math.isfinite(c.busy_s) or c.busy_s <= 0:
            ignored.append((c, "no decode steps or no busy time"))
            continue
        b = c.b
        if sizes:
            i = bisect_left(sizes, b)
            b = sizes[i] if i < len(sizes) else b
        steps, busy = pooled.get((b, c.k), (0, 0.0))
        pooled[(b, c.k)] = (steps + c.decode_steps, busy + c.busy_s)
    out: dict[tuple[int, int], StepCell] = {}
    for (b, k), (steps, busy) in sorted(pooled.items()):
        cell = StepCell(b=b, k=k, decode_steps=steps, busy_s=busy)
        if steps < min_steps:
            ignored.append((cell, f"only {steps} decode steps (< {min_steps})"))
        else:
            out[(b, k)] = cell
    return out, ignored


def fit_observations(
    cells: Iterable[StepCell],
    *,
    draft_ratio: float = DEFAULT_DRAFT_RATIO,
    skip_zero_draft_extend: bool = False,
    graph_bs: Sequence[int] | None = None,
    min_steps: int = DEFAULT_MIN_STEPS,
    info: Mapping[str, Any] | None = None,
) -> FitResult:
    """Fit a cost table to measured step times (see the module docstring for the model).

    Args:
        cells: decode steps and busy seconds per observed ``(b, k)``; repeats are pooled.
        draft_ratio: draft forward time as a share of the target's at the same ``(b, q)``.
        skip_zero_draft_extend: the server ran with ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``
            (a ``k = 0`` step is the target forward alone).
        graph_bs: the server's CUDA-graph batch sizes; observed batch sizes are padded to them.
            None: no padding.
        min_steps: fewer decode steps than this at a ``(b, k)`` and it is not used.
        info: extra fields for the info row.

    Raises:
        ValueError: a bad argument.
        DynspecError: no ``(b, k)`` has enough decode steps to fit anything.
    """
    if not (math.isfinite(draft_ratio) and 0 < draft_ratio < 1):
        raise ValueError(f"draft_ratio must be in (0, 1), got {draft_ratio}")
    if min_steps < 1:
        raise ValueError(f"min_steps must be >= 1, got {min_steps}")
    rho = draft_ratio
    cells = list(cells)
    pooled, ignored = _pool(cells, graph_bs, min_steps)
    if not pooled:
        raise DynspecError(
            f"nothing to fit: no (b, k) has {min_steps} or more decode steps "
            f"({len(cells)} cell(s) read, {len(ignored)} left out)"
        )
    by_b: dict[int, dict[int, float]] = {}
    for (b, k), cell in pooled.items():
        by_b.setdefault(b, {})[k] = cell.step_ms
    bs = sorted(by_b)
    zero_div = 1.0 if skip_zero_draft_extend else 1.0 + rho

    # target(b, 1): measured at k = 0, else linear in b between measured ones, else per-b line.
    t1: dict[int, tuple[float, str]] = {
        b: (by_b[b][0] / zero_div, "measured") for b in bs if 0 in by_b[b]
    }
    t1_bs = sorted(t1)
    for b in bs:
        if b in t1:
            continue
        br = _bracket(t1_bs, b)
        if br is not None:
            lo, hi = t1_bs[br[0]], t1_bs[br[1]]
            t1[b] = (_interp(lo, t1[lo][0], hi, t1[hi][0], b), "interpolated")
            continue
        t1[b] = (_t1_from_arms(by_b[b], rho), "extrapolated")

    # Cells straight from the measured arms.
    target: dict[tuple[int, int], tuple[float, str]] = {}
    for b in bs:
        target[(b, 1)] = t1[b]
        base = t1[b][0]
        for k, ms in by_b[b].items():
            if k == 0:
                continue
            t = (ms - k * rho * base) / (1.0 + rho)
            if t <= 0:
                log.warning("b=%d k=%d: step %.3f ms is below its draft steps; clamped", b, k, ms)
                t = max(ms / (1.0 + rho * (k + 1)), 1e-6)
            target[(b, k + 1)] = (t, "measured")

    qs = sorted({1} | {k + 1 for b in bs for k in by_b[b] if k > 0})
    measured_q = {b: sorted(q for (bb, q) in target if bb == b) for b in bs}
    measured_b = {q: sorted(b for (b, qq) in target if qq == q) for q in qs}
    rows: list[CostRow] = []
    for b in bs:
        for q in qs:
            if (b, q) in target:
                t, src = target[(b, q)]
            else:
                t, src = _fill(b, q, target, measured_b[q], measured_q[b], t1)
            rows.append(CostRow(b=b, q=q, target_ms=t, draft_ms=rho * t, source=src))

    info_row: dict[str, Any] = {
        "source": "fitted",
        "draft_ratio": rho,
        "skip_zero_draft_extend": skip_zero_draft_extend,
        "graph_padding": bool(graph_bs),
        "min_steps": min_steps,
        "decode_steps": sum(c.decode_steps for c in pooled.values()),
        "cells": {s: sum(1 for r in rows if r.source == s) for s in SOURCES},
        **(dict(info) if info else {}),
    }
    return FitResult(
        info=info_row, rows=tuple(rows), used=tuple(pooled.values()), ignored=tuple(ignored)
    )


def _t1_from_arms(arms: Mapping[int, float], rho: float) -> float:
    """target(b, 1) when only speculative arms were measured at this b.

    With target(b, k+1) ≈ target(b, 1) + s·k near small k, T(k) is a line in k whose intercept
    is (1 + ρ)·target(b, 1). One arm: assume s = 0 (a memory-bound verify).
    """
    ks = sorted(arms)
    if len(ks) >= 2:
        n = len(ks)
        mk = sum(ks) / n
        mt = sum(arms[k] for k in ks) / n
        var = sum((k - mk) ** 2 for k in ks)
        slope = sum((k - mk) * (arms[k] - mt) for k in ks) / var
        intercept = mt - slope * mk
        if intercept > 0 and slope >= 0:
            return intercept / (1.0 + rho)
    k = ks[0]
    return arms[k] / (1.0 + rho + k * rho)


def _fill(
    b: int,
    q: int,
    target: Mapping[tuple[int, int], tuple[float, str]],
    bs_at_q: Sequence[int],
    qs_at_b: Sequence[int],
    t1: Mapping[int, tuple[float, str]],
) -> tuple[float, str]:
    br = _bracket(bs_at_q, b)
    if br is not None:
        lo, hi = bs_at_q[br[0]], bs_at_q[br[1]]
        return _interp(lo, target[(lo, q)][0], hi, target[(hi, q)][0], b), "interpolated"
    br = _bracket(qs_at_b, q)
    if br is not None:
        lo, hi = qs_at_b[br[0]], qs_at_b[br[1]]
        return _interp(lo, target[(b, lo)][0], hi, target[(b, hi)][0], q), "interpolated"
    # Nearest batch size that has this q, scaled by the two batch sizes' q = 1 cells.
    near = min(bs_at_q, key=lambda x: (abs(math.log(x / b)), x))
    return target[(near, q)][0] * t1[b][0] / t1[near][0], "extrapolated"


def fit_from_storage(
    storage: Storage,
    server: str,
    *,
    since: float | None = None,
    until: float | None = None,
    **kwargs: Any,
) -> FitResult:
    """Fit a table to ``server``'s stored observations (see :func:`fit_observations`).

    Raises:
        ConfigError: the database has no observations of ``server``.
        StorageError: the database cannot be read.
        DynspecError: too few decode steps anywhere to fit.
    """
    aggs = storage.aggregate(server=server, since=since, until=until)
    if not aggs:
        known = ", ".join(s.address for s in storage.servers()) or "none"
        raise ConfigError(
            f"{storage.url}: no observations of server {server!r} (servers recorded: {known})"
        )
    cells = [StepCell(b=a.b, k=a.k, decode_steps=a.decode_steps, busy_s=a.busy_s) for a in aggs]
    info = {"server": server, "database": storage.url, "observations": sum(a.rows for a in aggs)}
    info.update(kwargs.pop("info", None) or {})
    return fit_observations(cells, info=info, **kwargs)

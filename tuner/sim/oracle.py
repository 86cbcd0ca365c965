"""The oracle: exact expected goodput from the cost profile and the acceptance model.

Chain acceptance (``anchors.md`` §3.3): a request accepts draft position ``i`` with
probability ``α·δ^(i−1)`` given positions ``1..i−1`` were accepted, so
``P(A ≥ i) = α^i·δ^(i(i−1)/2)`` and ``E[emitted] = 1 + Σ_{i≤k} P(A ≥ i)``. With α drawn per
request from ``Beta(a, b)``, ``E[α^i] = Π_{j<i} (a+j)/(a+b+j)`` — still exact.

Goodput of ``b`` requests at arm ``k`` = ``b·E[emitted] / step_s(pad(b), k)``: emitted tokens per
busy second, the quantity the telemetry measures. ``E[emitted]`` is taken per request-step by
default (see :func:`workload_emitted`): in a running batch, requests that accept less stay
longer, so the batch's mean acceptance sits slightly below the per-request mean. For a shifting
workload pass ``t`` (the mix in force then); without it the mix is averaged over the period.

A request class with an acceptance ``shape`` (not a chain, or drifting within a request;
:mod:`tuner.sim.acceptance`) is taken in expectation by quadrature over the per-request Beta
and the request's progress.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

import numpy as np

from policies import table_from_arms
from tuner.sim.acceptance import AcceptanceShape, shape_emitted_mean
from tuner.sim.graphs import cuda_graph_bs, pad_batch_size
from tuner.sim.profiles import CostProfile
from tuner.sim.workloads import LengthDist, Workload, get_workload

__all__ = [
    "expected_emitted",
    "expected_goodput",
    "oracle_arm",
    "oracle_goodput",
    "oracle_table",
    "survival",
    "table_goodput",
    "workload_emitted",
]

Table = tuple[tuple[int | None, int], ...]


def survival(alpha: float, delta: float, k: int, *, kappa: float | None = None) -> list[float]:
    """``[P(A ≥ 1), ..., P(A ≥ k)]`` for mean acceptance ``alpha`` (Beta with concentration
    ``kappa`` when given, else every request has exactly ``alpha``)."""
    out: list[float] = []
    moment = 1.0
    a = b = 0.0
    if kappa is not None:
        a, b = kappa * alpha, kappa * (1.0 - alpha)
    for i in range(1, k + 1):
        if kappa is None:
            moment *= alpha
        else:
            moment *= (a + i - 1) / (a + b + i - 1)
        out.append(moment * delta ** (i * (i - 1) / 2))
    return out


def expected_emitted(alpha: float, delta: float, k: int, *, kappa: float | None = None) -> float:
    """Expected tokens a request emits in one step at arm ``k`` (bonus included)."""
    return 1.0 + sum(survival(alpha, delta, k, kappa=kappa))


@lru_cache(maxsize=8192)
def _inv_emitted_mean(alpha: float, delta: float, k: int, kappa: float | None) -> float:
    """``E[1 / emitted]`` over the per-request α distribution (midpoint rule on 4000 points
    for a bounded density; a density singular at an end, as at small κ, needs quadrature)."""
    if kappa is None:
        return 1.0 / expected_emitted(alpha, delta, k)
    if min(kappa * alpha, kappa * (1.0 - alpha)) < 1.0:
        return shape_emitted_mean(AcceptanceShape(delta=delta), alpha, kappa, k, inverse=True)
    n = 4000
    x = (np.arange(n) + 0.5) / n
    a, b = kappa * alpha, kappa * (1.0 - alpha)
    logpdf = (a - 1.0) * np.log(x) + (b - 1.0) * np.log1p(-x)
    w = np.exp(logpdf - logpdf.max())
    w /= w.sum()
    em = np.ones(n)
    p = np.ones(n)
    for i in range(1, k + 1):
        p = p * x * delta ** (i - 1)
        em += p
    return float((w / em).sum())


@lru_cache(maxsize=256)
def _decode_tokens_mean(dist: LengthDist) -> float:
    """Expected decode tokens of a request (its output length minus the prefill's token)."""
    z = np.linspace(-8.0, 8.0, 8001)
    w = np.exp(-0.5 * z * z)
    w /= w.sum()
    x = np.clip(np.rint(dist.median * np.exp(dist.sigma * z)), dist.lo, dist.hi)
    return float((w * np.maximum(x - 1.0, 0.0)).sum())


def workload_emitted(
    workload: Workload | str,
    family: str,
    k: int,
    *,
    t: float | None = None,
    heterogeneous: bool = True,
    weighting: str = "request-step",
) -> float:
    """Expected tokens emitted per request per decode step at arm ``k`` under a workload.

    Args:
        family: the profile's acceptance family.
        t: the mix in force at virtual time ``t``; None averages the phases by duration.
        heterogeneous: α drawn per request from the workload's Beta (as the engine does);
            False fixes α at each class mean.
        weighting: ``"request-step"`` (default) weights requests by the decode steps they
            occupy, as a running batch does in steady state: requests that accept less stay
            longer, and long-output classes fill more of the batch. It equals
            ``Σ tokens / Σ steps = Σ_c w_c·D_c / Σ_c w_c·D_c·E[1/emitted_c]`` (``D_c`` the
            class's mean decode tokens). ``"request"`` is the plain per-request mean
            ``Σ_c w_c·E[emitted_c]`` (the closed form of anchors §3.3).
    """
    if weighting not in ("request-step", "request"):
        raise ValueError(f"weighting must be 'request-step' or 'request', got {weighting!r}")
    wl = get_workload(workload) if isinstance(workload, str) else workload
    kappa = wl.kappa if heterogeneous else None
    if t is not None or wl.stationary:
        parts = [(1.0, wl.mix_at(0.0 if t is None else t))]
    else:
        parts = []
        start = 0.0
        for ph in wl.phases:
            parts.append((ph.duration_s / wl.period_s, wl.mix_at(start)))
            start += ph.duration_s
    total = 0.0
    for pw, mix in parts:
        if weighting == "request":
            for w, cls in mix:
                alpha, delta = cls.alpha_delta(family)
                if cls.shape is not None:
                    total += pw * w * shape_emitted_mean(cls.shape, alpha, kappa, k)
                else:
                    total += pw * w * expected_emitted(alpha, delta, k, kappa=kappa)
            continue
        tokens = steps = 0.0
        for w, cls in mix:
            alpha, delta = cls.alpha_delta(family)
            d = w * _decode_tokens_mean(cls.output)
            tokens += d
            if cls.shape is not None:
                steps += d * shape_emitted_mean(cls.shape, alpha, kappa, k, inverse=True)
            else:
                steps += d * _inv_emitted_mean(alpha, delta, k, kappa)
        total += pw * tokens / steps
    return total


def _graphs(graph_bs: Sequence[int] | None) -> Sequence[int]:
    return cuda_graph_bs() if graph_bs is None else graph_bs


def expected_goodput(
    profile: CostProfile,
    workload: Workload | str,
    b: int,
    k: int,
    *,
    t: float | None = None,
    skip_zero_draft_extend: bool = False,
    graph_bs: Sequence[int] | None = None,
    heterogeneous: bool = True,
    weighting: str = "request-step",
) -> float:
    """Expected emitted tokens per busy second of decode steps of ``b`` requests at arm ``k``.

    Args:
        graph_bs: captured CUDA-graph batch sizes (default: SGLang's list up to 512); pass
            ``()`` for no padding.
        t, heterogeneous, weighting: see :func:`workload_emitted`.
    """
    padded = pad_batch_size(b, _graphs(graph_bs))
    em = workload_emitted(
        workload, profile.acceptance, k, t=t, heterogeneous=heterogeneous, weighting=weighting
    )
    return b * em / profile.step_s(padded, k, skip_zero_draft_extend=skip_zero_draft_extend)


def oracle_arm(
    profile: CostProfile,
    workload: Workload | str,
    b: int,
    arms: Iterable[int],
    *,
    t: float | None = None,
    skip_zero_draft_extend: bool = False,
    graph_bs: Sequence[int] | None = None,
    heterogeneous: bool = True,
    weighting: str = "request-step",
) -> int:
    """The arm with the highest expected goodput at batch size ``b`` (smallest ``k`` on ties)."""
    best_k, best_g = None, -1.0
    for k in sorted(set(arms)):
        g = expected_goodput(
            profile,
            workload,
            b,
            k,
            t=t,
            skip_zero_draft_extend=skip_zero_draft_extend,
            graph_bs=graph_bs,
            heterogeneous=heterogeneous,
            weighting=weighting,
        )
        if g > best_g * (1 + 1e-12):
            best_k, best_g = k, g
    if best_k is None:
        raise ValueError("arms must not be empty")
    return best_k


def oracle_table(
    profile: CostProfile,
    workload: Workload | str,
    arms: Iterable[int],
    *,
    max_batch: int,
    t: float | None = None,
    skip_zero_draft_extend: bool = False,
    graph_bs: Sequence[int] | None = None,
    heterogeneous: bool = True,
    weighting: str = "request-step",
) -> Table:
    """The per-batch-size oracle as a policy table covering ``1..max_batch`` (then unbounded).

    Bounds fall where the best arm changes, so the table is exact for every ``b ≤ max_batch``.
    """
    arms = tuple(sorted(set(arms)))
    return table_from_arms(
        (
            b,
            oracle_arm(
                profile,
                workload,
                b,
                arms,
                t=t,
                skip_zero_draft_extend=skip_zero_draft_extend,
                graph_bs=graph_bs,
                heterogeneous=heterogeneous,
                weighting=weighting,
            ),
        )
        for b in range(1, max_batch + 1)
    )


def _lookup(table: Table, b: int) -> int:
    for bound, k in table:
        if bound is None or b <= bound:
            return k
    return table[-1][1]


def _weights(batch_sizes: Mapping[int, float] | Iterable[int]) -> dict[int, float]:
    if isinstance(batch_sizes, Mapping):
        out = {int(b): float(w) for b, w in batch_sizes.items() if w > 0}
    else:
        out = {int(b): 1.0 for b in batch_sizes}
    if not out or min(out) < 1:
        raise ValueError("batch_sizes must name at least one batch size >= 1 with weight > 0")
    return out


def table_goodput(
    profile: CostProfile,
    workload: Workload | str,
    table: Table,
    batch_sizes: Mapping[int, float] | Iterable[int],
    *,
    t: float | None = None,
    skip_zero_draft_extend: bool = False,
    graph_bs: Sequence[int] | None = None,
    heterogeneous: bool = True,
    weighting: str = "request-step",
) -> float:
    """Expected goodput of a table over a batch-size occupancy.

    ``batch_sizes`` maps batch size to the share of busy time spent there (e.g. ``busy_s``
    summed from counters per ``b``), or lists batch sizes weighted equally. The result is the
    time-weighted mean of the per-batch-size expected goodputs — what a server that spends
    those shares of its time at those batch sizes would show — so the oracle's table is never
    beaten by another table over the same occupancy. The table is looked up with the padded
    batch size, as the engine and SGLang do.
    """
    g = _graphs(graph_bs)
    total = weight = 0.0
    for b, w in _weights(batch_sizes).items():
        padded = pad_batch_size(b, g)
        k = _lookup(table, padded)
        em = workload_emitted(
            workload, profile.acceptance, k, t=t, heterogeneous=heterogeneous, weighting=weighting
        )
        total += (
            w * b * em / profile.step_s(padded, k, skip_zero_draft_extend=skip_zero_draft_extend)
        )
        weight += w
    return total / weight


def oracle_goodput(
    profile: CostProfile,
    workload: Workload | str,
    arms: Iterable[int],
    batch_sizes: Mapping[int, float] | Iterable[int],
    *,
    t: float | None = None,
    skip_zero_draft_extend: bool = False,
    graph_bs: Sequence[int] | None = None,
    heterogeneous: bool = True,
    weighting: str = "request-step",
) -> float:
    """:func:`table_goodput` of the per-batch-size oracle over the same occupancy."""
    weights = _weights(batch_sizes)
    kw = dict(
        t=t,
        skip_zero_draft_extend=skip_zero_draft_extend,
        graph_bs=graph_bs,
        heterogeneous=heterogeneous,
        weighting=weighting,
    )
    table = oracle_table(profile, workload, arms, max_batch=max(weights), **kw)  # type: ignore[arg-type]
    return table_goodput(profile, workload, table, weights, **kw)  # type: ignore[arg-type]

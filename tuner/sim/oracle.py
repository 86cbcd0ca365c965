"""The oracle: exact expected goodput from the cost profile and the acceptance model.

Chain acceptance (``anchors.md`` §3.3): a request accepts draft position ``i`` with
probability ``α·δ^(i−1)`` given positions ``1..i−1`` were accepted, so
``P(A ≥ i) = α^i·δ^(i(i−1)/2)`` and ``E[emitted] = 1 + Σ_{i≤k} P(A ≥ i)``. With α drawn per
request from ``Beta(a, b)``, ``E[α^i] = Π_{j<i} (a+j)/(a+b+j)`` — still exact.

Goodput of ``b`` requests at arm ``k`` = ``b·E[emitted] / step_s(pad(b), k)``: emitted tokens per
busy second, the quantity the telemetry measures. For a shifting workload pass ``t`` (the mix
in force then); without it the mix is averaged over the workload's period.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tuner.sim.graphs import cuda_graph_bs, pad_batch_size
from tuner.sim.profiles import CostProfile
from tuner.sim.workloads import Workload, get_workload

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


def workload_emitted(
    workload: Workload | str, family: str, k: int, *, t: float | None = None, heterogeneous: bool = True
) -> float:
    """``E[emitted]`` per request-step under a workload's mix at time ``t`` (or period mean)."""
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
        for w, cls in mix:
            alpha, delta = cls.alpha_delta(family)
            total += pw * w * expected_emitted(alpha, delta, k, kappa=kappa)
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
) -> float:
    """Expected emitted tokens per busy second of decode steps of ``b`` requests at arm ``k``.

    Args:
        graph_bs: captured CUDA-graph batch sizes (default: SGLang's list); pass ``()`` for no
            padding.
    """
    padded = pad_batch_size(b, _graphs(graph_bs))
    em = workload_emitted(workload, profile.acceptance, k, t=t, heterogeneous=heterogeneous)
    return b * em / profile.step_s(padded, k, skip_zero_draft_extend=skip_zero_draft_extend)


def oracle_arm(
    profile: CostProfile,
    workload: Workload | str,
    b: int,
    arms: Iterable[int],
    **kw: object,
) -> int:
    """The arm with the highest expected goodput at batch size ``b`` (smallest ``k`` on ties)."""
    best_k, best_g = None, -1.0
    for k in sorted(set(arms)):
        g = expected_goodput(profile, workload, b, k, **kw)  # type: ignore[arg-type]
        if g > best_g * (1 + 1e-12):
            best_k, best_g = k, g
    assert best_k is not None, "arms must not be empty"
    return best_k


def oracle_table(
    profile: CostProfile,
    workload: Workload | str,
    arms: Iterable[int],
    *,
    max_batch: int,
    **kw: object,
) -> Table:
    """The per-batch-size oracle as a policy table covering ``1..max_batch`` (then unbounded).

    Bounds fall where the best arm changes, so the table is exact for every ``b ≤ max_batch``.
    """
    arms = tuple(sorted(set(arms)))
    rows: list[tuple[int | None, int]] = []
    for b in range(1, max_batch + 1):
        k = oracle_arm(profile, workload, b, arms, **kw)
        if rows and rows[-1][1] == k:
            rows[-1] = (b, k)
        else:
            rows.append((b, k))
    rows[-1] = (None, rows[-1][1])
    return tuple(rows)


def _lookup(table: Table, b: int) -> int:
    for bound, k in table:
        if bound is None or b <= bound:
            return k
    return table[-1][1]


def _weights(batch_sizes: Mapping[int, float] | Iterable[int]) -> dict[int, float]:
    if isinstance(batch_sizes, Mapping):
        return {int(b): float(w) for b, w in batch_sizes.items() if w > 0}
    return {int(b): 1.0 for b in batch_sizes}


def table_goodput(
    profile: CostProfile,
    workload: Workload | str,
    table: Table,
    batch_sizes: Mapping[int, float] | Iterable[int],
    *,
    graph_bs: Sequence[int] | None = None,
    **kw: object,
) -> float:
    """Expected goodput of a table over a batch-size occupancy.

    ``batch_sizes`` maps batch size to decode steps spent there (e.g. summed from counters),
    or lists batch sizes weighted equally. The result is total expected emitted tokens over
    total expected busy time — the aggregate a server running this table would show. The
    table is looked up with the padded batch size, as the engine and SGLang do.
    """
    g = _graphs(graph_bs)
    tokens = seconds = 0.0
    skip = bool(kw.get("skip_zero_draft_extend", False))
    t = kw.get("t")
    het = bool(kw.get("heterogeneous", True))
    for b, w in _weights(batch_sizes).items():
        padded = pad_batch_size(b, g)
        k = _lookup(table, padded)
        em = workload_emitted(workload, profile.acceptance, k, t=t, heterogeneous=het)  # type: ignore[arg-type]
        tokens += w * b * em
        seconds += w * profile.step_s(padded, k, skip_zero_draft_extend=skip)
    return tokens / seconds if seconds > 0 else 0.0


def oracle_goodput(
    profile: CostProfile,
    workload: Workload | str,
    arms: Iterable[int],
    batch_sizes: Mapping[int, float] | Iterable[int],
    **kw: object,
) -> float:
    """:func:`table_goodput` of the per-batch-size oracle over the same occupancy."""
    weights = _weights(batch_sizes)
    table = oracle_table(profile, workload, arms, max_batch=max(weights), **kw)
    return table_goodput(profile, workload, table, weights, **kw)

"""Exploration sent as probes: the greedy table, and each exploring row as a short probe.

A server that takes probes (protocol v2) runs a probe's arm for a given number of decode
steps of its batch sizes and then goes back to the table by itself, so an exploring dwell
lasts that many steps instead of the time until the next table arrives (a decision period,
2 s by default). At 128-256 requests a decision period holds tens of steps, and one dwell of
an arm far from the best cost 2-3 points of a phase of the bench (docs/policy-log.md,
"Exploring probes").

How long: at least the dwell every learning policy asks of an arm
(``DEFAULT_MIN_DWELL_STEPS`` decode steps), and at least ``PROBE_REQUEST_STEPS``
request-steps at the bucket's smallest batch size, so a probe measures about as many
request-steps at 16 requests as at 256. At a few requests that is more steps than a
decision period holds, and exploring goes on as before: until the next proposal, which
ends the probe if it no longer explores.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies._learning import DEFAULT_MIN_DWELL_STEPS

__all__ = ["PROBE_REQUEST_STEPS", "Probe", "probe_steps", "split_probes"]

# Request-steps a probe measures at least (b * steps at the bucket's smallest b).
PROBE_REQUEST_STEPS = 1024

# (lowest batch size, highest or None, k, decode steps)
Probe = tuple[int, int | None, int, int]

_Row = tuple[int | None, object]


def probe_steps(lo: int, min_steps: int = DEFAULT_MIN_DWELL_STEPS) -> int:
    """Decode steps of a probe whose smallest batch size is ``lo``."""
    return max(min_steps, -(-PROBE_REQUEST_STEPS // max(lo, 1)))


def _ks(row_k: object, n: int) -> tuple[int, ...]:
    if isinstance(row_k, tuple):
        return row_k
    return (int(row_k),) * n  # type: ignore[call-overload]


def split_probes(
    proposed: Sequence[_Row], greedy: Sequence[_Row], *, min_steps: int = DEFAULT_MIN_DWELL_STEPS
) -> tuple[tuple[_Row, ...], tuple[Probe, ...]]:
    """``(table, probes)`` that run ``proposed`` as the greedy table plus probes.

    Both tables are v1 (``(bound, k)``) or banded (``(bound, ks)``) rows over the same batch
    sizes. Where the proposal differs from the greedy table by one arm in every band (how a
    learning policy explores a row) that range becomes a probe and the table keeps the
    greedy row; any other difference stays in the table as proposed. The table comes back
    with merged rows, the last unbounded: banded (every band's ``k``) if either table was,
    else as ``(bound, k)`` rows.
    """
    n = max(len(_ks(r[1], 1)) for r in (*proposed, *greedy))
    bounds = sorted({b for b, _ in (*proposed, *greedy) if b is not None})
    segments: list[tuple[int, int | None]] = []
    lo = 1
    for b in bounds:
        segments.append((lo, b))
        lo = b + 1
    segments.append((lo, None))

    def row_at(table: Sequence[_Row], b: int) -> tuple[int, ...]:
        for bound, k in table:
            if bound is None or b <= bound:
                return _ks(k, n)
        return _ks(table[-1][1], n)

    rows: list[tuple[int | None, tuple[int, ...]]] = []
    probes: list[Probe] = []
    for lo, hi in segments:
        p, g = row_at(proposed, lo), row_at(greedy, lo)
        keep = p
        if p != g and len(set(p)) == 1:
            probes.append((lo, hi, p[0], probe_steps(lo, min_steps)))
            keep = g
        if rows and rows[-1][1] == keep:
            rows[-1] = (hi, keep)
        else:
            rows.append((hi, keep))
    rows[-1] = (None, rows[-1][1])
    if n == 1:  # both tables band-agnostic: so is the result
        return tuple((b, ks[0]) for b, ks in rows), tuple(probes)  # type: ignore[misc]
    return tuple(rows), tuple(probes)

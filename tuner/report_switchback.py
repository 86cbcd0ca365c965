"""The switchback experiment read back from the history (``holdout_pair`` events), for
``report``, and its true value where the truth is known (the simulator's oracle).

A pair's windows are spans of tick times ``[start, end)``; the observations read at a tick
cover the interval before it, so a window's observations are those stamped in
``(start, end]``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tuner.protocol import Table, lookup
from tuner.report_gain import parse_table_text
from tuner.switchback import Pair, SwitchbackGain, estimate

if TYPE_CHECKING:
    from storage import Storage

__all__ = ["read_pairs", "server_switchback", "switchback_lines", "true_gain"]

log = logging.getLogger(__name__)
_EPS = 1e-6


def read_pairs(storage: Storage, server: str, *, since: float | None = None,
               until: float | None = None) -> list[Pair]:
    """The usable pairs recorded for ``server`` whose windows lie in ``[since, until)``."""
    out = []
    for e in storage.events(server=server, kinds=["holdout_pair"], since=since):
        try:
            pair = Pair.from_json(e.detail)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            log.warning("%s: a holdout_pair event at %.0f cannot be read (%s); skipped",
                        server, e.ts, exc)
            continue
        first = min(pair.base_span[0], pair.control_span[0])
        if (since is None or first >= since) and (until is None or e.ts < until):
            out.append(pair)
    return out


def server_switchback(storage: Storage, server: str, *, since: float | None = None,
                      until: float | None = None) -> SwitchbackGain | None:
    """The measured gain over the window's pairs, and its cost over the experiment's span:
    from its start to the end of its last pair's block, skipped and void blocks included, with
    every baseline window in it (those of void pairs too). That is what the daemon's token
    budget holds to ``fraction`` (``tuner.switchback.Budget``). None without a pair."""
    pairs = read_pairs(storage, server, since=since, until=until)
    if not pairs:
        return None
    spans: dict[float, float] = {}  # the experiment's start (one per daemon run) -> span end
    for p in pairs:
        if p.block_span is None:  # recorded before pairs carried their block
            start = min(p.base_span[0], p.control_span[0])
            spans[start] = max(p.base_span[1], p.control_span[1])
            continue
        lo, hi = p.block_span
        t0 = round(lo - p.block * (hi - lo), 3)
        spans[t0] = max(spans.get(t0, hi), hi)
    if since is not None:
        spans = {max(t0, since): end for t0, end in spans.items()}
    tokens = busy = 0.0
    for start, end in spans.items():
        for a in storage.aggregate(server=server, since=start + _EPS, until=end + _EPS):
            tokens += a.emitted_tokens
            busy += a.busy_s
    base_tokens = base_busy = 0.0
    for start, end in _baseline_windows(storage, server, since=min(spans)):
        if any(t0 - _EPS <= start < span_end for t0, span_end in spans.items()):
            for a in storage.aggregate(server=server, since=start + _EPS, until=end + _EPS):
                base_tokens += a.emitted_tokens
                base_busy += a.busy_s
    return estimate(pairs, all_tokens=tokens, all_busy_s=busy, base_tokens=base_tokens,
                    base_busy_s=base_busy)


def _baseline_windows(storage: Storage, server: str, *,
                      since: float) -> list[tuple[float, float]]:
    """``[start, end)`` of every baseline window: ``holdout_start`` to the next
    ``holdout_end`` (readings stamped in ``(start, end]`` ran on the baseline)."""
    out, start = [], None
    for e in storage.events(server=server, kinds=["holdout_start", "holdout_end"],
                            since=since - _EPS):
        if e.kind == "holdout_start":
            start = e.ts if start is None else start
        elif start is not None:
            out.append((start, e.ts))
            start = None
    return out


def switchback_lines(r: SwitchbackGain) -> list[str]:
    """Two lines (each under 100 columns) for the text and HTML reports."""
    hi = f"{r.high:+.1%}" if math.isfinite(r.high) else "+inf"
    lo = f"{r.low:+.1%}" if math.isfinite(r.low) else "-inf"
    return [f"measured gain over the server's starting table (switchback, {r.pairs} pairs): "
            f"{r.ratio:+.1%} [{lo}, {hi}]",
            f"  the baseline ran {r.base_share:.1%} of the busy time and cost {r.cost:.2%} of "
            "goodput"]


def true_gain(
    storage: Storage,
    server: str,
    pairs: Sequence[Pair],
    expected: Callable[[int, int], float],
    stratum: Callable[[int], str],
) -> float:
    """The gain the pairs estimate, from known expected goodputs ``expected(b, k)`` (the
    simulator's oracle) instead of measured ones: per pair and stratum both windows were busy
    in, the control window's arms (as it ran them at each batch size, else the table in
    effect) against the baseline table, over the pair's own batch-size mix, weighted as the
    estimate weights them. It leaves out what the experiment cannot control (noise, and the
    load's drift between the two windows), so it is what the interval should cover."""
    applied = [(v.ts, v.table) for v in storage.policy_versions(server=server)
               if v.outcome == "applied"]
    sa = sb = 0.0
    for p in pairs:
        base = parse_table_text(p.base_table)
        if base is None:
            raise ValueError(f"pair of block {p.block} has no baseline table")
        occ = {r: _occupancy(storage, server, span) for r, span in
               (("base", p.base_span), ("control", p.control_span))}
        fallback = _table_at(applied, p.control_span[0], base)
        for key, (_, sb_) in p.base.items():
            if key not in p.control or sb_ <= 0 or p.control[key][1] <= 0:
                continue
            w = sb_ + p.control[key][1]
            mix: dict[int, float] = {}
            for r in occ:
                for (b, _k), t in occ[r].items():
                    if stratum(b) == key:
                        mix[b] = mix.get(b, 0.0) + t
            total = sum(mix.values())
            if total <= 0:
                continue
            g_t = g_b = 0.0
            for b, t in mix.items():
                ran = {k: s for (bb, k), s in occ["control"].items() if bb == b}
                if ran:
                    g_t += t * sum(s * expected(b, k) for k, s in ran.items()) / sum(ran.values())
                else:
                    g_t += t * expected(b, lookup(fallback, b))
                g_b += t * expected(b, lookup(base, b))
            sa += w * g_t / total
            sb += w * g_b / total
    return sa / sb - 1 if sb > 0 else math.nan


def _occupancy(storage: Storage, server: str, span: Sequence[float]) -> dict[tuple[int, int], float]:
    return {(a.b, a.k): a.busy_s for a in storage.aggregate(
        server=server, since=span[0] + _EPS, until=span[1] + _EPS) if a.busy_s > 0}


def _table_at(applied: Sequence[tuple[float, Table]], t: float, default: Table) -> Table:
    table = default
    for ts, tb in applied:
        if ts <= t + _EPS:
            table = tb
    return table

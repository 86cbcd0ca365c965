"""The text report (fits 100 columns)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from datetime import datetime, timezone

from tuner.protocol import BandIndex, format_band_table
from tuner.report._model import TEXT_WIDTH, Report, ServerReport, VersionEntry


# Versions listed in the text report (JSON and HTML list all in the window).
_TEXT_VERSIONS = 12
_TEXT_EVENTS = 12


# --- text ---------------------------------------------------------------------------------------


def _iso(ts: float | None, *, seconds: bool = True) -> str:
    if ts is None:
        return "-"
    fmt = "%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime(fmt) + "Z"


def _num(x: float | None, width: int = 9, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    return f"{x:,.{digits}f}".rjust(width)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _table_str(table: Sequence[tuple[int | None, int]]) -> str:
    return " ".join(f"b<={b}:k{k}" if b is not None else f"rest:k{k}" for b, k in table)


def _version_str(v: VersionEntry) -> str:
    """A version's table; a banded one as ``k3/1,3,3,5`` (unknown band / bands 1..4)."""
    return format_band_table(v.bands) if v.bands is not None else _table_str(v.table)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def render_text(report: Report, *, width: int = TEXT_WIDTH) -> str:
    """The report as plain text whose lines fit in ``width`` (>= 80) columns."""
    width = max(80, width)
    out: list[str] = []
    window = f"{_iso(report.since)} .. {_iso(report.until) if report.until else 'now'}"
    out.append(_clip(f"dynspec-tuner report  {_iso(report.generated_at)}", width))
    out.append(_clip(f"database {report.database}   window {window}", width))
    if not report.servers:
        out.append("")
        out.append("no servers recorded in this database")
    for s in report.servers:
        out.extend(_server_text(s, width))
    return "\n".join(line.rstrip() for line in out) + "\n"


def _server_text(s: ServerReport, width: int) -> list[str]:
    title = f"== server {s.server} " + (f"({s.model}) " if s.model else "")
    out = ["", title + "=" * max(0, width - len(title))]
    arms = ",".join(str(a) for a in s.arms) or "-"
    always = f"k{s.always_arm}" if s.always_arm is not None else "-"
    span = f"{_iso(s.data_span[0])} .. {_iso(s.data_span[1])}" if s.data_span else "no data"
    out.append(_clip(
        f"arms {arms}   always-speculate arm {always}   {s.observations:,} observations, "
        f"{s.decode_steps:,} decode steps", width))
    out.append(f"data {span}")
    if s.table is not None:
        out.append(_clip(
            f"table in effect: v{s.table.version} {s.table.outcome} {_iso(s.table.ts)} "
            f"({s.table.policy}): {_version_str(s.table)}", width))
    else:
        out.append("no table recorded: 'chosen' below is the best arm by the data")
    if s.metrics_only:
        out.append(_clip(
            "metrics-only mode (no dynspec plugin): coarse per-interval observations of the "
            "arm the server ran; nothing was pushed", width))
    if s.crossover_b is not None:
        out.append(f"speculation stops paying from batch size {s.crossover_b}")
    elif any(b.chosen is not None for b in s.buckets):
        out.append("speculation pays in every bucket with a decision")
    c = s.counts
    out.append(
        f"pushes {c['pushes']}   rejected updates {c['rejected_updates']}   "
        f"outages {c['outages']}   restarts {c['restarts']}"
    )
    from tuner.report_gain import gain_lines

    out.extend(_clip(line, width) for line in gain_lines(s.gains))
    if s.switchback is not None:
        from tuner.report_switchback import switchback_lines

        out.extend(_clip(line, width) for line in switchback_lines(s.switchback))
    vs_always = f"vs k{s.always_arm}" if s.always_arm is not None else "vs always"
    out.append("")
    out.append(
        f"{'bucket':<9} {'arm':<5} {'goodput':>9} {'95% interval':>21} {'steps':>11} "
        f"{'intvls':>7} {'acc/step':>8} {'acc rate':>8}  {'':<4}"
    )
    out.append(f"{'':<9} {'':<5} {'tok/s':>9}")
    any_rows = False
    bands = s.table.bands if s.table is not None else None
    for bk in s.buckets:
        if not bk.arms:
            continue  # no data: its arm is in the table above
        any_rows = True
        chosen = f"k{bk.chosen if bk.chosen is not None else '-'}"
        if bands is not None:  # the row as it runs: k<unknown band>/<bands 1..>
            ks = BandIndex(bands).ks_for(bk.high if bk.high is not None else bk.low)
            chosen = f"k{ks[0]}/{','.join(map(str, ks[1:]))}" if len(set(ks)) > 1 else chosen
        head = (
            f"{bk.label:<9} chosen {chosen}"
            f" · best k{bk.best if bk.best is not None else '-'}"
            f" · b_ref {_num(bk.b_ref, 0, 1).strip()}"
            f" · chosen vs k0 {_pct(bk.gain_vs_off)}, {vs_always} {_pct(bk.gain_vs_always)}"
        )
        out.append(_clip(head, width))
        for a in bk.arms:
            ci = (
                f"[{_num(a.ci_low, 9)}, {_num(a.ci_high, 9)}]"
                if a.ci_low is not None
                else "-".rjust(21)
            )
            mark = "<" if a.arm == bk.chosen else ""
            mark += "*" if a.arm == bk.best else ""
            acc = _num(a.accepted_per_step, 8, 2)
            rate = _num(None if a.acceptance_rate is None else a.acceptance_rate * 100, 7, 1)
            rate = rate + ("%" if a.acceptance_rate is not None else " ")
            out.append(
                f"{'':<9} k{a.arm:<4} {_num(a.goodput)} {ci} {a.decode_steps:>11,} "
                f"{a.intervals:>7,} {acc} {rate}  {mark:<4}"
            )
    if not any_rows:
        out.append("(no observations in the window)")
    else:
        out.append("< = chosen (table in effect), * = best estimate in the window; goodput at "
                   "b_ref")
        if bands is not None:
            out.extend(textwrap.wrap(
                "banded table: a row picks its arm per acceptance band, so each arm above ran "
                "only in the bands that chose it (not comparable across arms); 'chosen vs k0' "
                "is the row as it ran", width))
    if s.versions:
        shown = s.versions[-_TEXT_VERSIONS:]
        out.append("")
        out.append(f"policy versions ({len(shown)} latest of {len(s.versions)} in the window)")
        for v in shown:
            line = (
                f"  v{v.version:<5} {_iso(v.ts)} {v.outcome:<8} {_version_str(v)}"
                f"  {v.policy}: {_one_line(v.reason)}"
            )
            out.append(_clip(line, width))
    if s.events:
        shown_e = s.events[-_TEXT_EVENTS:]
        out.append("")
        out.append(f"events ({len(shown_e)} latest of {len(s.events)} in the window)")
        for e in shown_e:
            out.append(_clip(f"  {_iso(e.ts)} {e.kind:<16} {_one_line(e.detail)}", width))
    if s.plots:
        out.append("")
        for name, path in s.plots.items():
            out.append(_clip(f"plot {name}: {path}", width))
    return out

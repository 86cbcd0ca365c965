"""What the tuner learned, for people: aggregation into a report model, and its renderers.

:func:`build_report` reads storage (every sum is computed by the database, one grouped query
per report: :meth:`storage.Storage.moments`), :func:`summarize` is the pure fold of those
sums into a :class:`Report`, and the renderers turn a report into text (fits 100 columns),
JSON (schema ``dynspec-report/1``, documented in the README) or a self-contained HTML page
with the plots embedded. :func:`make_plots` draws the PNGs with matplotlib's Agg backend.

Estimates. Each stored observation is one sampling interval ``i`` of one ``(b, k)`` with
emitted tokens ``e_i`` and busy seconds ``t_i``. Per bucket and arm the report estimates the
per-request rate ``r = Σe / Σ(b·t)`` (a ratio estimator with the interval as the sampling unit)
and shows ``goodput = r · b_ref``, the goodput at the bucket's reference batch size ``b_ref``
(the step-weighted mean batch size of everything seen in the bucket). Arms observed at somewhat
different batch sizes inside one bucket therefore compare fairly, and in a bucket holding a
single batch size ``goodput`` is exactly ``Σe / Σt``. The 95 % interval is the delta-method
interval of the ratio, ``r ± t₀.₉₇₅,ₙ₋₁ · sqrt(n Σ(e − r·b·t)² / ((n − 1) (Σ b·t)²))``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policies import Buckets
from tuner._atomic import write_atomic
from tuner.errors import ConfigError

if TYPE_CHECKING:
    from storage import (
        EventRecord,
        ObservationMoments,
        PolicyVersionRecord,
        ServerRecord,
        Storage,
    )

__all__ = [
    "DEFAULT_TIME_BINS",
    "FORMATS",
    "REPORT_EVENT_KINDS",
    "REPORT_SCHEMA",
    "TEXT_WIDTH",
    "ArmStat",
    "BucketReport",
    "CurvePoint",
    "EventEntry",
    "Report",
    "ServerReport",
    "TimePoint",
    "VersionEntry",
    "always_arm",
    "build_report",
    "make_plots",
    "open_history",
    "parse_since",
    "render_html",
    "render_json",
    "render_text",
    "report_to_json",
    "summarize",
    "write_report",
]

REPORT_SCHEMA = "dynspec-report/1"
FORMATS = ("text", "json", "html")
TEXT_WIDTH = 100
# Goodput-over-time resolution: enough points for a readable line, few enough groups for
# the database to return in milliseconds.
DEFAULT_TIME_BINS = 48
# Events a report lists (others stay in the database).
REPORT_EVENT_KINDS = (
    "outage",
    "recovered",
    "restart",
    "update_rejected",
    "plugin_missing",
    "malformed_reply",
    "arms_changed",
    "model_changed",
)
# Versions listed in the text report (JSON and HTML list all in the window).
_TEXT_VERSIONS = 12
_TEXT_EVENTS = 12

# Two-sided 95 % Student t quantiles for 1..30 degrees of freedom; 1.96 beyond.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)


def _t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


# --- the model ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArmStat:
    """One arm in one bucket over the report window."""

    arm: int
    goodput: float  # tokens/s at the bucket's b_ref
    ci_low: float | None  # 95 % interval; None with fewer than 2 intervals
    ci_high: float | None
    decode_steps: int
    intervals: int  # stored observations (sampling intervals)
    busy_s: float
    emitted_tokens: int
    raw_goodput: float  # Σ emitted / Σ busy, no batch-size standardisation
    mean_b: float  # step-weighted mean batch size this arm was seen at
    accepted_per_step: float | None  # accepted drafts per request per decode step
    acceptance_rate: float | None  # accepted / drafted tokens


@dataclass(frozen=True, slots=True)
class BucketReport:
    index: int
    label: str
    low: int
    high: int | None
    b_ref: float
    arms: tuple[ArmStat, ...]
    chosen: int | None  # the arm of the table in effect (or ``best`` without one)
    best: int | None  # highest estimated goodput in the window
    gain_vs_off: float | None  # goodput(chosen) / goodput(k=0) - 1
    gain_vs_always: float | None  # goodput(chosen) / goodput(always arm) - 1

    def arm(self, k: int | None) -> ArmStat | None:
        return next((a for a in self.arms if a.arm == k), None)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    b: int
    k: int
    goodput: float
    decode_steps: int


@dataclass(frozen=True, slots=True)
class TimePoint:
    t: float  # bin start
    k: int | None  # None: all arms together
    goodput: float
    decode_steps: int


@dataclass(frozen=True, slots=True)
class VersionEntry:
    ts: float
    version: int
    table: tuple[tuple[int | None, int], ...]
    policy: str
    reason: str
    outcome: str


@dataclass(frozen=True, slots=True)
class EventEntry:
    ts: float
    kind: str
    detail: str


@dataclass(frozen=True)
class ServerReport:
    server: str
    arms: tuple[int, ...]
    always_arm: int | None
    observations: int
    decode_steps: int
    data_span: tuple[float, float] | None
    table: VersionEntry | None  # the table in effect at the end of the window
    chosen_from: str  # "policy" (the table above) or "data" (best per bucket)
    crossover_b: int | None  # speculation is off from this batch size up
    buckets: tuple[BucketReport, ...]
    curve: tuple[CurvePoint, ...]
    timeline: tuple[TimePoint, ...]
    bin_s: float | None
    versions: tuple[VersionEntry, ...]
    events: tuple[EventEntry, ...]
    counts: dict[str, int]
    metrics_only: bool = False  # watched without the plugin (coarse /metrics observations)
    model: str | None = None  # what the server last said it runs
    plots: dict[str, str] = field(default_factory=dict)  # name -> file, when written beside
    gains: tuple = ()  # tuner.report_gain.ReportGain per baseline (start, k0, always)


@dataclass(frozen=True)
class Report:
    generated_at: float
    database: str
    since: float | None
    until: float | None
    bucket_edges: tuple[int, ...]
    servers: tuple[ServerReport, ...]


# --- inputs -------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_since(text: str, *, now: float) -> float:
    """``--since``: a duration back from ``now`` (``90s``, ``15m``, ``1h``, ``2d``, ``1w``;
    a bare number is seconds) or an ISO-8601 time (UTC unless it says otherwise).

    Raises:
        ConfigError: naming the value.
    """
    m = _DURATION.match(text)
    if m:
        back = float(m.group(1)) * _UNIT_S[m.group(2)]
        if not back <= now:
            raise ConfigError(f"--since {text!r}: reaches back before 1970")
        return now - back
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"--since {text!r}: expected a duration such as 30m, 1h, 2d or an ISO time "
            "such as 2025-11-30T12:00"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def open_history(url: str) -> Storage:
    """Open a history database for reading (report, export) without creating one.

    Raises:
        ConfigError: an SQLite file that does not exist (named, with a hint).
        StorageError: the database cannot be opened or holds no dynspec history.
    """
    from sqlalchemy.engine import make_url

    from storage import Storage, redact_url
    from tuner.config import db_url_hint

    try:
        parsed = make_url(url)
    except Exception as exc:
        raise ConfigError(f"--db {redact_url(url)}: not a database URL ({exc})"
                          + db_url_hint(url)) from None
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        if db and db != ":memory:" and not db.startswith("file:") and not Path(db).exists():
            raise ConfigError(
                f"--db {url}: no such file {db} (the daemon writes sqlite:///dynspec.db, "
                "run --simulate sqlite:///dynspec-sim.db; DYNSPEC_DB sets the default)"
            )
    return Storage(url, read_only=True)


def always_arm(arms: Sequence[int]) -> int | None:
    """The arm an always-speculating SGLang runs for this arm set.

    SGLang's own choice: with ``--speculative-adaptive`` and no ``--speculative-num-steps`` it
    starts at ``union[len // 2]`` of the candidate steps; if that is 0, the smallest positive
    arm. None when no arm drafts.
    """
    ordered = sorted(set(arms))
    positive = [a for a in ordered if a > 0]
    if not positive:
        return None
    pick = ordered[len(ordered) // 2]
    return pick if pick > 0 else positive[0]


# --- aggregation (pure) -------------------------------------------------------------------------


@dataclass
class _Acc:
    rows: int = 0
    steps: int = 0
    emitted: int = 0
    accepted: int = 0
    drafted: int = 0
    busy: float = 0.0
    req_steps: float = 0.0  # Σ b·steps
    y: float = 0.0  # Σ b·t
    xx: float = 0.0  # Σ e²
    xy: float = 0.0  # Σ e·b·t
    yy: float = 0.0  # Σ (b·t)²

    def add(self, m: ObservationMoments) -> None:
        b = m.b
        self.rows += m.rows
        self.steps += m.decode_steps
        self.emitted += m.emitted_tokens
        self.accepted += m.accepted_drafts
        self.drafted += m.drafted_tokens
        self.busy += m.busy_s
        self.req_steps += b * m.decode_steps
        self.y += b * m.busy_s
        self.xx += m.emitted_sq
        self.xy += b * m.emitted_busy
        self.yy += b * b * m.busy_sq


def _arm_stat(k: int, acc: _Acc, b_ref: float) -> ArmStat:
    r = acc.emitted / acc.y if acc.y > 0 else math.nan
    lo = hi = None
    n = acc.rows
    if n >= 2 and acc.y > 0:
        ss = max(0.0, acc.xx - 2 * r * acc.xy + r * r * acc.yy)
        half = _t975(n - 1) * math.sqrt(ss * n / ((n - 1) * acc.y * acc.y))
        lo, hi = (r - half) * b_ref, (r + half) * b_ref
    return ArmStat(
        arm=k,
        goodput=r * b_ref,
        ci_low=lo,
        ci_high=hi,
        decode_steps=acc.steps,
        intervals=n,
        busy_s=acc.busy,
        emitted_tokens=acc.emitted,
        raw_goodput=acc.emitted / acc.busy if acc.busy > 0 else math.nan,
        mean_b=acc.req_steps / acc.steps if acc.steps else math.nan,
        accepted_per_step=(acc.accepted / acc.req_steps) if k > 0 and acc.req_steps else None,
        acceptance_rate=(acc.accepted / acc.drafted) if acc.drafted else None,
    )


def _table_arm(table: Sequence[tuple[int | None, int]], b: int) -> int:
    for bound, k in table:
        if bound is None or b <= bound:
            return k
    return table[-1][1]


def _gain(a: ArmStat | None, base: ArmStat | None) -> float | None:
    if a is None or base is None or not base.goodput > 0 or math.isnan(a.goodput):
        return None
    return a.goodput / base.goodput - 1.0


def _crossover(buckets: Sequence[BucketReport]) -> int | None:
    """Lower bound of the first bucket from which every decided bucket above runs k = 0."""
    decided = [bk for bk in buckets if bk.chosen is not None]
    if not decided or decided[-1].chosen != 0:
        return None
    start = decided[-1]
    for bk in reversed(decided):
        if bk.chosen != 0:
            break
        start = bk
    return start.low


def _in_effect(versions: Sequence[VersionEntry]) -> VersionEntry | None:
    """The last applied table (a dry run's when nothing was ever applied)."""
    for wanted in ("applied", "dry_run"):
        hits = [v for v in versions if v.outcome == wanted]
        if hits:
            return max(hits, key=lambda v: (v.ts, v.version))
    return None


def summarize(
    *,
    server: str,
    arms: Sequence[int],
    moments: Iterable[ObservationMoments],
    versions: Sequence[PolicyVersionRecord] = (),
    events: Sequence[EventRecord] = (),
    buckets: Buckets | None = None,
    since: float | None = None,
    until: float | None = None,
    bin_s: float | None = None,
    origin: float = 0.0,
    always: int | None = None,
) -> ServerReport:
    """Fold one server's database sums into its part of the report. Pure.

    Args:
        server: the address.
        arms: the arms the server reported (arms seen in the data are added).
        moments: :meth:`storage.Storage.moments` rows of this server (binned or not).
        versions: every recorded policy version of the server (those after ``until`` are
            ignored; those before ``since`` only decide the table in effect).
        events: the server's events in the window.
        buckets: the buckets to report (the daemon's defaults when None).
        bin_s, origin: the binning ``moments`` used (for the time axis).
        always: the always-speculate arm to compare with; :func:`always_arm` when None.
    """
    buckets = buckets or Buckets()
    per_bucket: dict[int, dict[int, _Acc]] = defaultdict(lambda: defaultdict(_Acc))
    per_bk: dict[tuple[int, int], _Acc] = defaultdict(_Acc)
    per_bin: dict[tuple[int, int | None], _Acc] = defaultdict(_Acc)
    total = _Acc()
    span: tuple[float, float] | None = None
    seen_arms: set[int] = set()
    for m in moments:
        seen_arms.add(m.k)
        per_bucket[buckets.index(m.b)][m.k].add(m)
        per_bk[(m.b, m.k)].add(m)
        per_bin[(m.bin, m.k)].add(m)
        per_bin[(m.bin, None)].add(m)
        total.add(m)
        span = (
            (m.first_ts, m.last_ts)
            if span is None
            else (min(span[0], m.first_ts), max(span[1], m.last_ts))
        )
    all_arms = tuple(sorted(set(arms) | seen_arms))
    always_k = always if always is not None else always_arm(all_arms)

    all_versions = [
        VersionEntry(v.ts, v.version, tuple(v.table), v.policy, v.reason, v.outcome)
        for v in versions
        if until is None or v.ts < until
    ]
    table = _in_effect(all_versions)
    window_versions = tuple(v for v in all_versions if since is None or v.ts >= since)

    bucket_reports: list[BucketReport] = []
    for i in range(len(buckets)):
        low, high = buckets.bounds(i)
        accs = per_bucket.get(i, {})
        steps = sum(a.steps for a in accs.values())
        b_ref = sum(a.req_steps for a in accs.values()) / steps if steps else math.nan
        stats = tuple(_arm_stat(k, accs[k], b_ref) for k in sorted(accs))
        ranked = [a for a in stats if a.goodput > 0]
        best = max(ranked, key=lambda a: (a.goodput, -a.arm)).arm if ranked else None
        if table is not None:
            chosen: int | None = _table_arm(table.table, high if high is not None else low)
        else:
            chosen = best
        cs = next((a for a in stats if a.arm == chosen), None)
        bucket_reports.append(
            BucketReport(
                index=i,
                label=buckets.label(i),
                low=low,
                high=high,
                b_ref=b_ref,
                arms=stats,
                chosen=chosen,
                best=best,
                gain_vs_off=_gain(cs, next((a for a in stats if a.arm == 0), None)),
                gain_vs_always=_gain(cs, next((a for a in stats if a.arm == always_k), None)),
            )
        )
    curve = tuple(
        CurvePoint(b, k, acc.emitted / acc.busy, acc.steps)
        for (b, k), acc in sorted(per_bk.items())
        if acc.busy > 0
    )
    timeline = tuple(
        TimePoint(origin + bin_ * (bin_s or 0.0), k, acc.emitted / acc.busy, acc.steps)
        for (bin_, k), acc in sorted(per_bin.items(), key=lambda kv: (kv[0][0], _k_key(kv[0][1])))
        if acc.busy > 0
    )
    event_entries = tuple(EventEntry(e.ts, e.kind, e.detail) for e in events)
    rejected_versions = sum(1 for v in window_versions if v.outcome == "rejected")
    rejected_events = sum(1 for e in event_entries if e.kind == "update_rejected")
    counts = {
        "pushes": sum(1 for v in window_versions if v.outcome == "applied"),
        # The daemon may record a refusal as a version outcome, an event, or both.
        "rejected_updates": max(rejected_versions, rejected_events),
        "outages": sum(1 for e in event_entries if e.kind == "outage"),
        "restarts": sum(1 for e in event_entries if e.kind == "restart"),
    }
    return ServerReport(
        server=server,
        arms=all_arms,
        always_arm=always_k,
        observations=total.rows,
        decode_steps=total.steps,
        data_span=span,
        table=table,
        chosen_from="policy" if table is not None else "data",
        crossover_b=_crossover(bucket_reports),
        buckets=tuple(bucket_reports),
        curve=curve,
        timeline=timeline,
        bin_s=bin_s,
        versions=window_versions,
        events=event_entries,
        counts=counts,
        metrics_only=any(e.kind == "plugin_missing" for e in event_entries),
    )


def _k_key(k: int | None) -> int:
    return -1 if k is None else k


def build_report(
    storage: Storage,
    *,
    server: str | None = None,
    since: float | None = None,
    until: float | None = None,
    buckets: Buckets | None = None,
    always: int | None = None,
    time_bins: int = DEFAULT_TIME_BINS,
    now: float | None = None,
) -> Report:
    """Read what the report needs from ``storage`` and summarise it.

    Args:
        storage: an open :class:`storage.Storage` (read-only is enough).
        server: one server's address; all servers when None.
        since, until: the window ``[since, until)`` in epoch seconds (open ends when None).
        buckets: buckets to report; the daemon's defaults when None.
        always: the always-speculate arm to compare with (per server default otherwise).
        time_bins: points on the goodput-over-time axis.
        now: the report's time stamp (``time.time()`` when None).

    Raises:
        ConfigError: ``server`` is not in the database.
        StorageError: the database cannot be read.
    """
    if time_bins < 1:
        raise ValueError(f"time_bins must be >= 1, got {time_bins}")
    buckets = buckets or Buckets()
    records = {r.address: r for r in storage.servers()}
    if server is not None and server not in records:
        known = ", ".join(sorted(records)) or "none"
        raise ConfigError(f"--server {server}: not in {storage.url} (servers there: {known})")
    span = storage.observation_span(server=server, since=since, until=until)
    bin_s: float | None = None
    origin = 0.0
    if span is not None:
        origin = since if since is not None else span[0]
        end = span[1] if until is None else min(until, max(span[1], origin))
        bin_s = max((end - origin) / time_bins, 1e-3) * (1 + 1e-9)  # last row in the last bin
    moments = storage.moments(server=server, since=since, until=until, bin_s=bin_s, origin=origin)
    by_server: dict[str, list[ObservationMoments]] = defaultdict(list)
    for m in moments:
        by_server[m.server].append(m)
    names = [server] if server is not None else sorted(records)
    reports = []
    for name in names:
        rec: ServerRecord = records[name]
        reports.append(replace(
            summarize(
                server=name,
                arms=rec.arms,
                moments=by_server.get(name, ()),
                versions=storage.policy_versions(server=name),
                events=storage.events(server=name, kinds=REPORT_EVENT_KINDS, since=since),
                buckets=buckets,
                since=since,
                until=until,
                bin_s=bin_s,
                origin=origin,
                always=always,
            ),
            model=rec.model,
        ))
        from tuner.report_gain import server_gains  # "does it pay?": its own module

        reports[-1] = replace(reports[-1], gains=server_gains(
            storage, reports[-1], buckets, since=since, until=until))
    return Report(
        generated_at=time.time() if now is None else now,
        database=storage.url,
        since=since,
        until=until,
        bucket_edges=buckets.edges,
        servers=tuple(reports),
    )


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
            f"({s.table.policy}): {_table_str(s.table.table)}", width))
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
    vs_always = f"vs k{s.always_arm}" if s.always_arm is not None else "vs always"
    out.append("")
    out.append(
        f"{'bucket':<9} {'arm':<5} {'goodput':>9} {'95% interval':>21} {'steps':>11} "
        f"{'intvls':>7} {'acc/step':>8} {'acc rate':>8}  {'':<4}"
    )
    out.append(f"{'':<9} {'':<5} {'tok/s':>9}")
    any_rows = False
    for bk in s.buckets:
        if not bk.arms:
            continue  # no data: its arm is in the table above
        any_rows = True
        head = (
            f"{bk.label:<9} chosen k{bk.chosen if bk.chosen is not None else '-'}"
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
    if s.versions:
        shown = s.versions[-_TEXT_VERSIONS:]
        out.append("")
        out.append(f"policy versions ({len(shown)} latest of {len(s.versions)} in the window)")
        for v in shown:
            line = (
                f"  v{v.version:<5} {_iso(v.ts)} {v.outcome:<8} {_table_str(v.table)}"
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


# --- JSON ---------------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 4) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


def _table_json(table: Sequence[tuple[int | None, int]]) -> list[list[int | None]]:
    return [[b, k] for b, k in table]


def _version_json(v: VersionEntry) -> dict[str, Any]:
    return {
        "ts": _f(v.ts, 3),
        "version": v.version,
        "table": _table_json(v.table),
        "policy": v.policy,
        "reason": v.reason,
        "outcome": v.outcome,
    }


def report_to_json(report: Report) -> dict[str, Any]:
    """The report as plain JSON-able data, schema ``dynspec-report/1`` (README: ``report``).

    Keys never disappear: a value that is unknown is ``null``. New keys may be added
    within the same schema version; a change of meaning bumps it.
    """
    return {
        "schema": REPORT_SCHEMA,
        "generated_at": _f(report.generated_at, 3),
        "database": report.database,
        "window": {"since": _f(report.since, 3), "until": _f(report.until, 3)},
        "bucket_edges": list(report.bucket_edges),
        "servers": [_server_json(s) for s in report.servers],
    }


def _server_json(s: ServerReport) -> dict[str, Any]:
    return {
        "server": s.server,
        "model": s.model,
        "arms": list(s.arms),
        "always_arm": s.always_arm,
        "observations": s.observations,
        "decode_steps": s.decode_steps,
        "data_span": None if s.data_span is None else [_f(s.data_span[0], 3),
                                                         _f(s.data_span[1], 3)],
        "table": None if s.table is None else _version_json(s.table),
        "chosen_from": s.chosen_from,
        "metrics_only": s.metrics_only,
        "crossover_b": s.crossover_b,
        "counts": dict(s.counts),
        "gains": _gains_json(s),
        "buckets": [
            {
                "bucket": bk.index,
                "label": bk.label,
                "low": bk.low,
                "high": bk.high,
                "b_ref": _f(bk.b_ref, 3),
                "chosen": bk.chosen,
                "best": bk.best,
                "gain_vs_k0": _f(bk.gain_vs_off),
                "gain_vs_always": _f(bk.gain_vs_always),
                "arms": [
                    {
                        "arm": a.arm,
                        "goodput": _f(a.goodput, 3),
                        "ci95": None if a.ci_low is None else [_f(a.ci_low, 3),
                                                               _f(a.ci_high, 3)],
                        "decode_steps": a.decode_steps,
                        "intervals": a.intervals,
                        "busy_s": _f(a.busy_s, 6),
                        "emitted_tokens": a.emitted_tokens,
                        "raw_goodput": _f(a.raw_goodput, 3),
                        "mean_b": _f(a.mean_b, 3),
                        "accepted_per_step": _f(a.accepted_per_step),
                        "acceptance_rate": _f(a.acceptance_rate),
                    }
                    for a in bk.arms
                ],
            }
            for bk in s.buckets
        ],
        "goodput_by_batch_size": [
            {"b": p.b, "k": p.k, "goodput": _f(p.goodput, 3), "decode_steps": p.decode_steps}
            for p in s.curve
        ],
        "timeline": {
            "bin_s": _f(s.bin_s, 3),
            "points": [
                {"t": _f(p.t, 3), "k": p.k, "goodput": _f(p.goodput, 3),
                 "decode_steps": p.decode_steps}
                for p in s.timeline
            ],
        },
        "versions": [_version_json(v) for v in s.versions],
        "events": [{"ts": _f(e.ts, 3), "kind": e.kind, "detail": e.detail} for e in s.events],
        "plots": dict(s.plots),
    }


def _gains_json(s: ServerReport) -> list[dict[str, Any]]:
    from tuner.report_gain import gains_json

    return gains_json(s.gains)


def render_json(report: Report) -> str:
    return json.dumps(report_to_json(report), indent=2, sort_keys=False) + "\n"


# --- plots --------------------------------------------------------------------------------------

PLOT_NAMES = ("goodput-vs-batch", "chosen-arm-over-time", "goodput-over-time")


def make_plots(s: ServerReport) -> dict[str, bytes]:
    """The three PNG plots of one server (matplotlib, Agg backend, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def png(fig: Figure) -> bytes:
        FigureCanvasAgg(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return buf.getvalue()

    arms = sorted({p.k for p in s.curve} | set(s.arms))
    colors = {k: f"C{i % 10}" for i, k in enumerate(arms)}
    out: dict[str, bytes] = {}

    # 1. goodput vs batch size per arm, learned decisions and crossover marked.
    # Fixed margins instead of a layout engine: constrained layout draws every figure twice.
    fig = Figure(figsize=(9, 5))
    fig.subplots_adjust(left=0.09, right=0.86, bottom=0.11, top=0.92)
    ax = fig.add_subplot()
    for k in arms:
        pts = [p for p in s.curve if p.k == k]
        if pts:
            ax.plot([p.b for p in pts], [p.goodput for p in pts], marker="o", ms=3,
                    color=colors[k], label=f"k={k}")
    if s.curve:
        ax.set_xscale("log", base=2)
        top = max(p.goodput for p in s.curve)
        prev = None
        for bk in s.buckets:
            if bk.chosen is None:
                continue
            if prev is not None and bk.chosen != prev:
                ax.axvline(bk.low - 0.5, color="0.6", lw=0.8, ls=":")
            prev = bk.chosen
            hi = bk.high if bk.high is not None else max(p.b for p in s.curve)
            if bk.arms and hi >= bk.low:
                mid = math.sqrt(bk.low * max(hi, bk.low))
                ax.text(mid, top * 1.02, f"k{bk.chosen}", ha="center", va="bottom", fontsize=7,
                        color=colors.get(bk.chosen, "k"))
        if s.crossover_b is not None:
            ax.axvline(s.crossover_b - 0.5, color="crimson", lw=1.5)
            ax.axvspan(s.crossover_b - 0.5, max(p.b for p in s.curve) * 1.5,
                       color="crimson", alpha=0.06)
            ax.text(s.crossover_b, top * 0.05, f" speculation off from b={s.crossover_b}",
                    color="crimson", fontsize=8)
        ax.set_ylim(0, top * 1.12)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    else:
        ax.text(0.5, 0.5, "no observations", ha="center", transform=ax.transAxes)
    ax.set_xlabel("batch size (running requests)")
    ax.set_ylabel("goodput (emitted tokens / busy s)")
    ax.set_title(f"{s.server}: goodput vs batch size per arm (labels: learned arm per bucket)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    out["goodput-vs-batch"] = png(fig)

    # 2. chosen arm per bucket over time, from the recorded tables.
    fig = Figure(figsize=(9, 4))
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.13, top=0.91)
    ax = fig.add_subplot()
    applied = [v for v in s.versions if v.outcome in ("applied", "dry_run")]
    if s.table is not None and (not applied or s.table.ts < applied[0].ts):
        applied.insert(0, s.table)
    if applied:
        import numpy as np
        from matplotlib.colors import BoundaryNorm, ListedColormap

        end = max(v.ts for v in applied)
        if s.data_span is not None:
            end = max(end, s.data_span[1])
        times = [v.ts for v in applied] + [end if end > applied[-1].ts else applied[-1].ts + 1]
        nb = len(s.buckets)
        grid = np.array([
            [_table_arm(v.table, bk.high if bk.high is not None else bk.low) for v in applied]
            for bk in s.buckets
        ], dtype=float)
        cmap = ListedColormap([colors.get(k, "0.5") for k in arms])
        norm = BoundaryNorm([a - 0.5 for a in arms] + [arms[-1] + 0.5], cmap.N)
        t0 = times[0]
        x = [(t - t0) / 60.0 for t in times]
        mesh = ax.pcolormesh(x, np.arange(nb + 1), grid, cmap=cmap, norm=norm, shading="flat")
        cbar = fig.colorbar(mesh, ax=ax, ticks=arms)
        cbar.set_label("arm k")
        ax.set_yticks(np.arange(nb) + 0.5)
        ax.set_yticklabels([bk.label for bk in s.buckets], fontsize=7)
        ax.set_xlabel(f"minutes since {_iso(t0)}")
        ax.set_ylabel("batch-size bucket")
    else:
        ax.text(0.5, 0.5, "no policy versions recorded", ha="center", transform=ax.transAxes)
    ax.set_title(f"{s.server}: chosen arm per bucket over time", fontsize=10)
    out["chosen-arm-over-time"] = png(fig)

    # 3. goodput over time (all arms together, and per arm).
    fig = Figure(figsize=(9, 4))
    fig.subplots_adjust(left=0.09, right=0.86, bottom=0.13, top=0.91)
    ax = fig.add_subplot()
    if s.timeline:
        t0 = min(p.t for p in s.timeline)
        half = (s.bin_s or 0.0) / 2
        allp = [p for p in s.timeline if p.k is None]
        ax.plot([(p.t + half - t0) / 60 for p in allp], [p.goodput for p in allp], color="k",
                lw=2, label="all arms")
        for k in arms:
            pts = [p for p in s.timeline if p.k == k]
            if pts:
                # Markers only: an arm runs in some bins and not others; a line would
                # draw goodput where the arm never ran.
                ax.plot([(p.t + half - t0) / 60 for p in pts], [p.goodput for p in pts],
                        color=colors[k], ls="none", marker="o", ms=3, label=f"k={k}")
        ax.set_xlabel(f"minutes since {_iso(t0)}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.set_ylim(bottom=0)
    else:
        ax.text(0.5, 0.5, "no observations", ha="center", transform=ax.transAxes)
    ax.set_ylabel("goodput (tokens / busy s)")
    ax.set_title(f"{s.server}: goodput over time", fontsize=10)
    ax.grid(alpha=0.3)
    out["goodput-over-time"] = png(fig)
    return out


# --- HTML ---------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{padding:2px 8px;text-align:right}
th{background:#eee}td.l,th.l{text-align:left}tr.bucket td{border-top:1px solid #bbb}
.chosen{font-weight:bold}.muted{color:#777}img{max-width:100%;display:block;margin:1em 0}
"""


def render_html(report: Report, plots: dict[str, dict[str, bytes]] | None = None) -> str:
    """A self-contained HTML page; ``plots`` (server -> name -> PNG) are embedded as base64."""
    e = html.escape
    plots = plots or {}
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>dynspec-tuner report {e(_iso(report.generated_at))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>dynspec-tuner report</h1>",
        f"<p class='muted'>generated {e(_iso(report.generated_at))} &middot; database "
        f"{e(report.database)} &middot; window {e(_iso(report.since))} .. "
        f"{e(_iso(report.until) if report.until else 'now')}</p>",
    ]
    if not report.servers:
        parts.append("<p>No servers recorded in this database.</p>")
    for s in report.servers:
        model = f" <small>{e(s.model)}</small>" if s.model else ""
        parts.append(f"<h2>{e(s.server)}{model}</h2>")
        parts.append(
            f"<p>arms {e(', '.join(map(str, s.arms)))} &middot; always-speculate arm "
            f"{'k' + str(s.always_arm) if s.always_arm is not None else '-'} &middot; "
            f"{s.observations:,} observations, {s.decode_steps:,} decode steps</p>"
        )
        if s.table is not None:
            parts.append(
                f"<p>Table in effect: <b>v{s.table.version}</b> ({e(s.table.policy)}, "
                f"{e(s.table.outcome)} {e(_iso(s.table.ts))}): "
                f"<code>{e(_table_str(s.table.table))}</code></p>"
            )
        if s.metrics_only:
            parts.append("<p>Metrics-only mode (no dynspec plugin): coarse per-interval "
                         "observations of the arm the server ran; nothing was pushed.</p>")
        if s.crossover_b is not None:
            parts.append(
                f"<p><b>Speculation stops paying from batch size {s.crossover_b}.</b></p>"
            )
        c = s.counts
        parts.append(
            f"<p>pushes {c['pushes']} &middot; rejected updates {c['rejected_updates']} "
            f"&middot; outages {c['outages']} &middot; restarts {c['restarts']}</p>"
        )
        from tuner.report_gain import gain_lines

        parts.extend(f"<p>{html.escape(line)}</p>" for line in gain_lines(s.gains))
        for name in PLOT_NAMES:
            data = plots.get(s.server, {}).get(name)
            if data is not None:
                b64 = base64.b64encode(data).decode()
                parts.append(f"<img alt='{e(name)}' src='data:image/png;base64,{b64}'>")
        always = f"k{s.always_arm}" if s.always_arm is not None else "always"
        parts.append(
            "<table><tr><th class='l'>bucket</th><th>chosen</th><th>best</th><th>b_ref</th>"
            f"<th>vs k0</th><th>vs {e(always)}</th><th class='l'>arm</th><th>goodput tok/s</th>"
            "<th>95% interval</th><th>steps</th><th>intervals</th><th>acc/step</th>"
            "<th>acc rate</th></tr>"
        )
        for bk in s.buckets:
            if not bk.arms:
                continue
            for j, a in enumerate(bk.arms):
                cls = " class='chosen'" if a.arm == bk.chosen else ""
                lead = (
                    f"<td class='l'>{e(bk.label)}</td><td>k{bk.chosen}</td><td>k{bk.best}</td>"
                    f"<td>{_num(bk.b_ref, 0).strip()}</td><td>{_pct(bk.gain_vs_off)}</td>"
                    f"<td>{_pct(bk.gain_vs_always)}</td>"
                    if j == 0
                    else "<td></td>" * 6
                )
                ci = (
                    f"{_num(a.ci_low, 0).strip()} – {_num(a.ci_high, 0).strip()}"
                    if a.ci_low is not None
                    else "-"
                )
                rate = "-" if a.acceptance_rate is None else f"{a.acceptance_rate * 100:.1f}%"
                parts.append(
                    f"<tr{' class=bucket' if j == 0 else ''}>{lead}<td class='l'>"
                    f"<span{cls}>k{a.arm}</span></td><td>{_num(a.goodput, 0).strip()}</td>"
                    f"<td>{ci}</td><td>{a.decode_steps:,}</td><td>{a.intervals:,}</td>"
                    f"<td>{_num(a.accepted_per_step, 0, 2).strip()}</td><td>{rate}</td></tr>"
                )
        parts.append("</table>")
        if s.versions:
            parts.append("<h3>Policy versions</h3><table><tr><th>version</th><th class='l'>"
                         "time</th><th class='l'>outcome</th><th class='l'>table</th>"
                         "<th class='l'>policy: reason</th></tr>")
            for v in s.versions:
                parts.append(
                    f"<tr><td>v{v.version}</td><td class='l'>{e(_iso(v.ts))}</td>"
                    f"<td class='l'>{e(v.outcome)}</td><td class='l'><code>"
                    f"{e(_table_str(v.table))}</code></td><td class='l'>{e(v.policy)}: "
                    f"{e(v.reason)}</td></tr>"
                )
            parts.append("</table>")
        if s.events:
            parts.append("<h3>Events</h3><table><tr><th class='l'>time</th><th class='l'>kind"
                         "</th><th class='l'>detail</th></tr>")
            for ev in s.events:
                parts.append(
                    f"<tr><td class='l'>{e(_iso(ev.ts))}</td><td class='l'>{e(ev.kind)}</td>"
                    f"<td class='l'>{e(ev.detail)}</td></tr>"
                )
            parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


# --- writing ------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "server"


def write_report(
    report: Report, *, fmt: str, out: Path | None, plots: bool = True
) -> tuple[str | None, list[Path]]:
    """Render ``report``; write it (and the plots) when ``out`` is given.

    HTML embeds the plots. Text and JSON written to ``out`` get the plots as PNG files
    beside it (``<out stem>-<server>-<plot>.png``), listed in the report. Without ``out``
    nothing is written and the rendered text is returned for the caller to print.

    Returns:
        ``(rendered text or None when written, files written)``.

    Raises:
        ConfigError: unknown format, or ``out`` cannot be written (named).
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if out is not None:
        from tuner.outfiles import check_out

        out = check_out(out)
    written: list[Path] = []
    pngs: dict[str, dict[str, bytes]] = {}
    if plots and (fmt == "html" or out is not None):
        pngs = {s.server: make_plots(s) for s in report.servers}
    if fmt != "html" and out is not None and pngs:
        servers = []
        for s in report.servers:
            files = {}
            for name, data in pngs[s.server].items():
                path = out.with_name(f"{out.stem}-{_slug(s.server)}-{name}.png")
                _write_bytes(path, data)
                written.append(path)
                files[name] = str(path)
            servers.append(_with_plots(s, files))
        report = Report(report.generated_at, report.database, report.since, report.until,
                        report.bucket_edges, tuple(servers))
    if fmt == "text":
        body = render_text(report)
    elif fmt == "json":
        body = render_json(report)
    else:
        body = render_html(report, pngs)
    if out is None:
        return body, written
    _write_bytes(out, body.encode())
    written.insert(0, out)
    return None, written


def _with_plots(s: ServerReport, files: dict[str, str]) -> ServerReport:
    return replace(s, plots=files)


def _write_bytes(path: Path, data: bytes) -> None:
    try:
        write_atomic(path, data, parents=False)  # tuner.outfiles: folders are never created
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write: {exc.strerror or exc}") from exc

"""From the history to a :class:`Report`: inputs (``--since``, the database), the pure
fold of stored sums (:func:`summarize`) and :func:`build_report`."""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from policies import Buckets
from tuner.errors import ConfigError
from tuner.gain import ArmValue, as_ran
from tuner.report._model import (
    DEFAULT_TIME_BINS,
    REPORT_EVENT_KINDS,
    ArmStat,
    BucketReport,
    CurvePoint,
    EventEntry,
    Report,
    ServerReport,
    TimePoint,
    VersionEntry,
    _t975,
)
from tuner.protocol import sglang_start_arm

if TYPE_CHECKING:
    from storage import EventRecord, ObservationMoments, PolicyVersionRecord, ServerRecord, Storage


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
    positive = sorted(a for a in set(arms) if a > 0)
    if not positive:
        return None
    pick = sglang_start_arm(arms)
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


def _as_ran(stats: Sequence[ArmStat]) -> ArmStat | None:
    """A banded row's arms together as it ran (:func:`tuner.gain.as_ran`), as an arm."""
    ran = as_ran((a.busy_s, ArmValue(a.goodput, 0.0, True)) for a in stats
                 if math.isfinite(a.goodput))
    return None if ran is None else replace(stats[0], arm=-1, goodput=ran.goodput,
                                            ci_low=None, ci_high=None)


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
        VersionEntry(v.ts, v.version, tuple(v.table), v.policy, v.reason, v.outcome, v.bands)
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
        off = next((a for a in stats if a.arm == 0), None)
        vs_always = _gain(cs, next((a for a in stats if a.arm == always_k), None))
        if table is not None and table.bands is not None:
            # A banded row's arms each ran only in the bands that chose them: the row is
            # valued as it ran, and only against k = 0, whose goodput no band selects.
            cs, vs_always = _as_ran(stats), None
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
                gain_vs_off=_gain(cs, off),
                gain_vs_always=vs_always,
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

        from tuner.report_switchback import server_switchback  # measured: run --holdout

        reports[-1] = replace(reports[-1], gains=server_gains(
            storage, reports[-1], buckets, since=since, until=until,
            moments=by_server.get(name, ())),
            switchback=server_switchback(storage, name, since=since, until=until))
    return Report(
        generated_at=time.time() if now is None else now,
        database=storage.url,
        since=since,
        until=until,
        bucket_edges=buckets.edges,
        servers=tuple(reports),
    )

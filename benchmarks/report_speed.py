"""How long `dynspec-tuner report` takes on a large history (target: 1 M observations <= 5 s).

Builds a SQLite history with N observations (default 1,000,000) of one server over a day,
plus a policy version every 30 s and a few events, by bulk insert through Storage.record_tick.
Then times, in the same run:

- baselines: ``SELECT COUNT(*)``, one full pass over the observations
  (``SELECT SUM(emitted_tokens), SUM(busy_s)``), the least any report can cost, and the
  grouped query ``Storage.moments`` ran on SQLite before its covering index (sums and
  squares ``GROUP BY server, time bin, b, k``, all rows through SQLite's sorter);
- the report: ``build_report`` (the time-binned sums and squares, the fold, versions,
  events, the gains) and each renderer, plots included (what ``report --format html``
  does), with ``Storage.moments`` alone beside it.

Usage: .venv/bin/python benchmarks/report_speed.py [--rows N] [--db PATH] [--keep]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import create_engine, text

from storage import EventRecord, ObservationRecord, PolicyVersionRecord, ServerSeen, Storage
from tuner.report import build_report, make_plots, render_html, render_json, render_text
from tuner.report._model import DEFAULT_TIME_BINS

SERVER = "10.0.0.7:30000"
ARMS = (0, 1, 3, 5)
TARGET_S = 5.0
DAY_S = 86_400.0
BATCH_SIZES = tuple(range(1, 9)) + tuple(range(10, 33, 2)) + tuple(range(40, 65, 4))


def build(url: str, rows: int, *, seed: int = 0) -> float:
    rng = random.Random(seed)
    t0 = 1_764_400_000.0
    chunk = 100_000
    start = time.perf_counter()
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen(SERVER, ARMS, t0, t0)])
        done = 0
        while done < rows:
            n = min(chunk, rows - done)
            obs = []
            for i in range(done, done + n):
                b = rng.choice(BATCH_SIZES)
                k = rng.choice(ARMS)
                steps = rng.randint(20, 200)
                busy = steps * (0.008 + 0.0004 * b) * (1 + 0.15 * k)
                acc = int(steps * b * k * 0.55 * rng.uniform(0.8, 1.2))
                obs.append(ObservationRecord(SERVER, t0 + DAY_S * i / rows, b, k, steps,
                                             steps * b + acc, acc, steps * b * k, busy))
            st.record_tick(observations=obs)
            done += n
        versions = [
            PolicyVersionRecord(SERVER, t0 + 30.0 * v, v + 1,
                                ((8, rng.choice(ARMS)), (32, rng.choice(ARMS)), (None, 0)),
                                "thompson", "explore" if v % 3 else "greedy")
            for v in range(int(DAY_S // 30))
        ]
        events = [EventRecord(SERVER, t0 + 3600.0 * h, "outage", "connection refused")
                  for h in range(24)]
        st.record_tick(policy_versions=versions, events=events)
    return time.perf_counter() - start


CPU = {"s": 0.0}

# What Storage.moments ran on SQLite before it read the covering index (storage._binned).
_GROUPED = """
SELECT server_id, CAST((ts - :origin) / :bin_s + 1073741824 AS INTEGER) - 1073741824 AS bin,
       b, k, SUM(n_intervals), SUM(decode_steps), SUM(emitted_tokens), SUM(accepted_drafts),
       SUM(drafted_tokens), SUM(busy_s),
       SUM(COALESCE(emitted_sq, CAST(emitted_tokens AS REAL) * emitted_tokens)),
       SUM(COALESCE(emitted_busy, CAST(emitted_tokens AS REAL) * busy_s)),
       SUM(COALESCE(busy_sq, busy_s * busy_s)), MIN(ts), MAX(ts)
FROM observations NOT INDEXED GROUP BY server_id, bin, b, k
"""


def timed(fn):  # -> (wall seconds, result); CPU seconds add up in CPU["s"]
    cpu, start = time.process_time(), time.perf_counter()
    out = fn()
    CPU["s"] += time.process_time() - cpu
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--db", type=Path, help="reuse/keep this SQLite file")
    ap.add_argument("--keep", action="store_true", help="keep the temporary database")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="dynspec-bench-"))
    path = args.db or tmp / "history.db"
    url = f"sqlite:///{path}"
    if not path.exists():
        secs = build(url, args.rows)
        print(f"built {args.rows:,} observations in {secs:.1f} s ({path})")

    engine = create_engine(url)
    with engine.connect() as c:
        # Warm the page cache once so every timing below reads from memory alike.
        c.execute(text("SELECT SUM(emitted_tokens) FROM observations")).scalar()
        t_count, n = timed(lambda: c.execute(text("SELECT COUNT(*) FROM observations")).scalar())
        t_scan, _ = timed(lambda: c.execute(
            text("SELECT SUM(emitted_tokens), SUM(busy_s) FROM observations")).first())
        first, last = c.execute(text("SELECT MIN(ts), MAX(ts) FROM observations")).first()
        t_grouped, groups = timed(lambda: c.execute(text(_GROUPED), {
            "origin": first, "bin_s": (last - first) / DEFAULT_TIME_BINS * (1 + 1e-9),
        }).all())
    engine.dispose()

    CPU["s"] = 0.0
    with Storage(url, read_only=True) as st:
        t_build, report = timed(lambda: build_report(st))
        cpu_report = CPU["s"]
        span = st.observation_span()
        assert span is not None
        t_moments, moments = timed(lambda: st.moments(
            bin_s=(span[1] - span[0]) / DEFAULT_TIME_BINS * (1 + 1e-9), origin=span[0]))
        assert len(moments) == len(groups), (len(moments), len(groups))
    CPU["s"] = cpu_report
    (s,) = report.servers
    assert s.observations == n, (s.observations, n)
    t_text, _ = timed(lambda: render_text(report))
    t_json, _ = timed(lambda: render_json(report))
    t_plots, plots = timed(lambda: {x.server: make_plots(x) for x in report.servers})
    t_html, _ = timed(lambda: render_html(report, plots))
    total = t_build + t_plots + t_html
    cpu = CPU["s"]

    print(f"observations: {n:,}   versions: {len(s.versions):,}   events: {len(s.events)}   "
          f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"baseline COUNT(*):                 {t_count:7.3f} s")
    print(f"baseline one full scan (2 SUMs):   {t_scan:7.3f} s")
    print(f"baseline grouped query (sorted):   {t_grouped:7.3f} s  = {t_grouped / t_scan:5.1f} x "
          "the full scan")
    print(f"build_report (SQL + fold + gains): {t_build:7.3f} s  = {t_build / t_scan:5.1f} x "
          "the full scan")
    print(f"  Storage.moments alone:           {t_moments:7.3f} s  = {t_moments / t_scan:5.1f} x "
          f"the full scan, {t_moments / t_grouped:.2f} x the grouped query")
    print(f"render text / json:                {t_text:7.3f} s / {t_json:.3f} s")
    print(f"plots (3 PNG) + html:              {t_plots + t_html:7.3f} s")
    print(f"report --format html end to end:   {total:7.3f} s  = {total / t_scan:5.1f} x the "
          f"full scan; target <= {TARGET_S:g} s: {'ok' if total <= TARGET_S else 'MISSED'}")
    print(f"  (CPU time of this process for the report: {cpu:.3f} s; wall time above also "
          "counts waiting for a shared CPU)")
    if args.db is None and not args.keep:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return 0 if total <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())

"""One daemon, 8 simulated servers, 1 Hz: tick latency (p50/p99/max) and CPU, with its history
in SQLite and in PostgreSQL, against a baseline measured in the same run.

The servers run in a child process (8 simulated SGLang servers on loopback, real time, a
concurrency sweep so every tick brings new counters), so the CPU measured here is the
daemon's alone. Rows, each over the same window:

- ``baseline``: a bare poller, 8 parallel ``GET /server_info`` per tick (one httpx client per
  server, nothing parsed or kept) — the least any fleet poller pays;
- ``memory``: the daemon without a history (reading, deltas, policy, pushes);
- ``sqlite``: the daemon with an SQLite history (WAL) and ``--pool`` live pooling;
- ``postgres``: the same on PostgreSQL (``--pg URL`` or ``DYNSPEC_TEST_POSTGRES_URL``;
  skipped, and said so, when neither is given).

A tick's latency is the wall time of ``Daemon.run_once()`` (read all 8 in parallel, learn,
decide and push, write one transaction); CPU is this process's user+system time over the
window, as a percentage of one core.

    .venv/bin/python benchmarks/fleet_ticks.py [--seconds 30] [--servers 8] [--pg URL]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage import Storage  # noqa: E402
from tuner.config import TunerConfig  # noqa: E402
from tuner.daemon import Daemon  # noqa: E402

SERVE = """
import sys, threading
from tuner.sim.server import SimServer
n = int(sys.argv[1])
sims = [SimServer(load="loop:1:2,1:8,1:32", speed=1.0, seed=i).start()
        for i in range(n)]
print(" ".join(str(s.port) for s in sims), flush=True)
sys.stdin.read()  # until the parent closes our stdin
for s in sims:
    s.stop()
"""


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def at_1hz(seconds: float, tick) -> tuple[list[float], float]:
    """Call ``tick`` once a second for ``seconds``; -> (latencies in s, cpu % of one core)."""
    lat: list[float] = []
    cpu0, t0 = time.process_time(), time.monotonic()
    next_t = t0
    while time.monotonic() - t0 < seconds:
        start = time.perf_counter()
        tick()
        lat.append(time.perf_counter() - start)
        next_t += 1.0
        time.sleep(max(0.0, next_t - time.monotonic()))
    wall = time.monotonic() - t0
    return lat, 100.0 * (time.process_time() - cpu0) / wall


def run_baseline(addrs: list[str], seconds: float) -> tuple[list[float], float]:
    clients = [httpx.Client(base_url=f"http://{a}", timeout=5.0) for a in addrs]
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        def tick() -> None:
            list(pool.map(lambda c: c.get("/server_info").content, clients))

        tick()  # connections up before measuring
        try:
            return at_1hz(seconds, tick)
        finally:
            for c in clients:
                c.close()


def run_daemon(addrs: list[str], url: str | None, seconds: float,
               pool: str | None = None) -> tuple[list[float], float]:
    config = TunerConfig(servers=tuple(addrs), db_url=url or "sqlite:///unused.db",
                         interval_s=1.0, decision_period_s=2.0, pool=pool)
    storage = Storage(url) if url else None
    before = storage.count_observations() if storage is not None else 0
    d = Daemon(config, storage=storage)
    try:
        d.run_once()  # first readings (baselines) and warm starts, outside the window
        return at_1hz(seconds, d.run_once)
    finally:
        d.shutdown()
        if storage is not None:
            rows = storage.count_observations() - before
            storage.close()
            print(f"  ({rows} observations stored)", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="window per row (default 30)")
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--pg", default=os.environ.get("DYNSPEC_TEST_POSTGRES_URL"),
                    help="PostgreSQL URL (default $DYNSPEC_TEST_POSTGRES_URL)")
    args = ap.parse_args()
    child = subprocess.Popen([sys.executable, "-c", SERVE, str(args.servers)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    results: dict[str, tuple[list[float], float]] = {}
    pg_schema = pg_admin = None
    try:
        ports = child.stdout.readline().split()
        if len(ports) != args.servers:
            raise SystemExit("the simulated servers did not start")
        addrs = [f"127.0.0.1:{p}" for p in ports]
        with tempfile.TemporaryDirectory() as tmp:
            runs: list[tuple[str, str | None, str | None]] = [
                ("memory", None, None),
                ("sqlite", f"sqlite:///{tmp}/h.db", None),
                ("sqlite+pool", f"sqlite:///{tmp}/p.db", "bench"),
            ]
            if args.pg:
                from sqlalchemy import create_engine, text

                pg_schema = f"bench_{uuid.uuid4().hex[:10]}"
                pg_admin = create_engine(args.pg)
                with pg_admin.begin() as c:
                    c.execute(text(f"CREATE SCHEMA {pg_schema}"))
                sep = "&" if "?" in args.pg else "?"
                pg = f"{args.pg}{sep}options=-csearch_path%3D{pg_schema}"
                runs += [("postgres", pg, None), ("postgres+pool", pg, "bench2")]
            print(f"baseline: {args.servers} servers x {args.seconds:g} s ...", file=sys.stderr)
            results["baseline"] = run_baseline(addrs, args.seconds)
            for name, url, pool in runs:
                print(f"{name}: {args.servers} servers x {args.seconds:g} s ...", file=sys.stderr)
                results[name] = run_daemon(addrs, url, args.seconds, pool)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        if pg_admin is not None:
            from sqlalchemy import text

            with pg_admin.begin() as c:
                c.execute(text(f"DROP SCHEMA {pg_schema} CASCADE"))
            pg_admin.dispose()

    base_lat, base_cpu = results["baseline"]
    base_p99 = percentile(base_lat, 99)
    print(f"\n{args.servers} simulated servers x 1 Hz, {args.seconds:g} s per row "
          f"({len(base_lat)} ticks); latency = one tick over all servers")
    print(f"{'history':<14}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'cpu %':>8}"
          f"{'p99 / base':>12}{'cpu / base':>12}")
    for name, (lat, cpu) in results.items():
        p99 = percentile(lat, 99)
        print(f"{name:<14}{1e3 * statistics.median(lat):9.1f}{1e3 * p99:9.1f}"
              f"{1e3 * max(lat):9.1f}{cpu:8.2f}{p99 / base_p99:12.1f}"
              f"{(cpu / base_cpu if base_cpu > 0 else float('nan')):12.1f}")
    if not args.pg:
        print("postgres: skipped (give --pg URL or set DYNSPEC_TEST_POSTGRES_URL)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

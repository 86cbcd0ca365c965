"""The daemon's own footprint at 1 Hz against one simulated server (target: <= 2 % of one core,
<= 150 MB RSS, over >= 60 s).

Three processes: a simulated SGLang server (``dynspec-tuner sim``, real time, a concurrency
sweep so counters keep moving), the daemon (``dynspec-tuner run`` with its SQLite history), and
a baseline — a bare loop that fetches ``/server_info`` once a second with httpx and does
nothing else, the least any poller pays. Both are measured with psutil over the same window,
after a warm-up, and the daemon is printed as a ratio to the baseline.

    .venv/bin/python benchmarks/daemon_overhead.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

BASELINE = """
import sys, time, httpx
url = sys.argv[1]
with httpx.Client(timeout=5) as c:
    while True:
        t = time.monotonic()
        c.get(url).json()
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def measure(procs: dict[str, psutil.Process], seconds: float) -> dict[str, tuple[float, float]]:
    """-> name: (cpu % of one core over the window, peak RSS MB)."""
    t0 = time.monotonic()
    cpu0 = {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    peak = {n: 0.0 for n in procs}
    while time.monotonic() - t0 < seconds:
        for n, p in procs.items():
            peak[n] = max(peak[n], p.memory_info().rss / 2**20)
        time.sleep(1.0)
    wall = time.monotonic() - t0
    return {
        n: (100.0 * (sum(p.cpu_times()[:2]) - cpu0[n]) / wall, peak[n]) for n, p in procs.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measurement window (>= 60)")
    ap.add_argument("--warmup", type=float, default=5.0)
    args = ap.parse_args()
    port = free_port()
    py = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    children: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            children.append(subprocess.Popen(
                [py, "-m", "tuner.cli", "sim", "--port", str(port), "--speed", "1",
                 "--load", "loop:10:1,10:8,10:32,10:64"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            wait_http(f"http://127.0.0.1:{port}/health")
            daemon = subprocess.Popen(
                [py, "-m", "tuner.cli", "run", "--server", f"127.0.0.1:{port}",
                 "--db", f"sqlite:///{tmp}/h.db", "--interval", "1"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            children.append(daemon)
            baseline = subprocess.Popen(
                [py, "-c", BASELINE, f"http://127.0.0.1:{port}/server_info"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            children.append(baseline)
            time.sleep(args.warmup)
            if daemon.poll() is not None:
                raise SystemExit(f"the daemon exited early with status {daemon.returncode}")
            res = measure(
                {"daemon": psutil.Process(daemon.pid), "baseline": psutil.Process(baseline.pid)},
                args.seconds,
            )
        finally:
            for c in reversed(children):
                c.terminate()
            for c in children:
                try:
                    c.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    c.kill()
        (d_cpu, d_rss), (b_cpu, b_rss) = res["daemon"], res["baseline"]
        print(f"window {args.seconds:.0f} s at 1 Hz against one simulated server")
        print(f"daemon:   cpu {d_cpu:5.2f} % of one core   peak rss {d_rss:6.1f} MB")
        print(f"baseline: cpu {b_cpu:5.2f} % of one core   peak rss {b_rss:6.1f} MB  "
              "(bare httpx poll of /server_info)")
        ratio_cpu = d_cpu / b_cpu if b_cpu > 0 else float("inf")
        print(f"ratio daemon/baseline: cpu x{ratio_cpu:.1f}, rss x{d_rss / b_rss:.1f}")
        ok = d_cpu <= 2.0 and d_rss <= 150.0
        print(f"target (<= 2 % cpu, <= 150 MB): {'met' if ok else 'NOT met'}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

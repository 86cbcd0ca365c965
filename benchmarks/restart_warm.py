"""What a daemon restart costs, by what the restarted policy is given back; in one run.

Each run is the bench's own ``run_one`` (engine, plugin core, the default policy fed band
and depth counters, the per-bucket oracle's scoring by expectation, so the luck of which
requests ran mostly cancels). At ``--restart`` simulated seconds the policy is replaced by a
fresh one (the same seed, as a restarted daemon's), which is first fed again what the old
one was fed, as a restarted daemon replays its history:

- ``none``: no restart (the ceiling);
- ``kept``: everything (schema v4: observations, band observations, depth counts);
- ``obs only``: the ``(b, k)`` observations alone (what a restart kept before schema v4);
- ``cold``: nothing (no history).

The load is one concurrency in three phases: up to the restart, its first ``--window``
seconds after, and the rest; each phase is scored whole (no warm-up), as % of the per-bucket
oracle. The seeds are not ones any constant was chosen on.

    .venv/bin/python benchmarks/restart_warm.py [--profiles seed-kimi-pcie h200-llama8b] \\
        [--workloads diverse chat] [--concurrency 1 4 16] [--seeds 21 22 23 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuner import bench  # noqa: E402
from tuner.bench_config import build_policy  # noqa: E402

BRANCHES = ("none", "kept", "obs only", "cold")
_FEEDS = {"kept": {"update", "update_bands", "update_depths"}, "obs only": {"update"},
          "cold": set()}


class Restarting:
    """A policy that, at its ``at``-th table, is replaced by a fresh one from ``make`` fed
    again the calls of ``feeds`` it had seen, in their order."""

    def __init__(self, make: Any, at: int, feeds: set[str] | None) -> None:
        self._make, self._at, self._feeds = make, at, feeds
        self._inner = make()
        self._log: list[tuple[str, tuple]] = []
        self._tables = 0
        self._bands: Any = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in ("update", "update_bands", "update_depths"):
            def logged(*args: Any) -> Any:
                self._log.append((name, args))
                return getattr(self._inner, name)(*args)
            return logged
        if name == "set_bands":
            def remember(edges: Any) -> Any:
                self._bands = edges
                return attr(edges)
            return remember
        if name in ("propose", "propose_bands"):
            def counted() -> Any:
                self._tables += 1
                if self._tables == self._at and self._feeds is not None:
                    self._restart()
                return getattr(self._inner, name)()
            return counted
        return attr

    def _restart(self) -> None:
        self._inner = self._make()
        if self._bands is not None:
            self._inner.set_bands(self._bands)
        for name, args in self._log:
            if name in self._feeds:
                getattr(self._inner, name)(*args)


def run(profile: str, workload: str, c: int, seed: int, branch: str,
        restart_s: float, window_s: float, after_s: float) -> list[float]:
    """% of the per-bucket oracle per phase: before, the window after, the rest."""
    decision = bench.DEFAULT_BENCH_DECISION_PERIOD_S
    at = round(restart_s / decision) + 1  # the first table is proposed at 0 s

    def restarting(*args: Any, **kwargs: Any) -> Restarting:
        return Restarting(lambda: build_policy(*args, **kwargs), at, _FEEDS.get(branch))

    load = f"{restart_s:g}:{c},{window_s:g}:{c},{after_s - window_s:g}:{c}"
    with mock.patch.object(bench, "build_policy", restarting):
        res = bench.run_one(profile=profile, workload=workload, load=load, policy="model",
                            seed=seed, warmup_s=0.0)
    return [p.pct_oracle for p in res.phases]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="+", default=["seed-kimi-pcie", "h200-llama8b"])
    ap.add_argument("--workloads", nargs="+", default=["diverse", "chat"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seeds", type=int, nargs="+", default=[21, 22, 23, 24])
    ap.add_argument("--restart", type=float, default=300.0, help="simulated s before")
    ap.add_argument("--window", type=float, default=30.0, help="first phase after, s")
    ap.add_argument("--after", type=float, default=120.0, help="simulated s after")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    cells = [(p, w, c) for p in args.profiles for w in args.workloads for c in args.concurrency]
    jobs = [(p, w, c, s, b) for p, w, c in cells for s in args.seeds for b in BRANCHES]
    with ProcessPoolExecutor(args.jobs) as ex:
        futs = {j: ex.submit(run, *j, args.restart, args.window, args.after) for j in jobs}
        out = {j: f.result() for j, f in futs.items()}
    print(f"restart at {args.restart:g} s; % of the per-bucket oracle over the first "
          f"{args.window:g} s after | all {args.after:g} s after, mean over seeds "
          f"{args.seeds} (before the restart: every branch alike)")
    for p, w, c in cells:
        def mean(b: str, i: int, cell: tuple = (p, w, c)) -> float:
            return statistics.fmean(out[(*cell, s, b)][i] for s in args.seeds)

        def whole(b: str, cell: tuple = (p, w, c)) -> float:  # window and rest, time-weighted
            f = args.window / args.after
            return f * mean(b, 1, cell) + (1 - f) * mean(b, 2, cell)

        print(f"{p:16s} {w:8s} c={c:<3d} before {mean('none', 0):6.2f}  " + "  ".join(
            f"{b} {mean(b, 1):6.2f} | {whole(b):6.2f}" for b in BRANCHES))


if __name__ == "__main__":
    main()

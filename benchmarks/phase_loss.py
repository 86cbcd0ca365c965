"""Where a load phase's goodput went: each low phase's loss, split by why its arms ran.

Runs generated worlds through the bench's own ``run_one`` (engine, plugin core, the default
policy fed band counters, oracles) with the tracing engine of ``shift_recovery.py``, and for
every load phase whose % of the per-bucket oracle after warm-up is below ``--below`` splits
its loss, in points of the phase, by the arm each decode step ran:

- **greedy**: the bucket's greedy arm (the policy's best guess was wrong, or near-tied);
- **band**: a band's own arm in a row that runs its greedy arm (the banded refinement);
- **explore**: a row that explores (every band on one arm that is not the greedy one), or an
  update's exploring probe (an arm in none of the row's bands: probes run outside the table).

A step's loss is scored as the bench scores it: under a table by batch size alone, its busy
time times the per-bucket oracle's expected goodput at its batch size less that of its arm
(``tuner.sim.oracle.expected_goodput``); under a banded table, on the step itself, the
per-bucket oracle's goodput times one less the ratio of the step's expected goodput at its
arm to that at the per-bucket oracle's arm, given the step's own requests (``tuner.bench_step``
takes the same ratio per reading, of sums). A banded step can gain (a negative loss), and
the three kinds then add up to the phase's shortfall from 100 % up to that per-step rather
than per-reading ratio. Per phase, the two batch sizes that lost most follow, with each
arm's expected goodput relative to the best and the busy seconds it ran.

    .venv/bin/python benchmarks/phase_loss.py --worlds 0-49 --seed 0
    .venv/bin/python benchmarks/phase_loss.py --worlds 1-1 --seed 0 --below 101   # every phase
    .venv/bin/python benchmarks/phase_loss.py --worlds 32,32 --seed 0 --policy-seed 1000
    .venv/bin/python benchmarks/phase_loss.py --profiles seed-kimi-pcie --workloads hard --below 99
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shift_recovery as sr

from tuner import bench
from tuner.bench_config import DEFAULT_BENCH_LOAD, DEFAULT_BENCH_WORKLOADS
from tuner.bench_worlds import DEFAULT_WORLD_LOAD
from tuner.errors import ConfigError
from tuner.protocol import is_uniform
from tuner.sim.oracle import expected_goodput
from tuner.sim.worlds import make_world, parse_world_range

KINDS = ("greedy", "band", "explore")
# A trace step: (time, band, batch, arm run, step oracle's arm, its ratio, busy s, accepted).
Step = tuple[float, int, int, int, int, float, float, int]
# A table in force from its time on, with the policy's greedy arm per bucket then.
Table = tuple[float, Any, tuple[int, ...]]


class _ValueOracle(sr._TracingOracle):
    """The tracing step oracle, also keeping every step's expected goodput per arm."""

    def step(self, rows: Any, n: int, pb: int, k: int, dt: float, band: int = 0) -> None:
        super().step(rows, n, pb, k, dt, band)
        self.values.append(tuple(self._values))


class _Engine(sr._TracingEngine):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.step_oracle = _ValueOracle(self.arms, self._costs.expected_s)
        self.step_oracle.values = []


class PhaseLoss(NamedTuple):
    """One load phase's loss by kind (points of the phase) and busy seconds per (b, k)."""

    points: dict[str, float]
    busy: dict[int, dict[int, float]]


def kind_of(k: int, greedy: int, row: Sequence[int]) -> str:
    """Why arm ``k`` ran under ``row`` (unknown band's arm, then each band's) when the
    bucket's greedy arm was ``greedy``: an exploring row runs one other arm in every band, and
    an arm in none of the row's bands is an update's exploring probe (a range of batch sizes
    on one arm for a few steps, ``policies._probes``, outside the table), bar a step launched
    as the table changed."""
    if k == greedy:
        return "greedy"
    if k not in row or (len(set(row)) == 1 and row[0] != greedy):
        return "explore"
    return "band"


def row_for(table: Any, b: int) -> Sequence[int]:
    """The banded table's row for batch size ``b`` (rows of (upper bound or None, arms))."""
    return next((ks for bound, ks in table if bound is None or b <= bound), table[-1][1])


def split_phase(trace: Sequence[Step], tables: Sequence[Table], lo: float, hi: float,
                good: Callable[[int, int, float], float], arms: Sequence[int],
                bucket_of: Callable[[int], int],
                values: Sequence[Sequence[float]] | None = None) -> PhaseLoss:
    """The loss of the steps that started in ``[lo, hi)``; ``tables`` in time order;
    ``values``, one per trace step, its expected goodput per arm (in ``arms``' order) given
    its requests, for the steps of banded tables (see the module docstring)."""
    lost: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    busy: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    best_total = 0.0
    ti = 0
    for i, (t, _band, b, k, _kb, _ratio, dt, _acc) in enumerate(trace):
        if not lo <= t < hi:
            continue
        while ti + 1 < len(tables) and tables[ti + 1][0] <= t:
            ti += 1
        _, table, greedy = tables[ti]
        g = [good(b, a, t) for a in arms]
        best = max(g)
        ref = g.index(best)  # the per-bucket oracle's arm (its first best, as the bench's)
        best_total += dt * best
        busy[b][k] += dt
        if values is not None and not is_uniform(table):
            v = values[i]
            step_loss = best * (1.0 - v[arms.index(k)] / v[ref])
        else:
            step_loss = best - g[arms.index(k)]
        lost[kind_of(k, greedy[bucket_of(b)], row_for(table, b))] += dt * step_loss
    scale = 100.0 / best_total if best_total else 0.0
    return PhaseLoss({kind: v * scale for kind, v in lost.items()},
                     {b: dict(per) for b, per in busy.items()})


def run_world(job: dict[str, Any]) -> list[str]:
    """Lines for one world's (or, with ``job["profile"]``, one shipped profile and
    workload's) phases below the threshold."""
    world = None if "profile" in job else make_world(job["world"], job["world_seed"])
    sr._band_emitted = lambda pol: pol.greedy_arms()  # each table's greedy arms, per bucket
    with mock.patch.object(bench, "Engine", _Engine), \
            mock.patch.object(bench, "build_policy", sr._capture_policy):
        res = bench.run_one(profile=job["profile"] if world is None else world.name,
                            workload=job.get("workload", "generated"), load=job["load"],
                            policy="model", seed=job["seed"], policy_seed=job["policy_seed"],
                            world=world,
                            warmup_s=job["warmup_s"])
    eng, pol = sr._TracingEngine.last, sr._TracingEngine.policy
    assert isinstance(eng, _Engine) and pol is not None
    assert len(eng.step_oracle.values) == len(eng.trace)  # one oracle step per decode step
    # the cost profile and traffic the run had (a world's, or a preset's as the bench
    # rewrites it, `shift` over the run's length)
    prof, wl = eng.profile, eng.workload
    name = f"{job['profile']} {job['workload']}" if world is None else f"world-{job['world']}"
    mixes = list(wl.phases)
    cache: dict[tuple[int, int, int], float] = {}

    def good(b: int, k: int, t: float) -> float:
        """As the bench scores: the workload's mix in force at ``t``."""
        key = (b, k, 0 if wl.stationary else mixes.index(wl.phase_at(t)))
        if key not in cache:
            cache[key] = expected_goodput(prof, wl, b, k, t=t, graph_bs=eng.graph_bs)
        return cache[key]

    lines = []
    for i, ph in enumerate(res.phases):
        if not ph.pct_oracle < job["below"]:
            continue
        lo = ph.start_s + job["warmup_s"]
        loss = split_phase(eng.trace, eng.tables, lo, ph.end_s, good, eng.arms,
                           pol.buckets.index, eng.step_oracle.values)
        split = " ".join(f"{kind} {loss.points[kind]:.2f}" for kind in KINDS)
        lines.append(f"{name} seed {job['seed']} phase {i} c={ph.concurrency}: "
                     f"{ph.pct_oracle:.1f} %  lost: {split}")

        def lost_at(b: int, t: float = lo, busy: dict[int, dict[int, float]] = loss.busy
                    ) -> float:
            return sum(dt * (max(good(b, a, t) for a in eng.arms) - good(b, k, t))
                       for k, dt in busy[b].items())

        for b in sorted(loss.busy, key=lost_at, reverse=True)[:2]:
            top = max(good(b, a, lo) for a in eng.arms)
            rel = " ".join(f"k{a} {100 * good(b, a, lo) / top:.1f}" for a in eng.arms)
            ran = " ".join(f"k{k} {dt:.1f}s" for k, dt in sorted(loss.busy[b].items()))
            lines.append(f"    b={b}: [{rel}]  ran {ran}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    def worlds(text: str) -> tuple[int, ...]:
        try:
            return parse_world_range(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    ap.add_argument("--worlds", type=worlds, default="0-49",
                    help="as bench's: N (worlds 0..N-1), A-B, or a list '3,7,10-12' (default 0-49)")
    ap.add_argument("--profiles", default=None,
                    help="shipped cost profiles (comma-separated) instead of generated worlds, "
                         "each run with every --workloads preset on the full bench's load")
    ap.add_argument("--workloads", default=",".join(DEFAULT_BENCH_WORKLOADS),
                    help="with --profiles: workload presets (default: the full bench's)")
    ap.add_argument("--world-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy-seed", type=int, default=None,
                    help="as bench's: the policy's own random choices (default: --seed)")
    ap.add_argument("--load", default=None,
                    help="load schedule (default: the world bench's, or with --profiles the "
                         "full bench's)")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds left out per phase")
    ap.add_argument("--below", type=float, default=98.0,
                    help="phases below this %% of the oracle are split")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    common = {"seed": a.seed, "policy_seed": a.policy_seed, "warmup_s": a.warmup,
              "below": a.below}
    if a.profiles:
        jobs = [{**common, "profile": p, "workload": w, "load": a.load or DEFAULT_BENCH_LOAD}
                for p in a.profiles.split(",") for w in a.workloads.split(",")]
    else:
        jobs = [{**common, "world": w, "world_seed": a.world_seed,
                 "load": a.load or DEFAULT_WORLD_LOAD} for w in a.worlds]
    print(f"{len(jobs)} runs on {a.jobs} workers ...", file=sys.stderr)
    with ProcessPoolExecutor(a.jobs) as pool:
        for lines in pool.map(run_world, jobs):
            for line in lines:
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

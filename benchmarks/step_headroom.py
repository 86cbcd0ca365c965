"""Headroom of the per-step oracle over the per-bucket oracle, per profile, workload and load.

For each shipped profile, workload and closed-loop concurrency, the simulator's engine runs
the per-bucket oracle's own table (:func:`tuner.sim.oracle.oracle_table`) and its per-step
oracle (:mod:`tuner.sim._step_oracle`) prices every step for the very requests in it. The
headroom is the per-step oracle's expected tokens over the per-bucket table's on the same
steps after a warm-up (the batches fill and the request mix settles), in %: what a table
that also knew the batch's acceptance could gain at most. Each cell runs ``--seeds`` seeds;
the table shows their mean and range.

At one request the ceiling also has a closed form, which ``--exact`` prints instead: the
running request is the batch, so the per-step oracle runs each request's own best arm, and
over the per-bucket table's steps (a request of acceptance ``α`` and class ``c`` is running
for a share of steps proportional to ``w_c · D_c / E[emitted | α, k*]``) the headroom is an
integral over the per-request Beta, taken by quadrature (a cross-check of the engine's).

**What the bands can take of it** (``--bands``). A banded table sees only the plugin's live
estimate of the batch's per-position acceptance (``tuner.plugin.acceptance``), not each
request's. Each cell runs the per-bucket oracle's table as above, with a shadow of the
plugin's estimate beside the engine, fed at every step with draws at ``--probe-arm`` from the
running requests' own acceptance (a private random stream, so the run stays the table's),
and records per step that estimate, the same quantity without sampling noise, and every
arm's expected goodput for the step's requests. The best rule from the estimate to an arm,
chosen with hindsight per cut of the estimate, is its ceiling: per protocol band
(``tuner.protocol.BAND_EDGES``), and per 1/40 of acceptance (what finer bands could reach).
Each is in % more expected tokens than the table's own arms on the same steps, beside the
per-step oracle's. A ceiling, not a policy: its rule is fitted to the steps it scores, and
a policy's estimate goes stale where its row is off.

Run: ``.venv/bin/python benchmarks/step_headroom.py`` (``--seconds 300 --seeds 1`` for a
quick look; ``--json PATH`` writes the cells; ``--exact`` for the closed form at one request;
``--bands`` for the bands' ceiling).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from bisect import bisect_right
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tuner.plugin.acceptance import AcceptanceEstimate
from tuner.plugin.core import PluginCore
from tuner.protocol import BAND_EDGES, encode_update
from tuner.sim._step_oracle import StepOracle
from tuner.sim.acceptance import beta_nodes
from tuner.sim.engine import Engine
from tuner.sim.graphs import cuda_graph_bs, pad_batch_size
from tuner.sim.load import ClosedLoop
from tuner.sim.oracle import _decode_tokens_mean, oracle_arm, oracle_table
from tuner.sim.profiles import list_profiles, load_profile
from tuner.sim.workloads import get_workload

ARMS = (0, 1, 3, 5, 7)  # the bench's default arms
FINE_BINS = 40  # cuts of the estimate for the "finer bands" ceiling


def _oracle_run(profile: str, workload: str, concurrency: int, seed: int,
                engine: type[Engine] = Engine) -> Engine:
    """An engine at a closed-loop ``concurrency`` whose plugin runs the per-bucket oracle's
    table."""
    prof = load_profile(profile)
    wl = get_workload(workload)
    cap = prof.max_running or concurrency
    if prof.max_batch is not None:
        cap = min(cap, prof.max_batch)
    core = PluginCore(ARMS, started_at=0.0)
    eng = engine(profile=prof, workload=wl, core=core, max_running=cap, seed=seed,
                 load=ClosedLoop([(1e12, concurrency)]))
    table = oracle_table(prof, wl, ARMS, max_batch=eng.graph_bs[-1], graph_bs=eng.graph_bs)
    ok, why = core.apply_update(encode_update(table, 1))
    if not ok:
        raise RuntimeError(f"{profile}: the oracle's table was refused: {why}")
    return eng


def headroom(profile: str, workload: str, concurrency: int, seconds: float, warmup_s: float,
             seed: int) -> float:
    """% more expected tokens of the per-step oracle than the per-bucket table, same steps."""
    eng = _oracle_run(profile, workload, concurrency, seed)
    eng.run_until(warmup_s)
    eng.step_oracle.take()
    eng.run_until(warmup_s + seconds)
    ran = best = 0.0
    for s in eng.step_oracle.take().values():
        ran += s.ran_tokens  # the table's arm at each step
        best += s.best_tokens
    return 100.0 * (best / ran - 1.0)


class _StepValues(StepOracle):
    """The step oracle, also keeping each step's time, every arm's expected goodput and the
    index of the arm that ran."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.steps: list[tuple[float, list[float], int]] = []

    def step(self, rows: Any, n: int, pb: int, k: int, dt: float, band: int = 0) -> None:
        super().step(rows, n, pb, k, dt, band)
        self.steps.append((dt, list(self._values), self._index[k]))


class _EstimateEngine(Engine):
    """The engine, also keeping per step the batch's acceptance as a banded table could
    know it: a shadow of the plugin's estimate, fed with draws at ``probe_arm`` from each
    running request's own acceptance (a private random stream, so the run itself is the
    per-bucket table's), and the same quantity without sampling noise."""

    probe_arm = 3

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.step_oracle = _StepValues(self.arms, self._costs.expected_s)
        self.shadow = AcceptanceEstimate()
        self.estimates: list[tuple[float | None, float]] = []
        self._shadow_rng = np.random.default_rng(kw.get("seed", 0) + 7919)

    def _decode(self) -> None:
        n, k, rows = len(self._running), self.probe_arm, self._rows
        rows.sync(n)
        surv = rows._surv[:n, :k]
        # The estimate's target: accepted drafts over positions tried, sum(min(a + 1, k)).
        exact = float(surv.sum()) / (n + float(surv[:, : k - 1].sum()))
        self.estimates.append((self.shadow.alpha, exact))
        u = self._shadow_rng.random(n)
        self.shadow.observe(k, (u[:, None] < surv).sum(axis=1).tolist())
        super()._decode()


def band_ceiling(profile: str, workload: str, concurrency: int, seconds: float,
                 warmup_s: float, seed: int, probe_arm: int) -> dict[str, float]:
    """% more expected tokens than the per-bucket oracle's table on its own steps (the arm it
    ran at each): the per-step oracle's, and the best rule from the batch's acceptance to an
    arm, per protocol band and per 1/FINE_BINS of acceptance, on the shadow estimate and on
    the exact value."""
    eng = _oracle_run(profile, workload, concurrency, seed, _EstimateEngine)
    assert isinstance(eng, _EstimateEngine) and isinstance(eng.step_oracle, _StepValues)
    eng.probe_arm = probe_arm
    eng.run_until(warmup_s)
    first = len(eng.step_oracle.steps)
    eng.run_until(warmup_s + seconds)
    steps = list(zip(eng.estimates[first:], eng.step_oracle.steps[first:], strict=True))
    base = sum(dt * v[ran] for _, (dt, v, ran) in steps)

    def best_rule(which: int, cut: Any) -> float:
        cells: dict[int, list[float]] = {}
        for est, (dt, v, _) in steps:
            a = est[which]
            cell = cells.setdefault(-1 if a is None else cut(a), [0.0] * len(v))
            for i, x in enumerate(v):
                cell[i] += dt * x
        return sum(max(c) for c in cells.values())

    def pct(x: float) -> float:
        return 100.0 * (x / base - 1.0)

    def bands(a: float) -> int:
        return bisect_right(BAND_EDGES, a)

    def fine(a: float) -> int:
        return min(int(a * FINE_BINS), FINE_BINS - 1)

    return {"step_oracle": pct(sum(dt * max(v) for _, (dt, v, _) in steps)),
            "bands": pct(best_rule(0, bands)), "fine": pct(best_rule(0, fine)),
            "exact_bands": pct(best_rule(1, bands)), "exact_fine": pct(best_rule(1, fine))}


def exact_one_request(profile: str, workload: str) -> float:
    """% headroom at one request in closed form (chain acceptance; the presets' classes)."""
    prof = load_profile(profile)
    wl = get_workload(workload)
    pb = pad_batch_size(1, cuda_graph_bs())
    k_ref = oracle_arm(prof, wl, 1, ARMS)
    inv_cost = {k: 1.0 / prof.step_s(pb, k) for k in ARMS}
    best = ref = 0.0
    for w, cls in wl.mix_at(0.0):
        alpha, delta = cls.alpha_delta(prof.acceptance)
        x, wx = beta_nodes(alpha, wl.kappa)
        emitted = {}
        for k in ARMS:
            i = np.arange(1, k + 1)
            emitted[k] = 1.0 + (x[:, None] ** i * delta ** (i * (i - 1) / 2)).sum(axis=1)
        # Steps the table spends on requests near x: tokens to emit over tokens per step.
        steps = w * _decode_tokens_mean(cls.output) * wx / emitted[k_ref]
        best += (steps * np.max([emitted[k] * inv_cost[k] for k in ARMS], axis=0)).sum()
        ref += (steps * emitted[k_ref] * inv_cost[k_ref]).sum()
    return 100.0 * (best / ref - 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", default=",".join(list_profiles()))
    ap.add_argument("--workloads", default="chat,diverse")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--seconds", type=float, default=600.0, help="virtual seconds per cell")
    ap.add_argument("--warmup", type=float, default=30.0, help="virtual seconds left out")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--exact", action="store_true", help="the closed form at one request")
    ap.add_argument("--bands", action="store_true",
                    help="what a table over the live estimate's bands could take at most")
    ap.add_argument("--probe-arm", type=int, default=3,
                    help="with --bands: the arm the shadow estimate drafts at every step")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="with --bands: worker processes")
    args = ap.parse_args(argv)
    if args.bands:
        return print_bands(args)
    if args.exact:
        print("per-step oracle headroom at one request, closed form, %")
        for profile in args.profiles.split(","):
            cells = "".join(f"{f'{w} {exact_one_request(profile, w):+.2f}':>18s}"
                            for w in args.workloads.split(","))
            print(f"{profile:28s}{cells}")
        return 0
    concs = [int(c) for c in args.concurrency.split(",")]
    cells = []
    print(f"per-step oracle headroom over the per-bucket oracle's table, % (mean [min, max] "
          f"over {args.seeds} seeds; {args.seconds:g} s after {args.warmup:g} s per cell)")
    print(f"{'profile':28s} {'workload':9s}" + "".join(f"{f'c={c}':>22s}" for c in concs))
    for profile in args.profiles.split(","):
        for workload in args.workloads.split(","):
            line = f"{profile:28s} {workload:9s}"
            for c in concs:
                vals = [headroom(profile, workload, c, args.seconds, args.warmup, seed)
                        for seed in range(args.seeds)]
                cells.append(dict(profile=profile, workload=workload, concurrency=c,
                                  headroom_pct=vals))
                m = statistics.fmean(vals)
                line += f"{f'{m:+.2f} [{min(vals):+.2f}, {max(vals):+.2f}]':>22s}"
            print(line, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(dict(arms=ARMS, seconds=args.seconds,
                                             warmup_s=args.warmup, cells=cells), indent=1))
    return 0


def _pct(x: float) -> str:
    return f"{x + 0.0:+.1f}".replace("-0.0", "+0.0")  # a rule fitted in hindsight is >= 0


def print_bands(args: argparse.Namespace) -> int:
    concs = [int(c) for c in args.concurrency.split(",")]
    cells = []
    print(f"% more expected tokens than the per-bucket oracle's table on its own steps, mean "
          f"over {args.seeds} seeds ({args.seconds:g} s after {args.warmup:g} s): per-step "
          f"oracle / best rule from the estimate (drafts at k = {args.probe_arm}) per protocol "
          f"band, per 1/{FINE_BINS} / the same from the batch's exact acceptance")
    print(f"{'profile':28s} {'workload':9s}" + "".join(f"{f'c={c}':>34s}" for c in concs))
    grid = [(p, w, c) for p in args.profiles.split(",") for w in args.workloads.split(",")
            for c in concs]
    jobs = [(*cell, args.seconds, args.warmup, seed, args.probe_arm)
            for cell in grid for seed in range(args.seeds)]
    if args.jobs <= 1:
        done = [band_ceiling(*job) for job in jobs]
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            done = list(pool.map(band_ceiling, *zip(*jobs, strict=True)))
    for i, (profile, workload, c) in enumerate(grid):
        runs = done[i * args.seeds:(i + 1) * args.seeds]
        cells.append({"profile": profile, "workload": workload, "concurrency": c, "runs": runs})
    for profile in args.profiles.split(","):
        for workload in args.workloads.split(","):
            line = f"{profile:28s} {workload:9s}"
            for cell in cells:
                if (cell["profile"], cell["workload"]) != (profile, workload):
                    continue
                mean = {key: _pct(statistics.fmean(r[key] for r in cell["runs"]))
                        for key in cell["runs"][0]}
                text = "{step_oracle} / {bands} {fine} / {exact_bands} {exact_fine}"
                line += f"{text.format(**mean):>34s}"
            print(line, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"arms": ARMS, "probe_arm": args.probe_arm,
                                         "seconds": args.seconds, "warmup_s": args.warmup,
                                         "cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

Run: ``.venv/bin/python benchmarks/step_headroom.py`` (``--seconds 300 --seeds 1`` for a
quick look; ``--json PATH`` writes the cells; ``--exact`` for the closed form at one request).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from tuner.plugin.core import PluginCore
from tuner.protocol import encode_update
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop
from tuner.sim.acceptance import beta_nodes
from tuner.sim.graphs import cuda_graph_bs, pad_batch_size
from tuner.sim.oracle import _decode_tokens_mean, oracle_arm, oracle_table
from tuner.sim.profiles import list_profiles, load_profile
from tuner.sim.workloads import get_workload

ARMS = (0, 1, 3, 5, 7)  # the bench's default arms


def headroom(profile: str, workload: str, concurrency: int, seconds: float, warmup_s: float,
             seed: int) -> float:
    """% more expected tokens of the per-step oracle than the per-bucket table, same steps."""
    prof = load_profile(profile)
    wl = get_workload(workload)
    cap = prof.max_running or concurrency
    if prof.max_batch is not None:
        cap = min(cap, prof.max_batch)
    core = PluginCore(ARMS, started_at=0.0)
    eng = Engine(profile=prof, workload=wl, core=core, max_running=cap, seed=seed,
                 load=ClosedLoop([(1e12, concurrency)]))
    table = oracle_table(prof, wl, ARMS, max_batch=eng.graph_bs[-1], graph_bs=eng.graph_bs)
    ok, why = core.apply_update(encode_update(table, 1))
    if not ok:
        raise RuntimeError(f"{profile}: the oracle's table was refused: {why}")
    eng.run_until(warmup_s)
    eng.step_oracle.take()
    eng.run_until(warmup_s + seconds)
    ran = best = 0.0
    for s in eng.step_oracle.take().values():
        ran += s.ran_tokens  # the table's arm at each step
        best += s.best_tokens
    return 100.0 * (best / ran - 1.0)


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
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())

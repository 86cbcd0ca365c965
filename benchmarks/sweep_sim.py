"""`dynspec-tuner sweep` against the simulator: 8 concurrency levels x 4 arms (targets: done in
<= 10 minutes of wall time, and at every level the best arm named is the oracle's, or one
within 2 % of the oracle's goodput).

Starts the simulator's HTTP server on loopback (accelerated), runs the real sweep over HTTP
(closed-loop load, arms pinned through the plugin's update path, Optuna study in a temporary
SQLite file), then prints the sweep's table, and per level the arm it named next to the
oracle's (exact expected goodput at batch size min(level, running-request cap)). Cost is
printed against the full grid; ``--baseline`` also runs the exhaustive grid (every cell once
for the full window) in the same run and prints the wall-time ratio.

Keep ``--speed`` moderate: the client's own turnaround per request (milliseconds of Python on
a shared box) is multiplied by the speed-up in simulated time and starts to favour the arm
with the longest requests; 8x with 256-token requests keeps it to a few percent. A fast
profile needs fewer requests per second: the sweep flags a level whose server-side decode
batch falls short of the concurrency.

    .venv/bin/python benchmarks/sweep_sim.py [--profile seed-kimi-pcie] [--speed 8]
        [--per-level 15] [--max-tokens 256] [--baseline]
    .venv/bin/python benchmarks/sweep_sim.py --profile h200-llama8b --speed 6 --max-tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time

import optuna

from tuner.loadgen import LoadConfig, synthetic_prompts
from tuner.sim.oracle import expected_goodput
from tuner.sim.server import SimServer
from tuner.sweep import DEFAULT_LEVELS, SweepConfig, SweepResult, render_text, sweep_server

TARGET_WALL_S = 600.0
TOLERANCE = 0.02


def _csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(",") if p.strip())


def _run(
    sim: SimServer, config: SweepConfig, args: argparse.Namespace, db: str
) -> tuple[SweepResult, float]:
    t0 = time.monotonic()
    result = asyncio.run(
        sweep_server(
            f"127.0.0.1:{sim.port}",
            config,
            prompts=synthetic_prompts(seed=args.seed),
            load_config=LoadConfig(max_tokens=args.max_tokens, seed=args.seed),
            db_url=db,
        )
    )
    return result, time.monotonic() - t0


def _verdicts(sim: SimServer, result: SweepResult, workload: str) -> list[tuple]:
    profile = sim.engine.profile
    cap = sim.engine.max_running
    rows = []
    for level in result.levels:
        named = result.best.get(level)
        b = min(level, cap)
        good = {k: expected_goodput(profile, workload, b, k) for k in result.arms}
        oracle = max(good, key=lambda k: (good[k], -k))
        ratio = good[named] / good[oracle] if named is not None else 0.0
        rows.append((level, b, named, oracle, ratio, ratio >= 1 - TOLERANCE))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="seed-kimi-pcie")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--speed", type=float, default=8.0)
    ap.add_argument("--levels", type=_csv_ints, default=DEFAULT_LEVELS)
    ap.add_argument("--arms", type=_csv_ints, default=(0, 1, 3, 5))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--per-level", type=float, default=15.0,
                    help="wall seconds per window, at most")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", action="store_true",
                    help="also run the exhaustive grid in the same run and compare wall time")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    ok = True
    with tempfile.TemporaryDirectory() as tmp, SimServer(
        profile=args.profile, workload=args.workload, arms=args.arms, speed=args.speed,
        seed=args.seed,
    ) as sim:
        config = SweepConfig(levels=args.levels, arms=args.arms, per_level_s=args.per_level,
                             warmup_s=args.warmup, study_name="bench")
        print(f"{args.profile} / {args.workload}, x{args.speed:g} speed, "
              f"{len(args.levels)} levels x {len(args.arms)} arms, {args.max_tokens} tokens "
              f"per request, windows <= {args.per_level:g} s (tok/s below are per wall second)")
        result, wall = _run(sim, config, args, f"sqlite:///{tmp}/sweep.db")
        print(render_text(result))
        print()
        print("level  batch  named  oracle  named/oracle goodput")
        for level, b, named, oracle, ratio, good in _verdicts(sim, result, args.workload):
            ok &= good
            print(f"{level:5d}  {b:5d}  {'-' if named is None else f'k={named}':>5}  "
                  f"{f'k={oracle}':>6}  {ratio:20.3f}  {'PASS' if good else 'FAIL'}")
        measured = sum(1 for _, a in result.cells if a >= 0)
        grid = len(result.levels) * len(result.arms)
        print(f"\ncells measured: {measured} of {grid} ({measured / grid:.2f} of the grid), "
              f"{result.windows} windows, {result.measured_s:.0f} s measured; "
              f"full grid at the window cap: {grid * args.per_level:.0f} s "
              f"(ratio {result.measured_s / (grid * args.per_level):.2f})")
        wall_ok = wall <= TARGET_WALL_S
        ok &= wall_ok
        print(f"wall time: {wall:.0f} s (target <= {TARGET_WALL_S:.0f} s: "
              f"{'PASS' if wall_ok else 'FAIL'})")
        if args.baseline:
            grid_cfg = SweepConfig(levels=args.levels, arms=args.arms,
                                   per_level_s=args.per_level, warmup_s=args.warmup,
                                   exhaustive=True, study_name="grid")
            base, base_wall = _run(sim, grid_cfg, args, f"sqlite:///{tmp}/grid.db")
            agree = sum(1 for lv in base.levels if base.best.get(lv) == result.best.get(lv))
            base_ok = sum(1 for *_, good in _verdicts(sim, base, args.workload) if good)
            print(f"baseline exhaustive grid: {base_wall:.0f} s wall, {base.windows} windows; "
                  f"sweep/grid wall ratio {wall / base_wall:.2f}; same best arm at "
                  f"{agree}/{len(base.levels)} levels; grid within 2 % of the oracle at "
                  f"{base_ok}/{len(base.levels)}")
    print(f"targets {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

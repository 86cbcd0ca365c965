"""How well `run` learns in 120 simulated seconds of a concurrency sweep 1 -> 256 (target: the
greedy table picks the oracle arm, or one within 2 % of its goodput, in every bucket with
>= 200 decode steps).

Runs the real daemon against the simulator over HTTP (``run_simulation``, as
``dynspec-tuner run --simulate`` does) for several seeds, and prints per seed the buckets
judged and passed, and the expected goodput of the learned table as a ratio to the oracle,
next to the baseline measured on the same run: the server's default table (the largest arm
everywhere).

    .venv/bin/python benchmarks/learning_sweep.py [--seeds 5] [--policy NAME]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile

from tuner.config import SimulateConfig, TunerConfig
from tuner.simulate import DEFAULT_MIN_VERDICT_STEPS, run_simulation

SWEEP = "12:1,12:2,12:4,12:8,12:16,12:32,12:64,12:128,24:256"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--profile", default="h200-llama8b")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--load", default=SWEEP)
    ap.add_argument("--decision-period", type=float, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    all_ok = True
    print(f"{args.profile} / {args.workload}, load {args.load}, {args.duration:g} simulated s")
    print("seed  judged  passed  learned/oracle  default/oracle  misses")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            extra = {"policy": args.policy} if args.policy else {}
            if args.decision_period:
                extra["decision_period_s"] = args.decision_period
            cfg = TunerConfig(db_url=f"sqlite:///{tmp}/s{seed}.db", seed=seed, **extra)
            sim = SimulateConfig(profile=args.profile, workload=args.workload, load=args.load,
                                 duration_s=args.duration, speed=10_000, seed=seed)
            s = run_simulation(cfg, sim)
            judged = s.judged()
            passed = [v for v in judged if v.ok()]
            misses = ", ".join(f"{v.label}: k{v.learned_k} vs k{v.oracle_k} "
                               f"({100 * v.ratio:.1f}%)" for v in judged if not v.ok())
            all_ok &= len(passed) == len(judged)
            print(f"{seed:4d}  {len(judged):6d}  {len(passed):6d}  "
                  f"{s.learned_goodput / s.oracle_goodput:14.3f}  "
                  f"{s.default_goodput / s.oracle_goodput:14.3f}  {misses or '-'}")
    print(f"buckets judged: >= {DEFAULT_MIN_VERDICT_STEPS} decode steps; "
          f"target {'met' if all_ok else 'NOT met'} on every seed")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Policies on a machine whose speed wanders, against the same runs on a steady one.

A loaded CPU server's step times move by 1.5-2x over minutes (tests/real/test_learning_real.py
saw it). An arm run for a short stint in a slow minute then looks worse than it is. This runs
the bench's ``run_one`` on the simulator with its machine's speed wandering
(``tuner.sim._step_cost.MachineDrift``: an Ornstein-Uhlenbeck log speed over busy seconds,
alike for every arm) and on a steady machine, same seeds, and prints per (machine, profile,
policy) the mean and lowest worst phase, phases below 98 %, the mean phase and tokens lost
to exploration; then, per policy, the paired difference of every phase against the first
machine listed (the bench scores by expectation, so the machine's speed itself costs no
points: what a drift costs is the policy's choices).

    .venv/bin/python benchmarks/machine_drift.py --seeds 1-2 --drift 0,0.2:30 --jobs 2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tuner.bench as bench  # noqa: E402
from tuner.bench_config import DEFAULT_BENCH_LOAD  # noqa: E402
from tuner.sim._step_cost import MachineDrift  # noqa: E402


def _label(d: MachineDrift | None) -> str:
    return "steady machine" if d is None else f"machine drift sd {d.sd:g} over {d.tau_s:g} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="h200-llama8b,seed-kimi-pcie,h200-moe-qwen3-30b-a3b")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--load", default=DEFAULT_BENCH_LOAD)
    ap.add_argument("--policies", default="model,thompson")
    ap.add_argument("--seeds", default="1-2", help="A-B (inclusive)")
    ap.add_argument("--drift", default="0,0.2:30",
                    help="machines, SD:SECONDS each (0: steady), comma-separated; the first "
                         "is the reference")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    lo, _, hi = args.seeds.partition("-")
    seeds = range(int(lo), int(hi or lo) + 1)
    drifts = [None if d in ("0", "none") else MachineDrift.parse(d)
              for d in args.drift.split(",")]
    profiles, policies = args.profiles.split(","), args.policies.split(",")
    keys = [(d, profile, seed, policy) for d in drifts for profile in profiles
            for seed in seeds for policy in policies]
    jobs = [dict(profile=profile, workload=args.workload, load=args.load, policy=policy,
                 seed=seed, machine_drift=d) for d, profile, seed, policy in keys]
    print(f"machine_drift: {len(jobs)} runs ({len(drifts)} machines x {len(profiles)} "
          f"profiles x {len(seeds)} seeds x {len(policies)} policies), {args.jobs} jobs ...",
          flush=True)
    runs = dict(zip(keys, bench._run_jobs(jobs, args.jobs, None), strict=True))
    # A phase no longer than the warm-up has no figure after it (NaN): left out.
    phases = {key: [p.pct_oracle for p in r.phases if math.isfinite(p.pct_oracle)]
              for key, r in runs.items()}

    for d in drifts:
        print(f"\n## {_label(d)}, {args.workload}, seeds {args.seeds}")
        print(f"{'profile':24s} {'policy':12s} worst(mean/low) <98%  mean phase  explore")
        for profile in profiles:
            for policy in policies:
                per_seed = [phases[(d, profile, s, policy)] for s in seeds]
                worst = [min(v) for v in per_seed]
                flat = [x for v in per_seed for x in v]
                explore = statistics.mean(runs[(d, profile, s, policy)].explore_pct
                                          for s in seeds)
                print(f"{profile:24s} {policy:12s} {statistics.mean(worst):6.2f} "
                      f"{min(worst):6.1f} {sum(x < 98 for x in flat):4d}  "
                      f"{statistics.mean(flat):8.3f}  {explore:6.2f}%")
    for d in drifts[1:]:
        print(f"\n## {_label(d)} minus {_label(drifts[0])}, phase by phase")
        for policy in policies:
            diffs = [x - y for profile in profiles for s in seeds
                     for x, y in zip(phases[(d, profile, s, policy)],
                                     phases[(drifts[0], profile, s, policy)], strict=True)]
            sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            print(f"{policy:12s} mean {statistics.mean(diffs):+.3f} points "
                  f"(± {1.96 * sd / len(diffs) ** 0.5:.3f}, {len(diffs)} phases), lowest "
                  f"{min(diffs):+.1f}")


if __name__ == "__main__":
    main()

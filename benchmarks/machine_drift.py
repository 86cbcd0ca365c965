"""The default policy on a machine whose speed wanders, with and without the stint drift.

A loaded CPU server's step times move by 1.5-2x over minutes (tests/real/test_learning_real.py
saw it). An arm run for a short stint in a slow minute then looks worse than it is, and a
policy that counts that stint's steps as independent readings is sure of it. The model
policy measures that drift between an arm's stints (``policies._drift``) and widens the
cells measured in few stints by it. This runs the bench's ``run_one`` on the simulator with
its machine's speed wandering (``tuner.sim._step_cost.MachineDrift``: an Ornstein-Uhlenbeck
log speed over busy seconds), for the default policy and for it with the drift term off
(``model:stint_drift_z=inf``), on the same seeds, and prints per (drift, profile) the mean
and lowest worst phase, phases below 98 % and the mean phase of each, then the paired
difference of every phase. ``--drift 0`` is the control: there the two are identical.

    .venv/bin/python benchmarks/machine_drift.py --seeds 1-4 --drift 0.2:30,0 --jobs 2
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

POLICIES = ("model", "model:stint_drift_z=inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="h200-llama8b,seed-kimi-pcie,h200-moe-qwen3-30b-a3b")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--load", default=DEFAULT_BENCH_LOAD)
    ap.add_argument("--seeds", default="1-4", help="A-B (inclusive)")
    ap.add_argument("--drift", default="0.2:30,0",
                    help="machine drifts, SD:SECONDS each, comma-separated (0: none)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    lo, _, hi = args.seeds.partition("-")
    seeds = range(int(lo), int(hi or lo) + 1)
    drifts = [None if d in ("0", "none") else MachineDrift.parse(d)
              for d in args.drift.split(",")]
    keys = [(d, profile, seed, policy) for d in drifts for profile in args.profiles.split(",")
            for seed in seeds for policy in POLICIES]
    jobs = [dict(profile=profile, workload=args.workload, load=args.load, policy=policy,
                 seed=seed, machine_drift=d) for d, profile, seed, policy in keys]
    print(f"machine_drift: {len(jobs)} runs ({len(drifts)} drifts x {len(seeds)} seeds x "
          f"{len(POLICIES)} policies), {args.jobs} jobs ...", flush=True)
    runs = bench._run_jobs(jobs, args.jobs, None)
    # A phase no longer than the warm-up has no figure after it (NaN): left out.
    phases = {key: [p.pct_oracle for p in r.phases if math.isfinite(p.pct_oracle)]
              for key, r in zip(keys, runs, strict=True)}

    for d in drifts:
        label = "steady machine" if d is None else f"machine drift sd {d.sd:g} over {d.tau_s:g} s"
        print(f"\n## {label}, {args.workload}, seeds {args.seeds}")
        print(f"{'profile':28s} {'policy':26s} worst(mean/low) <98%  mean phase")
        diffs: list[float] = []
        for profile in args.profiles.split(","):
            for policy in POLICIES:
                runs_p = [phases[(d, profile, s, policy)] for s in seeds]
                worst = [min(v) for v in runs_p]
                flat = [x for v in runs_p for x in v]
                print(f"{profile:28s} {policy:26s} {statistics.mean(worst):6.2f} "
                      f"{min(worst):6.1f} {sum(x < 98 for x in flat):4d}  "
                      f"{statistics.mean(flat):7.3f}")
            for s in seeds:
                a, b = phases[(d, profile, s, POLICIES[0])], phases[(d, profile, s, POLICIES[1])]
                diffs += [x - y for x, y in zip(a, b, strict=True)]
        gain = statistics.mean(diffs)
        sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        print(f"phase by phase, {POLICIES[0]} minus {POLICIES[1]}: mean {gain:+.3f} points "
              f"(± {1.96 * sd / len(diffs) ** 0.5:.3f}, {len(diffs)} phases; "
              f"{sum(x > 0 for x in diffs)} up, {sum(x < 0 for x in diffs)} down)")


if __name__ == "__main__":
    main()

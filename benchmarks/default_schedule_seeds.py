"""The default policy over many seeds of the bench's default load schedule, with a summary.

One seed of the full bench says little about a single phase: which arm a bucket tries first
changes what it measures next, so one phase moves by points from seed to seed. This runs the
bench's ``run_one`` for the default policy on every (profile, workload, seed), writes each
run's ``pct_oracle`` per phase to ``--json``, and prints: the mean and lowest of each run's
worst phase, runs and phases below 98 %, the mean phase, and the first visit to 64 requests
(phase 4 of the default schedule).

    .venv/bin/python benchmarks/default_schedule_seeds.py --seeds 1-5 --json out.json
    .venv/bin/python benchmarks/default_schedule_seeds.py --from-json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tuner.bench as bench  # noqa: E402
from tuner.bench_config import DEFAULT_BENCH_LOAD  # noqa: E402

FIRST_64 = 3  # index of the first 64-request phase in the default schedule


def summary(runs: dict[str, list[float]]) -> str:
    worst = [min(v) for v in runs.values()]
    phases = [x for v in runs.values() for x in v]
    first64 = [v[FIRST_64] for v in runs.values() if len(v) > FIRST_64]
    out = (f"{len(runs)} runs: worst phase mean {sum(worst) / len(worst):.2f}, lowest "
           f"{min(worst):.1f}; runs < 98 % {sum(w < 98 for w in worst)}; phases < 98 % "
           f"{sum(x < 98 for x in phases)} of {len(phases)}; mean phase "
           f"{sum(phases) / len(phases):.3f}")
    if first64:
        out += f"; first visit to 64: mean {sum(first64) / len(first64):.2f}, lowest {min(first64):.1f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="seed-kimi-pcie,h200-moe-qwen3-30b-a3b")
    ap.add_argument("--workloads", default="chat,code,hard,shift")
    ap.add_argument("--seeds", default="1-5", help="A-B (inclusive)")
    ap.add_argument("--policy", default="model")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write every run's phases here")
    ap.add_argument("--from-json", help="summarise an earlier --json instead")
    args = ap.parse_args()
    if args.from_json:
        print(summary(json.loads(Path(args.from_json).read_text())))
        return
    lo, _, hi = args.seeds.partition("-")
    jobs = [dict(profile=profile, workload=workload, load=DEFAULT_BENCH_LOAD,
                 policy=args.policy, seed=seed)
            for profile in args.profiles.split(",") for workload in args.workloads.split(",")
            for seed in range(int(lo), int(hi or lo) + 1)]

    def progress(r: bench.RunResult) -> None:
        print(f"{r.profile}/{r.workload}/{r.seed}:",
              " ".join(f"{p.pct_oracle:.1f}" for p in r.phases), flush=True)

    # The bench's own runner: in order, in a pool of --jobs processes.
    runs = {f"{r.profile}/{r.workload}/{r.seed}": [p.pct_oracle for p in r.phases]
            for r in bench._run_jobs(jobs, args.jobs, progress)}
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")
    print(summary(runs))


if __name__ == "__main__":
    main()

"""How much of the per-step oracle's headroom the default policy takes, beside what any table
over the protocol's acceptance bands could take.

Each cell (profile, workload, closed-loop concurrency, seed) is one bench run
(``tuner.bench.run_one``, the policy fed band counters as the daemon drives a protocol v2
server) of ``--seconds`` after ``--warmup`` at that concurrency. Per cell: the policy's gain
over the per-bucket oracle (``pct_oracle - 100``), the per-step oracle's headroom on the
policy's own steps (``pct_oracle / pct_step_oracle``), and the share of the headroom taken.
Issue #15's target: where the headroom is >= 2 %, at least half of it.

With ``--ceiling JSON`` (from ``benchmarks/step_headroom.py --bands --json``) each row also
shows the bands' ceiling there: the best rule from the live estimate's band to an arm, in
hindsight, on the per-bucket oracle table's steps (other seeds, the same length).

    .venv/bin/python benchmarks/band_capture.py --ceiling benchmarks/results/band-ceiling.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuner import bench  # noqa: E402
from tuner.bench_config import DEFAULT_BENCH_PROFILES  # noqa: E402


def cell_jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"profile": p, "workload": w, "load": f"{args.warmup + args.seconds:g}:{c}",
             "policy": args.policy, "seed": s, "warmup_s": args.warmup}
            for p in args.profiles.split(",") for w in args.workloads.split(",")
            for c in map(int, args.concurrency.split(",")) for s in args.seeds]


def gain_and_headroom(run: Any) -> tuple[float, float]:
    """% over the per-bucket oracle, and the per-step oracle's % over it on the same steps."""
    (ph,) = run.phases
    return ph.pct_oracle - 100.0, 100.0 * (ph.pct_oracle / ph.pct_step_oracle - 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", default=",".join(DEFAULT_BENCH_PROFILES))
    ap.add_argument("--workloads", default="diverse,chat")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--seconds", type=float, default=270.0, help="scored, per cell")
    ap.add_argument("--warmup", type=float, default=30.0)
    ap.add_argument("--policy", default="model")
    ap.add_argument("--ceiling", type=Path, help="a step_headroom.py --bands --json file")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", type=Path, help="write every cell's runs here")
    args = ap.parse_args(argv)
    jobs = cell_jobs(args)
    runs = bench._run_jobs(jobs, args.jobs, None)
    ceiling: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    if args.ceiling is not None:
        for cell in json.loads(args.ceiling.read_text())["cells"]:
            ceiling[cell["profile"], cell["workload"], cell["concurrency"]] = cell["runs"]
    cells: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for job, run in zip(jobs, runs, strict=True):
        c = int(job["load"].split(":")[1])
        cells.setdefault((job["profile"], job["workload"], c), []).append(gain_and_headroom(run))
    print(f"{args.policy}: % over the per-bucket oracle / the per-step oracle's headroom on its "
          f"steps, per seed {args.seeds} ({args.seconds:g} s after {args.warmup:g} s); mean, "
          "share taken; the bands' ceiling / headroom on the oracle table's steps")
    met = scope = 0
    for (profile, workload, c), vals in cells.items():
        gain = statistics.fmean(g for g, _ in vals)
        head = statistics.fmean(h for _, h in vals)
        share = f"{100 * gain / head:4.0f} %" if head >= 0.5 else "     -"
        if head >= 2.0:
            scope += 1
            met += gain >= head / 2
        line = (f"{profile:24s} {workload:8s} c={c:<3d}"
                + " ".join(f"{g:+5.1f}/{h:4.1f}" for g, h in vals)
                + f"   {gain:+5.2f}/{head:4.1f} {share}")
        ref = ceiling.get((profile, workload, c))
        if ref:
            line += (f" | {statistics.fmean(r['bands'] for r in ref):+4.1f} / "
                     f"{statistics.fmean(r['step_oracle'] for r in ref):4.1f}")
        print(line)
    print(f"cells with >= 2 % headroom: {scope}; at least half of it taken in {met}")
    if args.json is not None:
        args.json.write_text(json.dumps(
            [{"cell": list(key), "gain_headroom": vals} for key, vals in cells.items()],
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The default policy's goodput as the plugin's acceptance estimate keeps more or less memory.

The estimate (``tuner.plugin.acceptance.AcceptanceEstimate``) keeps ``decay`` of its moving
sums per decode step; the band a batch is put in, and so the arm a banded table gives it,
follows from it. Each cell runs the bench's ``run_one`` (engine, plugin core, default policy
fed band counters) for one phase of ``--duration`` seconds at one concurrency, and prints the
% of the per-bucket oracle and of the per-step oracle; the mean over cells closes each decay.

    .venv/bin/python benchmarks/estimate_decay.py --decays 0.8 0.9 0.95 --seed 1
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tuner.bench as bench  # noqa: E402
from tuner.plugin import core  # noqa: E402
from tuner.plugin.acceptance import AcceptanceEstimate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decays", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profiles", default="seed-kimi-pcie,h200-llama8b,h200-moe-qwen3-30b-a3b")
    ap.add_argument("--workloads", default="diverse,chat")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--duration", type=float, default=300.0)
    args = ap.parse_args()
    for decay in args.decays:
        # The plugin core (which the engine drives) builds its estimate with this decay.
        with mock.patch.object(core, "AcceptanceEstimate", partial(AcceptanceEstimate,
                                                                   decay=decay)):
            pcts = []
            for profile in args.profiles.split(","):
                for workload in args.workloads.split(","):
                    for c in (int(x) for x in args.concurrency.split(",")):
                        r = bench.run_one(profile=profile, workload=workload,
                                          load=f"{args.duration:g}:{c}", policy="model",
                                          seed=args.seed)
                        p = r.phases[-1]
                        pcts.append(p.pct_oracle)
                        print(decay, profile, workload, c, round(p.pct_oracle, 2),
                              round(p.pct_step_oracle, 2), flush=True)
        print("mean", decay, round(sum(pcts) / len(pcts), 3), flush=True)


if __name__ == "__main__":
    main()

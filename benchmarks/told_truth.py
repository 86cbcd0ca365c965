"""How much of the default policy's shortfall is learning step times, how much acceptance.

Runs ``dynspec-tuner bench`` (the rest of the command line, after ``--``) with the model
policy told part of the truth of the world it serves:

- ``--know cost``: every (bucket, arm)'s log step time is the world's expected step time at
  the bucket's mean batch size, with no spread. The policy never explores for step times and
  never misjudges them.
- ``--know acceptance``: the pooled accepted drafts per request-step of every arm are the
  workload's expectation at that moment (request-step weighted, as the oracle's), with no
  spread. The acceptance bands still learn from the counters.

The truth is the run's engine's: its cost profile, workload and clock. Traffic, scoring
and everything else are the bench's. A ceiling, not a policy: what stays
short of 98 % with the truth told is lost elsewhere (the other quantity, the bands,
exploration, a phase too short to settle in).

    .venv/bin/python benchmarks/told_truth.py --know cost -- --worlds 0-49 --policies model \\
        --seed 0 --jobs 2 --json cost-s0.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies import ModelPolicy
from policies._steptime import StepTimePosterior
from tuner.cli import main as cli_main
from tuner.sim.engine import Engine
from tuner.sim.oracle import workload_emitted
from tuner.sim.profiles import ProfileRangeError

KNOWABLE = ("cost", "acceptance")
_engine_init = Engine.__init__
_acceptance = ModelPolicy._acceptance
_engine: list[Engine] = []  # the engine of the run in progress (one at a time per process)


def _watched_init(self: Engine, *args: Any, **kw: Any) -> None:
    """Engine's own, then held as the run's truth: its profile, workload and clock (any
    subclass's too, such as the benchmarks' tracing engines)."""
    _engine_init(self, *args, **kw)
    _engine[:] = [self]


def _true_step_times(self: ModelPolicy) -> StepTimePosterior:
    prof = _engine[0].profile
    mean = np.zeros((len(self.buckets), len(self.arms)))
    for j in range(len(self.buckets)):
        for ai, k in enumerate(self.arms):
            try:
                mean[j, ai] = math.log(prof.step_s(max(1, round(self._rep_b(j))), k))
            except ProfileRangeError:  # a bucket past the table, where no batch runs
                mean[j, ai] = math.log(prof.step_s(prof.batch_sizes[-1], k))
    sd = np.full(mean.shape, 1e-4)
    chol = np.zeros((1, *mean.shape, len(self.arms)))
    return StepTimePosterior(mean, sd, 0.0, None, (1.0,), mean[None], chol)


def _true_acceptance(self: ModelPolicy) -> tuple[dict[int, float], dict[int, float]]:
    mean, sd = _acceptance(self)  # also fits the chain the policy's draws move along
    eng = _engine[0]
    for k in self.arms:
        if k > 0:
            mean[k] = workload_emitted(eng.workload, eng.profile.acceptance, k, t=eng.now) - 1.0
            sd[k] = 1e-4
    self._alpha = (self._alpha[0], 1e-4)
    return mean, sd


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    mine, rest = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--know", default="cost",
                    help=f"what the model policy is told: a list of {', '.join(KNOWABLE)}")
    a = ap.parse_args(mine)
    know = {x.strip() for x in a.know.split(",") if x.strip()}
    if not know or not know <= set(KNOWABLE):
        ap.error(f"--know takes a list of {', '.join(KNOWABLE)}, got {a.know!r}")
    patches = [mock.patch.object(Engine, "__init__", _watched_init)]
    if "cost" in know:
        patches.append(mock.patch.object(ModelPolicy, "_step_times", _true_step_times))
    if "acceptance" in know:
        patches.append(mock.patch.object(ModelPolicy, "_acceptance", _true_acceptance))
    for p in patches:  # the bench's worker processes fork from here, patched
        p.start()
    try:
        return cli_main(["bench", *rest])
    finally:
        for p in patches:
            p.stop()


if __name__ == "__main__":
    sys.exit(main())

"""How much of the default policy's shortfall is learning step times, how much acceptance.

Runs ``dynspec-tuner bench`` (the rest of the command line, after ``--``) with the model
policy told part of the truth of the world it serves:

- ``--know cost``: every (bucket, arm)'s log step time is the world's expected step time at
  the bucket's mean batch size, with no spread. The policy never explores for step times and
  never misjudges them.
- ``--know acceptance``: the pooled accepted drafts per request-step of every arm are the
  workload's expectation at that moment (request-step weighted, as the oracle's), with no
  spread. The acceptance bands still learn from the counters.

Traffic, scoring and everything else are the bench's. A ceiling, not a policy: what stays
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
from tuner import bench
from tuner.cli import main as cli_main
from tuner.sim.oracle import workload_emitted
from tuner.sim.profiles import ProfileRangeError

KNOWABLE = ("cost", "acceptance")
_build_policy = bench.build_policy
_step_times = ModelPolicy._step_times
_acceptance = ModelPolicy._acceptance
_now = [0.0]  # the engine's virtual time (one run at a time per process)


class _Engine(bench.Engine):
    def run_until(self, t: float) -> None:
        _now[0] = t
        super().run_until(t)


def _told(*args: Any, **kw: Any) -> Any:
    """The bench's policy, carrying the world's cost profile and workload."""
    pol = _build_policy(*args, **kw)
    pol._truth = (args[3], args[4])  # (profile, workload): build_policy's positionals
    return pol


def _true_step_times(self: ModelPolicy) -> StepTimePosterior:
    prof = self._truth[0]
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
    prof, wl = self._truth
    for k in self.arms:
        if k > 0:
            mean[k] = workload_emitted(wl, prof.acceptance, k, t=_now[0]) - 1.0
            sd[k] = 1e-4
    self._alpha = (self._alpha[0], 1e-4)
    return mean, sd


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    mine = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--know", default="cost",
                    help=f"what the model policy is told: a list of {', '.join(KNOWABLE)}")
    a = ap.parse_args(mine)
    know = {x.strip() for x in a.know.split(",") if x.strip()}
    if not know or not know <= set(KNOWABLE):
        ap.error(f"--know takes a list of {', '.join(KNOWABLE)}, got {a.know!r}")
    patches = [mock.patch.object(bench, "build_policy", _told),
               mock.patch.object(bench, "Engine", _Engine)]
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

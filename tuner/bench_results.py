"""What a bench run returns: per bucket, per load phase, per run and for the whole bench
(:mod:`tuner.bench` computes them and re-exports these names)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from policies import DEFAULT_POLICY
from tuner.bench_config import BenchConfig
from tuner.bench_targets import TargetCheck
from tuner.protocol import Table

__all__ = ["BenchResult", "BucketConvergence", "PhaseResult", "RunResult", "run_json"]


@dataclass(frozen=True)
class BucketConvergence:
    """How long a bucket took until its greedy decision stayed within 2 % of the oracle (or,
    when its two best arms are within 3 % of each other, ran only those;
    :mod:`tuner.bench_converge`).

    ``traffic_s`` counts interval ticks in which the bucket ran decode steps; ``steps`` its
    decode steps. Both are the worst over the bucket's converged episodes (a new episode
    starts when the workload's mix changes). ``unconverged_s`` is the most traffic an episode
    had while ending unconverged (0 when every episode converged): a bucket that saw a few
    seconds of a load ramp has not failed to converge, one that saw a minute has.
    """

    bucket: str
    traffic_s: float
    steps: int
    unconverged_s: float
    episodes: int


@dataclass(frozen=True)
class PhaseResult:
    """One load phase of one run. Percentages are of the per-bucket oracle (in [0, 100] but
    for banded tables, which may beat it) and ``pct_step_oracle*`` of the per-step oracle;
    the per-step oracle's headroom over the per-bucket one is :attr:`step_headroom`."""

    index: int
    start_s: float
    end_s: float
    concurrency: int | None
    pct_oracle: float  # after warm-up (NaN when no decode time was measured there)
    pct_oracle_all: float  # including warm-up
    goodput: float  # expected tokens per decode-busy second, whole phase
    goodput_after: float  # ... after warm-up
    oracle_goodput: float
    measured_goodput: float  # realised emitted tokens per busy second
    decode_busy_s: float
    explore_tokens_lost: float
    switches: int
    tpot_p50_ms: float
    tpot_p99_ms: float
    pct_step_oracle: float = math.nan  # after warm-up
    pct_step_oracle_all: float = math.nan  # including warm-up
    step_oracle_goodput: float = math.nan  # whole phase

    @property
    def step_headroom(self) -> float:
        """The per-step oracle's goodput over the per-bucket oracle's, whole phase."""
        return self.step_oracle_goodput / self.oracle_goodput


@dataclass(frozen=True)
class RunResult:
    """One (profile, workload, load, policy) run."""

    profile: str
    workload: str
    load: str
    policy: str
    seed: int
    phases: tuple[PhaseResult, ...]
    convergence: tuple[BucketConvergence, ...]
    pct_oracle: float
    pct_oracle_all: float
    explore_tokens_lost: float
    explore_pct: float  # tokens lost to exploration, % of the tokens the run produced
    switches: int
    final_table: Table
    notes: tuple[str, ...]
    wall_s: float
    pct_step_oracle: float = math.nan
    pct_step_oracle_all: float = math.nan

    @property
    def worst_convergence_s(self) -> float:
        """Traffic seconds of the slowest bucket: to converge, or spent unconverged."""
        return max((max(c.traffic_s, c.unconverged_s) for c in self.convergence), default=0.0)


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    runs: tuple[RunResult, ...]
    skipped: tuple[str, ...]
    wall_s: float
    checks: tuple[TargetCheck, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "default_policy": DEFAULT_POLICY,
            "wall_s": self.wall_s,
            "skipped": list(self.skipped),
            "targets": [asdict(c) for c in self.checks],
            "runs": [run_json(r) for r in self.runs],
        }


def run_json(r: RunResult) -> dict[str, Any]:
    out = asdict(r)
    out["final_table"] = [list(row) for row in r.final_table]
    out["worst_convergence_s"] = r.worst_convergence_s
    for fields in (out, *out["phases"]):  # JSON has no NaN (no time after warm-up)
        for key, value in fields.items():
            if isinstance(value, float) and not math.isfinite(value):
                fields[key] = None
    return out

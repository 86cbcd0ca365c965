"""The bench on generated worlds: how the policies hold on servers they were not built for.

Each world (:mod:`tuner.sim.worlds`) is one scenario — its own cost surface, traffic and
step-time noise — run once per policy under a load schedule shorter than the default bench's
(:data:`DEFAULT_WORLD_LOAD`), scored against the world's own oracle exactly as
:func:`tuner.bench.run_one` scores a shipped profile. The summary answers issue 13's targets:
the share of worlds where the default policy stays ≥ 98 % of the oracle after warm-up in
every load phase, whether any world falls below 95 %, the worst world with its parameters,
each policy's min / median over worlds, the tokens lost to exploration, and the default's
largest shortfall against the better of Thompson sampling and UCB in any phase.

Choose constants on one range of worlds and report on another (``--worlds 0-49`` and
``--worlds 50-99``): world ``i`` of a world seed is always the same world.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from policies import DEFAULT_POLICY
from tuner.bench import (
    DEFAULT_ARMS,
    DEFAULT_WARMUP_S,
    SGLANG_REAL,
    BenchConfig,
    RunResult,
    TargetCheck,
    _run_jobs,
    parse_policy_spec,
    sglang_available,
)
from tuner.bench_results import run_json
from tuner.errors import ConfigError
from tuner.sim._step_cost import MachineDrift
from tuner.sim.worlds import World, make_world

__all__ = [
    "BANDITS",
    "BANDIT_MARGIN",
    "DEFAULT_WORLD_LOAD",
    "DEFAULT_WORLD_POLICIES",
    "WORLD_FLOOR_PCT",
    "WORLD_TARGETS",
    "WORLD_TARGET_PCT",
    "WorldBenchConfig",
    "WorldBenchResult",
    "WorldSummary",
    "render_worlds",
    "run_worlds",
]

# 1 → 256 requests and back down in seven phases of 90 s (60 s scored after the default bench's
# 30 s warm-up, as in the default bench): 50 worlds × 3 policies take ~3 minutes on 2 cores.
DEFAULT_WORLD_LOAD = "90:1,90:4,90:16,90:64,90:256,90:16,90:2"
# What the targets compare: the default against the better of the two plain bandits.
DEFAULT_WORLD_POLICIES = tuple(dict.fromkeys(("thompson", "ucb", DEFAULT_POLICY)))
# Issue 13: >= 98 % after warm-up in every phase on >= 95 % of worlds, never below 95 %.
WORLD_TARGET_PCT = 98.0
WORLD_FLOOR_PCT = 95.0
WORLD_SHARE = 0.95
# "In no phase more than 1 point below the best of thompson and ucb."
BANDIT_MARGIN = 1.0
WORLD_EXPLORE_PCT = 2.0
WORLD_TARGETS = (
    ">= 98 % after warm-up in every phase on >= 95 % of worlds",
    "never below 95 % after warm-up",
    "<= 2 % of tokens lost to exploration in every world",
    "in no phase more than 1 point below the best of thompson and ucb",
)
BANDITS = ("thompson", "ucb")  # the plain bandits the default is held against


@dataclass(frozen=True, kw_only=True)
class WorldBenchConfig:
    """Which worlds and policies to run; the rest as :class:`tuner.bench.BenchConfig`."""

    worlds: tuple[int, ...]
    world_seed: int = 0
    load: str = DEFAULT_WORLD_LOAD
    policies: tuple[str, ...] = DEFAULT_WORLD_POLICIES
    seed: int = 0
    policy_seed: int | None = None
    arms: tuple[int, ...] = DEFAULT_ARMS
    warmup_s: float = DEFAULT_WARMUP_S
    skip_zero_draft_extend: bool = False
    machine_drift: MachineDrift | None = None
    jobs: int | None = None

    def __post_init__(self) -> None:
        if not self.worlds or min(self.worlds) < 0:
            raise ConfigError(f"worlds must be indices >= 0, got {self.worlds}")
        if self.world_seed < 0:
            raise ConfigError(f"world seed must be >= 0, got {self.world_seed}")
        # The shared checks: policies, arms, load, warm-up, jobs (raise ConfigError).
        BenchConfig(profiles=("world",), workloads=("world",), load=self.load,
                    policies=self.policies, seed=self.seed, policy_seed=self.policy_seed,
                    arms=self.arms, warmup_s=self.warmup_s, jobs=self.jobs)


@dataclass(frozen=True)
class WorldSummary:
    """One policy over every world (percentages of the oracle)."""

    policy: str
    worlds: int
    share_ok: float  # worlds >= 98 % after warm-up in every phase, fraction
    below_floor: int  # worlds with a phase < 95 % after warm-up
    worst_pct: float  # the lowest phase after warm-up over all worlds
    worst_world: int
    median_worst_pct: float  # median over worlds of each world's lowest phase
    mean_explore_pct: float
    max_explore_pct: float


@dataclass(frozen=True)
class WorldBenchResult:
    config: WorldBenchConfig
    worlds: tuple[World, ...]
    runs: tuple[RunResult, ...]  # run.profile is the world's name
    skipped: tuple[str, ...]
    wall_s: float

    def world_of(self, run: RunResult) -> World:
        return next(w for w in self.worlds if w.name == run.profile)

    def summaries(self) -> list[WorldSummary]:
        out = []
        for pol in dict.fromkeys(r.policy for r in self.runs):
            runs = [r for r in self.runs if r.policy == pol]
            worst = [(_worst(r), self.world_of(r).index) for r in runs]
            finite = [w for w, _ in worst if math.isfinite(w)]
            low, low_world = min(worst, key=lambda x: x[0] if math.isfinite(x[0]) else math.inf)
            out.append(WorldSummary(
                policy=pol, worlds=len(runs),
                share_ok=sum(w >= WORLD_TARGET_PCT for w in finite) / len(runs),
                below_floor=sum(w < WORLD_FLOOR_PCT for w in finite),
                worst_pct=low, worst_world=low_world,
                median_worst_pct=statistics.median(finite) if finite else math.nan,
                mean_explore_pct=statistics.fmean(r.explore_pct for r in runs),
                max_explore_pct=max(r.explore_pct for r in runs),
            ))
        return out

    def bandit_gap(self, policy: str = DEFAULT_POLICY) -> tuple[float, str, int]:
        """The default's largest shortfall (points) below the better of Thompson and UCB in
        any phase after warm-up, where it is, and how many phases fall short by more than
        :data:`BANDIT_MARGIN` (NaN, "" and 0 when those policies were not run)."""
        by = {(r.profile, parse_policy_spec(r.policy)[0]): r for r in self.runs}
        gap, where, over = -math.inf, "", 0
        for w in self.worlds:
            me = by.get((w.name, policy))
            others = [by[(w.name, b)] for b in BANDITS if (w.name, b) in by]
            if me is None or not others:
                continue
            for i, ph in enumerate(me.phases):
                ref = max((o.phases[i].pct_oracle for o in others
                           if math.isfinite(o.phases[i].pct_oracle)), default=math.nan)
                if not (math.isfinite(ref) and math.isfinite(ph.pct_oracle)):
                    continue
                d = ref - ph.pct_oracle
                over += d > BANDIT_MARGIN
                if d > gap:
                    gap, where = d, f"{w.name} phase {i} (c={ph.concurrency})"
        return (gap if math.isfinite(gap) else math.nan), where, over

    def checks(self, policy: str = DEFAULT_POLICY) -> list[TargetCheck]:
        """Issue 13's world targets for ``policy`` (empty when it was not run)."""
        mine = next((s for s in self.summaries() if s.policy == policy), None)
        if mine is None:
            return []
        gap, where, over = self.bandit_gap(policy)
        return [
            TargetCheck(WORLD_TARGETS[0], mine.share_ok >= WORLD_SHARE,
                        f"{100 * mine.share_ok:.0f}% of {mine.worlds}"),
            TargetCheck(WORLD_TARGETS[1], mine.below_floor == 0,
                        f"worst {mine.worst_pct:.1f} % on world-{mine.worst_world}"),
            TargetCheck(WORLD_TARGETS[2], mine.max_explore_pct <= WORLD_EXPLORE_PCT,
                        f"at most {mine.max_explore_pct:.2f}% "
                        f"(mean {mine.mean_explore_pct:.2f}%)"),
            TargetCheck(WORLD_TARGETS[3], None if not math.isfinite(gap) else over == 0,
                        "thompson and ucb not run" if not math.isfinite(gap)
                        else f"{over} phases over; worst {gap:+.1f} points at {where}"),
        ]

    def to_json(self) -> dict[str, Any]:
        runs = []
        for r in self.runs:
            d = run_json(r)
            d["world"] = self.world_of(r).index
            runs.append(d)
        summaries = [asdict(s) for s in self.summaries()]
        gap, where, over = self.bandit_gap()
        return {
            "config": asdict(self.config),
            "default_policy": DEFAULT_POLICY,
            "wall_s": self.wall_s,
            "skipped": list(self.skipped),
            "worlds": [{"index": w.index, "seed": w.seed, "description": w.describe(),
                        "params": w.params()} for w in self.worlds],
            "targets": [asdict(c) for c in self.checks()],
            "summary": {
                "policies": _finite(summaries),
                "bandit_gap": {"worst_points": _num(gap), "where": where,
                               "phases_over_margin": over},
            },
            "runs": runs,
        }


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _finite(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: _num(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def _worst(r: RunResult) -> float:
    vals = [ph.pct_oracle for ph in r.phases if math.isfinite(ph.pct_oracle)]
    return min(vals, default=math.nan)


def run_worlds(
    config: WorldBenchConfig, *, progress: Callable[[RunResult], None] | None = None
) -> WorldBenchResult:
    """Run every (world, policy) of ``config``; results in a fixed order (world, then policy),
    the same for any ``jobs``."""
    worlds = tuple(make_world(i, config.world_seed) for i in config.worlds)
    skipped: list[str] = []
    policies: Sequence[str] = list(config.policies)
    if SGLANG_REAL in policies and not sglang_available():
        policies = [p for p in policies if p != SGLANG_REAL]
        skipped.append(f"{SGLANG_REAL}: sglang is not importable here")
    jobs = [
        dict(profile=w.name, workload="generated", load=config.load, policy=pol,
             seed=config.seed, policy_seed=config.policy_seed, arms=config.arms,
             warmup_s=config.warmup_s, skip_zero_draft_extend=config.skip_zero_draft_extend,
             machine_drift=config.machine_drift, world=w)
        for w in worlds for pol in policies
    ]
    t0 = time.perf_counter()
    runs = _run_jobs(jobs, config.jobs, progress)
    return WorldBenchResult(config=config, worlds=worlds, runs=tuple(runs),
                            skipped=tuple(skipped), wall_s=time.perf_counter() - t0)


def render_worlds(result: WorldBenchResult, *, policy: str = DEFAULT_POLICY) -> list[str]:
    """The world bench as plain text lines (the CLI prints them)."""

    def pct(v: float) -> str:
        return "-" if not math.isfinite(v) else f"{v:.1f}"

    lines: list[str] = []
    by_world: dict[str, list[RunResult]] = {}
    for r in result.runs:
        by_world.setdefault(r.profile, []).append(r)
    for w in result.worlds:
        runs = by_world.get(w.name, [])
        if not runs:
            continue
        lines.append("")
        lines.append(w.describe())
        head = ["  policy"] + [f"c={ph.concurrency}" for ph in runs[0].phases]
        head += ["worst", "explore"]
        rows = [head]
        for r in runs:
            rows.append([f"  {r.policy} *" if r.policy == policy else f"  {r.policy}",
                         *(pct(ph.pct_oracle) for ph in r.phases), pct(_worst(r)),
                         f"{r.explore_pct:.2f}%"])
        lines.extend(_aligned(rows))
    lines.append("")
    lines.append(f"over {len(result.worlds)} worlds (seed {result.config.world_seed}; % of oracle "
                 "after warm-up; ok = >= 98 % in every phase):")
    rows = [["policy", "ok-share", "< 95 %", "min", "median-worst", "explore-mean",
             "explore-max", "worst world"]]
    for s in result.summaries():
        rows.append([f"{s.policy} *" if s.policy == policy else s.policy,
                     f"{100 * s.share_ok:.0f}%", str(s.below_floor), pct(s.worst_pct),
                     pct(s.median_worst_pct), f"{s.mean_explore_pct:.2f}%",
                     f"{s.max_explore_pct:.2f}%", f"world-{s.worst_world}"])
    lines.extend(_aligned(rows))
    mine = next((s for s in result.summaries() if s.policy == policy), None)
    if mine is not None:
        worst = make_world(mine.worst_world, result.config.world_seed)
        lines.append("")
        lines.append(f"targets for the default policy ({policy}, marked *):")
        for c in result.checks(policy):
            verdict = "n/a" if c.ok is None else "PASS" if c.ok else "FAIL"
            lines.append(f"  [{verdict}] {c.target}: {c.detail}")
        lines.append(f"  worst world: {worst.describe()}")
        lines.append(f"  its parameters: {_rounded(worst.params())}")
    for line in result.skipped:
        lines.append(f"skipped {line}")
    lines.append(f"{len(result.runs)} runs in {result.wall_s:.0f} s wall")
    return lines


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in rows]

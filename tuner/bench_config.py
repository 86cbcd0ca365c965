"""What a bench runs: its defaults, policy specs and :class:`BenchConfig` (validated up front).

Part of :mod:`tuner.bench`, which re-exports every public name here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policies import BasePolicy, make_policy
from tuner.config import _positive  # seconds: the run config's own check
from tuner.errors import ConfigError
from tuner.protocol import TreeShape
from tuner.sim._step_cost import MachineDrift
from tuner.sim.load import parse_load
from tuner.sim.oracle import workload_emitted
from tuner.sim.profiles import CostProfile
from tuner.sim.workloads import Workload

__all__ = [
    "DEFAULT_ARMS",
    "DEFAULT_BENCH_DECISION_PERIOD_S",
    "DEFAULT_BENCH_INTERVAL_S",
    "DEFAULT_BENCH_LOAD",
    "DEFAULT_BENCH_POLICIES",
    "DEFAULT_BENCH_PROFILES",
    "DEFAULT_BENCH_WORKLOADS",
    "DEFAULT_OPEN_LOOP_S",
    "DEFAULT_WARMUP_S",
    "SGLANG_REAL",
    "TREE_SKIPS",
    "BenchConfig",
    "parse_policy_spec",
    "tree_defaults",
]

# Two measured H200 tables (dense, MoE) and two fitted to published figures.
DEFAULT_BENCH_PROFILES = (
    "h200-llama8b", "h100-llama8b", "seed-kimi-pcie", "h200-moe-qwen3-30b-a3b"
)
# "shift" is rewritten per run to chat -> code -> hard in three equal parts of the schedule.
DEFAULT_BENCH_WORKLOADS = ("chat", "code", "hard", "shift")
# The concurrency sweep 1, 4, 16, 64, 256 and back.
DEFAULT_BENCH_LOAD = "90:1,90:4,90:16,90:64,90:256,90:64,90:16,90:4,90:1"
# sglang-real runs where sglang is importable and is skipped, saying so, elsewhere.
DEFAULT_BENCH_POLICIES = (
    "never", "threshold", "sglang-default", "sglang-real", "thompson", "ucb", "model", "optuna",
)
# SGLang's default adaptive union: every baseline's arms are built.
DEFAULT_ARMS = (0, 1, 3, 5, 7)
# As the daemon: read every second, decide every two.
DEFAULT_BENCH_INTERVAL_S = 1.0
DEFAULT_BENCH_DECISION_PERIOD_S = 2.0
# Seconds at the start of each load phase that "after warm-up" leaves out.
DEFAULT_WARMUP_S = 30.0
# Duration of open-loop loads (poisson, trace), which have no phases of their own.
DEFAULT_OPEN_LOOP_S = 600.0
SGLANG_REAL = "sglang-real"
# Policies a tree server cannot run: SGLang's adaptive mode (and so its default table) is
# top-k 1 only; a tree under the plugin has just the arms 0 and the tree.
TREE_SKIPS = {
    SGLANG_REAL: "SGLang's own adaptive mode refuses top-k > 1",
    "sglang-default": "SGLang's default adaptive config is for chains (top-k 1)",
}


# --- configuration ----------------------------------------------------------------------------


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name"`` or ``"name:key=value:key=value"`` -> ``(name, params)``.

    Values are read as int, float, None/true/false, or a comma list of ints; else a string.

    Raises:
        ConfigError: a parameter without ``=``.
    """
    name, *parts = spec.strip().split(":")
    params: dict[str, Any] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"policy {spec!r}: parameter {part!r} is not key=value")
        params[key.strip()] = _value(raw.strip())
    return name.strip(), params


def _value(raw: str) -> Any:
    low = raw.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    if "," in raw:
        try:
            return tuple(int(p) for p in raw.split(",") if p)
        except ValueError:
            pass
    return raw


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to run. Every (profile, workload, policy) triple is one run under ``load``.

    Attributes:
        profiles: profile names or files (:func:`tuner.sim.profiles.load_profile`).
        workloads: workload names (``shift`` = chat -> code -> hard over the schedule).
        load: a load schedule (:func:`tuner.sim.load.parse_load`).
        policies: policy specs ``name[:key=value...]``; ``sglang-real`` runs SGLang's own
            AdaptiveSpeculativeParams when sglang is importable (skipped otherwise).
        seed: seeds engines and policies alike.
        policy_seed: seeds the policies instead (the traffic stays ``seed``'s): two runs that
            differ only here differ by the policies' luck alone.
        arms: the arms the simulated server builds.
        interval_s, decision_period_s: the daemon's read and decision periods.
        warmup_s: the start of each load phase "after warm-up" leaves out.
        duration_s: run length for open-loop loads (closed loops run their schedule once).
        max_running: the running-request cap; default the profile's, else the schedule's peak.
        skip_zero_draft_extend: SGLang's ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``.
        machine_drift: the simulated machine's speed wanders (every arm alike; the scoring,
            by expectation, is unchanged): what a drifting server costs the policies.
        tree: a tree server (top-k > 1): ``arms`` must be ``(0, tree.steps)``, the arm
            ``steps`` runs the tree (:mod:`tuner.sim.tree`) and the oracle picks between the
            two; the policies of :data:`TREE_SKIPS` are skipped, and ``threshold`` switches
            the tree (its ``k`` defaults to ``tree.steps``), as the seed's patch did.
        jobs: worker processes (default: CPU count).
    """

    profiles: tuple[str, ...] = DEFAULT_BENCH_PROFILES
    workloads: tuple[str, ...] = DEFAULT_BENCH_WORKLOADS
    load: str = DEFAULT_BENCH_LOAD
    policies: tuple[str, ...] = DEFAULT_BENCH_POLICIES
    seed: int = 0
    policy_seed: int | None = None
    arms: tuple[int, ...] = DEFAULT_ARMS
    interval_s: float = DEFAULT_BENCH_INTERVAL_S
    decision_period_s: float = DEFAULT_BENCH_DECISION_PERIOD_S
    warmup_s: float = DEFAULT_WARMUP_S
    duration_s: float | None = None
    max_running: int | None = None
    skip_zero_draft_extend: bool = False
    machine_drift: MachineDrift | None = None
    tree: TreeShape | None = None
    jobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("profiles", "workloads", "policies"):
            if not getattr(self, name):
                raise ConfigError(f"bench needs at least one of --{name}")
        if not self.arms or min(self.arms) < 0:
            raise ConfigError(f"arms must be ints >= 0, got {self.arms}")
        _positive("interval_s", self.interval_s)
        _positive("decision_period_s", self.decision_period_s)
        if not (math.isfinite(self.warmup_s) and self.warmup_s >= 0):
            raise ConfigError(f"warmup_s must be >= 0, got {self.warmup_s!r}")
        if self.duration_s is not None:
            _positive("duration_s", self.duration_s)
        if self.max_running is not None and self.max_running < 1:
            raise ConfigError(f"max_running must be >= 1, got {self.max_running}")
        if self.jobs is not None and self.jobs < 1:
            raise ConfigError(f"jobs must be >= 1, got {self.jobs}")
        if self.tree is not None and tuple(sorted(set(self.arms))) != (0, self.tree.steps):
            raise ConfigError(f"a tree server's arms are 0 and its steps {self.tree.steps}, "
                              f"got {self.arms}")
        for spec in self.policies:
            name, params = parse_policy_spec(spec)
            if name == SGLANG_REAL or (self.tree is not None and name in TREE_SKIPS):
                continue
            try:  # fail before any run starts, naming the policy and parameter
                make_policy(name, arms=self.arms, **tree_defaults(name, params, self.tree))
            except ValueError as exc:
                raise ConfigError(f"policy {spec!r}: {exc}") from exc
        parse_load(self.load, seed=self.seed)  # raises ConfigError naming the bad part


def tree_defaults(name: str, params: dict[str, Any], tree: TreeShape | None) -> dict[str, Any]:
    """``params`` with a tree server's defaults: ``threshold`` switches the tree."""
    if tree is not None and name == "threshold" and "k" not in params:
        return {**params, "k": tree.steps}
    # sglang-default needs the workload's acceptance, which a run fills in; validation
    # here only checks the rest.
    return params


def build_policy(spec: str, arms: Sequence[int], seed: int, profile: CostProfile,
                 workload: Workload, tree: TreeShape | None = None) -> BasePolicy:
    """A bench run's policy from its spec, set up as the daemon would for the server."""
    name, params = parse_policy_spec(spec)
    params = tree_defaults(name, params, tree)
    if name == "sglang-default" and "alpha" not in params and "mean_accepted" not in params:
        # The arm SGLang's EMA settles on follows from the workload's mean accepted drafts.
        params["mean_accepted"] = tuple(
            (k, min(max(workload_emitted(workload, profile.acceptance, k) - 1.0, 0.0), k))
            for k in sorted({0, 1, 3, 5, 7} | set(arms))
        )
    pol = make_policy(name, arms=arms, seed=seed, **params)
    if tree is not None:  # as the daemon does from a tree server's readout
        pol.set_verify_tokens({tree.steps: tree.draft_tokens})
    return pol

"""The sweep's settings: the defaults, the study's arm encoding and :class:`SweepConfig`."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from optuna.distributions import BaseDistribution, IntDistribution

from tuner.config import DEFAULT_SWEEP_LEVELS as DEFAULT_LEVELS
from tuner.config import DEFAULT_SWEEP_PER_LEVEL_S as DEFAULT_PER_LEVEL_S
from tuner.config import DEFAULT_SWEEP_WARMUP_S as DEFAULT_WARMUP_S
from tuner.errors import ConfigError


# A window is measured in this many steps; after each one Optuna may prune it.
DEFAULT_STEPS = 6
# Steps before any early decision: one step alone says little about the spread.
DEFAULT_MIN_STEPS = 2
# Two arms within 2 % are as good as each other (the acceptance bar against the oracle).
DEFAULT_TOLERANCE = 0.02
# Confidence multiplier on standard errors for every decision (prune, skip, resolve).
DEFAULT_Z = 2.0
# An arm is ruled out at other levels only if it lost by at least this much.
DEFAULT_SKIP_MARGIN = 0.05
# A window stops early once its relative standard error is this small.
DEFAULT_PRECISION = 0.01
# Re-measurements of one cell before its level is called resolved anyway.
DEFAULT_MAX_WINDOWS_PER_CELL = 3
# When a window has too few completions to estimate its spread, assume this relative error.
FALLBACK_REL_SE = 0.03
# A window without any completed request is extended up to this many times its step count.
_MAX_EXTENSION = 3

# The study's "arm" parameter: k >= 0 pins arm k; TABLE_ARM measures the learned table.
TABLE_ARM = -1
_LEVEL_DIST = IntDistribution(1, 65536, log=True)
_ARM_DIST = IntDistribution(TABLE_ARM, 64)
_DISTRIBUTIONS: dict[str, BaseDistribution] = {"concurrency": _LEVEL_DIST, "arm": _ARM_DIST}
_MEASUREMENT_ATTR = "measurement"
_RUNNING_SE_ATTR = "running_se"

Cell = tuple[int, int]


def _arm_label(arm: int) -> str:
    return "table" if arm == TABLE_ARM else f"k={arm}"


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """What to measure and how carefully.

    Args:
        levels: concurrency levels, distinct, >= 1.
        arms: arms to measure; None = every arm the server built.
        per_level_s: longest measured window per (level, arm), seconds.
        steps: steps per window (Optuna sees one intermediate value per step).
        min_steps: steps before a window may stop early (pruned or precise enough).
        warmup_s: load after a switch before the window opens.
        max_trials: at most this many measured trials in the study (resumed ones count).
        exhaustive: measure every cell once, no skipping or pruning (the hand-drawn grid).
        table_pass: measure the learned table at every level at the end.
        tolerance: arms within this fraction of the best count as equally good.
        z: confidence multiplier for every decision.
        skip_margin: how much an arm must lose by before other levels skip it.
        precision: relative standard error at which a window stops early.
        max_windows_per_cell: re-measurements of one cell before giving up on separating it.
        study_name: the Optuna study; the same name resumes a sweep.
    """

    levels: tuple[int, ...] = DEFAULT_LEVELS
    arms: tuple[int, ...] | None = None
    per_level_s: float = DEFAULT_PER_LEVEL_S
    steps: int = DEFAULT_STEPS
    min_steps: int = DEFAULT_MIN_STEPS
    warmup_s: float = DEFAULT_WARMUP_S
    max_trials: int | None = None
    exhaustive: bool = False
    table_pass: bool = True
    tolerance: float = DEFAULT_TOLERANCE
    z: float = DEFAULT_Z
    skip_margin: float = DEFAULT_SKIP_MARGIN
    precision: float = DEFAULT_PRECISION
    max_windows_per_cell: int = DEFAULT_MAX_WINDOWS_PER_CELL
    study_name: str = "sweep"

    def __post_init__(self) -> None:
        levels = tuple(sorted({int(c) for c in self.levels}))
        if not levels or levels[0] < 1 or levels[-1] > _LEVEL_DIST.high:
            raise ConfigError(
                f"concurrency levels must be integers in 1..{_LEVEL_DIST.high}, got "
                f"{list(self.levels)}"
            )
        object.__setattr__(self, "levels", levels)
        if self.arms is not None:
            arms = tuple(sorted({int(a) for a in self.arms}))
            if not arms or arms[0] < 0 or arms[-1] > _ARM_DIST.high:
                raise ConfigError(f"arms must be integers in 0..{_ARM_DIST.high}, got {self.arms}")
            object.__setattr__(self, "arms", arms)
        for name in ("per_level_s", "warmup_s", "z"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0) or (name != "warmup_s" and value == 0):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        for name in ("tolerance", "skip_margin", "precision"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value < 1):
                raise ConfigError(f"{name} must be in [0, 1), got {value!r}")
        if self.steps < 1 or not 1 <= self.min_steps <= self.steps:
            raise ConfigError(
                f"need 1 <= min_steps <= steps, got min_steps={self.min_steps}, steps={self.steps}"
            )
        if self.max_trials is not None and self.max_trials < 1:
            raise ConfigError(f"max_trials must be >= 1, got {self.max_trials}")
        if self.max_windows_per_cell < 1:
            raise ConfigError("max_windows_per_cell must be >= 1")
        if not self.study_name.strip():
            raise ConfigError("study name must not be empty")

    @property
    def step_s(self) -> float:
        return self.per_level_s / self.steps


def default_study_name(
    server: str, *, endpoint: str, max_tokens: int, prompts: Sequence[str]
) -> str:
    """The study a sweep resumes by default: same server, endpoint, length and prompts."""
    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:10]
    return f"sweep:{server}:{endpoint}:{max_tokens}:{digest}"

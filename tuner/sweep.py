"""``dynspec-tuner sweep``: throughput by concurrency level and arm, the experiment operators
otherwise run by hand, with Optuna deciding what to measure next and for how long.

One *cell* is a (concurrency level, arm) pair: the server's table is pinned to that arm
(a one-row table pushed through the plugin's update path) while :class:`~tuner.loadgen.
ClosedLoop` keeps exactly ``level`` requests in flight; after a warm-up the client measures
output tokens/s and time per output token, and the plugin's counters give the server's own
goodput for the same window. A last pass measures the *learned table* (best arm per level,
as a per-batch table) at every level.

How Optuna drives it (one study per sweep, in the ``--db`` database, so ``optuna-dashboard``
shows every trial with its ``concurrency`` and ``arm`` parameters and its per-step values):

- :class:`SweepSampler` picks the next cell. It measures levels from low to high, trying the
  arm most likely to win first (the neighbouring level's winner), and *skips* arms the
  measurements already rule out: draft steps cost more the larger the batch, so an arm that
  clearly lost to a smaller one at some level also loses at every higher level, and one that
  clearly beat a smaller one wins at every lower level too. Once every level has its arms,
  it re-measures levels whose winner is not yet clear (another arm might still be more than
  ``tolerance`` better), then the learned table. ``exhaustive=True`` measures the full grid.
- :class:`RacePruner` decides how long a window runs: each trial reports its running
  tokens/s after every step, and an arm whose upper confidence bound falls below the level's
  best lower bound is pruned. A window that is precise enough stops early too.

The decision logic itself is pure (:class:`Planner`), so it is tested with a fake clock and a
fake server; :class:`Sweep` is the async driver (ask, pin, measure, tell, restore).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import textwrap
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.distributions import BaseDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from storage import redact_url
from tuner.config import DEFAULT_SWEEP_LEVELS as DEFAULT_LEVELS
from tuner.config import DEFAULT_SWEEP_PER_LEVEL_S as DEFAULT_PER_LEVEL_S
from tuner.config import DEFAULT_SWEEP_WARMUP_S as DEFAULT_WARMUP_S
from tuner.errors import (
    ConfigError,
    DynspecError,
    PluginMissingError,
    StorageError,
    UpdateRejectedError,
)
from tuner.loadgen import ClosedLoop, WindowStats
from tuner.protocol import CounterRow, Table, format_table, table_to_json, validate_table
from tuner.protocol import counter_deltas as protocol_counter_deltas

__all__ = [
    "DEFAULT_LEVELS",
    "DEFAULT_PER_LEVEL_S",
    "DEFAULT_PRECISION",
    "DEFAULT_SKIP_MARGIN",
    "DEFAULT_STEPS",
    "DEFAULT_TOLERANCE",
    "DEFAULT_WARMUP_S",
    "TABLE_ARM",
    "ArmControl",
    "CellEstimate",
    "LiveMeasurer",
    "Measurement",
    "Measurer",
    "Planner",
    "PluginArmControl",
    "RacePruner",
    "ServerSetup",
    "ServerWindow",
    "Sweep",
    "SweepConfig",
    "SweepEvent",
    "SweepResult",
    "SweepSampler",
    "default_study_name",
    "measurements_from_study",
    "open_study",
    "plot_png",
    "render_text",
]

log = logging.getLogger(__name__)

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


# --- configuration --------------------------------------------------------------------------


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


# --- measurements ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerWindow:
    """The plugin's counters over one window (deltas, all DP replicas summed).

    ``busy_s`` is the server's decode time (launch to launch), so ``goodput`` is emitted
    tokens per busy second — the daemon's reward, free of client and prefill time.
    """

    decode_steps: int
    emitted_tokens: int
    accepted_drafts: int
    drafted_tokens: int
    busy_s: float
    batch_steps: int  # Σ b over decode steps (mean batch = batch_steps / decode_steps)
    steps_by_arm: dict[int, int] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.emitted_tokens / self.busy_s if self.busy_s > 0 else math.nan

    def __add__(self, other: ServerWindow) -> ServerWindow:
        by_arm = dict(self.steps_by_arm)
        for k, v in other.steps_by_arm.items():
            by_arm[k] = by_arm.get(k, 0) + v
        return ServerWindow(
            self.decode_steps + other.decode_steps,
            self.emitted_tokens + other.emitted_tokens,
            self.accepted_drafts + other.accepted_drafts,
            self.drafted_tokens + other.drafted_tokens,
            self.busy_s + other.busy_s,
            self.batch_steps + other.batch_steps,
            by_arm,
        )

    @property
    def mean_batch(self) -> float:
        return self.batch_steps / self.decode_steps if self.decode_steps else math.nan

    @property
    def accept_rate(self) -> float:
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "decode_steps": self.decode_steps,
            "emitted_tokens": self.emitted_tokens,
            "accepted_drafts": self.accepted_drafts,
            "drafted_tokens": self.drafted_tokens,
            "busy_s": self.busy_s,
            "batch_steps": self.batch_steps,
            "steps_by_arm": {str(k): v for k, v in sorted(self.steps_by_arm.items())},
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ServerWindow:
        return cls(
            decode_steps=int(obj["decode_steps"]),
            emitted_tokens=int(obj["emitted_tokens"]),
            accepted_drafts=int(obj["accepted_drafts"]),
            drafted_tokens=int(obj["drafted_tokens"]),
            busy_s=float(obj["busy_s"]),
            batch_steps=int(obj["batch_steps"]),
            steps_by_arm={int(k): int(v) for k, v in obj.get("steps_by_arm", {}).items()},
        )

    @classmethod
    def from_deltas(cls, deltas: Iterable[CounterRow]) -> ServerWindow:
        """Totals of per-``(b, k)`` deltas (see :func:`counter_deltas`)."""
        steps = emitted = accepted = drafted = batch = 0
        busy = 0.0
        by_arm: dict[int, int] = {}
        for d in deltas:
            steps += d.decode_steps
            emitted += d.emitted_tokens
            accepted += d.accepted_drafts
            drafted += d.drafted_tokens
            busy += d.busy_s
            batch += d.b * d.decode_steps
            by_arm[d.k] = by_arm.get(d.k, 0) + d.decode_steps
        return cls(steps, emitted, accepted, drafted, busy, batch, by_arm)


@dataclass(frozen=True)
class CounterSnapshot:
    """The plugin's cumulative counters, all DP replicas summed, and each replica's start."""

    started_at: tuple[float, ...]
    rows: dict[tuple[int, int], CounterRow]


def counter_deltas(before: CounterSnapshot, after: CounterSnapshot) -> list[CounterRow] | None:
    """Per-``(b, k)`` counters accrued between two snapshots (rows with steps only); None if
    the server restarted in between (a new start time, or a counter that went backwards)."""
    if before.started_at != after.started_at:
        return None
    deltas = protocol_counter_deltas(before.rows.values(), after.rows.values())
    return None if deltas is None else list(deltas)


@dataclass(frozen=True)
class Measurement:
    """One measured window of one cell (what a trial stores in its ``measurement`` attr)."""

    level: int
    arm: int
    window_s: float
    requests: int
    output_tokens: int
    tok_s: float
    tok_s_se: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    avg_in_flight: float
    errors: int = 0
    server: ServerWindow | None = None
    pruned: bool = False
    table: Table | None = None
    trial: int | None = None

    @classmethod
    def from_window(
        cls,
        level: int,
        arm: int,
        stats: WindowStats,
        server: ServerWindow | None,
        *,
        pruned: bool = False,
        table: Table | None = None,
    ) -> Measurement:
        return cls(
            level=level,
            arm=arm,
            window_s=stats.duration,
            requests=stats.requests,
            output_tokens=stats.output_tokens,
            tok_s=stats.tok_s,
            tok_s_se=stats.tok_s_se,
            tpot_p50_ms=stats.tpot_p50_s * 1e3,
            tpot_p99_ms=stats.tpot_p99_s * 1e3,
            avg_in_flight=stats.avg_in_flight,
            errors=stats.errors,
            server=server,
            pruned=pruned,
            table=table,
        )

    def to_json(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "level": self.level,
            "arm": self.arm,
            "window_s": self.window_s,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "tok_s": num(self.tok_s),
            "tok_s_se": num(self.tok_s_se),
            "tpot_p50_ms": num(self.tpot_p50_ms),
            "tpot_p99_ms": num(self.tpot_p99_ms),
            "avg_in_flight": self.avg_in_flight,
            "errors": self.errors,
            "server": None if self.server is None else self.server.to_json(),
            "pruned": self.pruned,
            "table": None if self.table is None else table_to_json(self.table),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, trial: int | None = None) -> Measurement:
        def num(x: object) -> float:
            return math.nan if x is None else float(x)  # type: ignore[arg-type]

        table = obj.get("table")
        return cls(
            level=int(obj["level"]),
            arm=int(obj["arm"]),
            window_s=float(obj["window_s"]),
            requests=int(obj["requests"]),
            output_tokens=int(obj["output_tokens"]),
            tok_s=num(obj.get("tok_s")),
            tok_s_se=num(obj.get("tok_s_se")),
            tpot_p50_ms=num(obj.get("tpot_p50_ms")),
            tpot_p99_ms=num(obj.get("tpot_p99_ms")),
            avg_in_flight=float(obj.get("avg_in_flight", 0.0)),
            errors=int(obj.get("errors", 0)),
            server=None if obj.get("server") is None else ServerWindow.from_json(obj["server"]),
            pruned=bool(obj.get("pruned", False)),
            table=None if table is None else validate_table(table),
            trial=trial,
        )


@dataclass(frozen=True)
class CellEstimate:
    """Everything measured for one cell, pooled (windows weighted by their length)."""

    level: int
    arm: int
    mean: float
    se: float  # NaN when no window could estimate its spread
    windows: int
    window_s: float
    pruned: bool  # every window of it was cut short by the pruner
    last: Measurement
    server: ServerWindow | None = None  # the plugin's counters, summed over the windows

    def se_or_fallback(self) -> float:
        return self.se if math.isfinite(self.se) and self.se > 0 else FALLBACK_REL_SE * self.mean

    @classmethod
    def pool(cls, ms: Sequence[Measurement]) -> CellEstimate:
        usable = [m for m in ms if math.isfinite(m.tok_s)]
        last = ms[-1]
        if not usable:
            return cls(last.level, last.arm, math.nan, math.nan, 0, 0.0, False, last)
        w = [max(m.window_s, 1e-9) for m in usable]
        total = sum(w)
        mean = sum(wi * m.tok_s for wi, m in zip(w, usable, strict=True)) / total
        if all(math.isfinite(m.tok_s_se) for m in usable):
            sq = sum((wi * m.tok_s_se) ** 2 for wi, m in zip(w, usable, strict=True))
            se = math.sqrt(sq) / total
        elif len(usable) >= 2:
            spread = math.sqrt(sum((m.tok_s - mean) ** 2 for m in usable) / (len(usable) - 1))
            se = spread / math.sqrt(len(usable))
        else:
            se = math.nan
        server = None
        for m in usable:
            if m.server is not None:
                server = m.server if server is None else server + m.server
        return cls(
            last.level,
            last.arm,
            mean,
            se,
            len(usable),
            sum(m.window_s for m in usable),
            all(m.pruned for m in usable),
            usable[-1],
            server,
        )


def _sigma_diff(a: CellEstimate, b: CellEstimate) -> float:
    return math.hypot(a.se_or_fallback(), b.se_or_fallback())


# --- the decision logic (pure) --------------------------------------------------------------


@dataclass(frozen=True)
class LevelStatus:
    """Where one level stands: measured and pending arms, arms skipped and why."""

    level: int
    measured: tuple[int, ...]
    pending: tuple[int, ...]
    skipped: dict[int, str]
    best: int | None
    resolved: bool


class Planner:
    """Decides the next cell from what has been measured (pure; see the module docstring).

    Args:
        config: the sweep's configuration (levels, tolerances, exhaustive).
        arms: the arms to measure (the server's, filtered by ``config.arms``).
    """

    def __init__(self, config: SweepConfig, arms: Iterable[int]) -> None:
        self.config = config
        self.levels = config.levels
        self.arms = tuple(sorted(set(arms)))
        if not self.arms:
            raise ConfigError("no arms to measure")

    # -- estimates --

    def estimates(self, ms: Iterable[Measurement]) -> dict[Cell, CellEstimate]:
        """Pool measurements per cell (table cells only for the current learned table)."""
        by_cell: dict[Cell, list[Measurement]] = {}
        for m in ms:
            if m.level in self.levels and (m.arm in self.arms or m.arm == TABLE_ARM):
                by_cell.setdefault((m.level, m.arm), []).append(m)
        out = {cell: CellEstimate.pool(v) for cell, v in by_cell.items() if cell[1] != TABLE_ARM}
        out = {cell: e for cell, e in out.items() if math.isfinite(e.mean)}
        table = self.learned_table(out)
        for cell, v in by_cell.items():
            if cell[1] == TABLE_ARM and table is not None:
                same = [m for m in v if m.table == table]
                if same:
                    est = CellEstimate.pool(same)
                    if math.isfinite(est.mean):
                        out[cell] = est
        return out

    def best_arm(self, est: Mapping[Cell, CellEstimate], level: int) -> int | None:
        """The measured arm with the highest pooled tokens/s at ``level``."""
        cands = [(e.mean, -e.arm, e.arm) for (lv, a), e in est.items() if lv == level and a >= 0]
        return max(cands)[2] if cands else None

    def learned_table(self, est: Mapping[Cell, CellEstimate]) -> Table | None:
        """Best arm per measured level as a per-batch table (level ``c`` covers batch sizes
        above the previous level up to ``c``; the last row takes everything larger)."""
        rows: list[tuple[int | None, int]] = []
        for level in self.levels:
            arm = self.best_arm(est, level)
            if arm is None:
                continue
            if rows and rows[-1][1] == arm:
                rows[-1] = (level, arm)
            else:
                rows.append((level, arm))
        if not rows:
            return None
        rows[-1] = (None, rows[-1][1])
        return validate_table(rows, self.arms)

    # -- decisions --

    def _beats(self, win: CellEstimate, lose: CellEstimate) -> bool:
        """``win`` is clearly and substantially better than ``lose``."""
        return win.mean >= lose.mean * (1 + self.config.skip_margin) and (
            win.mean - lose.mean >= self.config.z * _sigma_diff(win, lose)
        )

    def skipped(self, est: Mapping[Cell, CellEstimate], level: int) -> dict[int, str]:
        """Arms not worth measuring at ``level``, with the measurement that rules each out."""
        if self.config.exhaustive:
            return {}
        out: dict[int, str] = {}
        for arm in self.arms:
            if (level, arm) in est:
                continue
            for other in self.levels:
                if other == level or (other, arm) not in est:
                    continue
                lose = est[(other, arm)]
                # Lost to a smaller arm at a lower level -> loses higher up; lost to a
                # larger arm at a higher level -> loses lower down.
                rivals = [a for a in self.arms if (a < arm if other < level else a > arm)]
                for rival in rivals:
                    win = est.get((other, rival))
                    if win is not None and self._beats(win, lose):
                        out[arm] = f"lost to k={rival} at concurrency {other}"
                        break
                if arm in out:
                    break
        return out

    def _predicted_best(self, est: Mapping[Cell, CellEstimate], level: int) -> int:
        lower = [lv for lv in self.levels if lv < level and self.best_arm(est, lv) is not None]
        higher = [lv for lv in self.levels if lv > level and self.best_arm(est, lv) is not None]
        if lower:
            return self.best_arm(est, lower[-1])  # type: ignore[return-value]
        if higher:
            return self.best_arm(est, higher[0])  # type: ignore[return-value]
        return self.arms[len(self.arms) // 2]

    def _unclear(self, est: Mapping[Cell, CellEstimate], level: int) -> list[CellEstimate]:
        """Measured arms at ``level`` that might still beat the best by more than tolerance."""
        best = self.best_arm(est, level)
        if best is None:
            return []
        b = est[(level, best)]
        out = []
        for (lv, arm), e in est.items():
            if lv != level or arm < 0 or arm == best:
                continue
            if e.pruned:
                continue  # pruned = separated from the leader at the time
            if e.mean + self.config.z * _sigma_diff(e, b) > b.mean * (1 + self.config.tolerance):
                out.append(e)
        return out

    def status(self, ms: Iterable[Measurement]) -> list[LevelStatus]:
        """Per level: measured, pending and skipped arms, best so far, resolved or not."""
        est = self.estimates(ms)
        out = []
        for level in self.levels:
            skipped = self.skipped(est, level)
            measured = tuple(a for a in self.arms if (level, a) in est)
            pending = tuple(a for a in self.arms if a not in measured and a not in skipped)
            out.append(
                LevelStatus(
                    level=level,
                    measured=measured,
                    pending=pending,
                    skipped=skipped,
                    best=self.best_arm(est, level),
                    resolved=not pending and not self._refine_cell(est, level),
                )
            )
        return out

    def _refine_cell(self, est: Mapping[Cell, CellEstimate], level: int) -> Cell | None:
        if self.config.exhaustive:
            return None
        unclear = self._unclear(est, level)
        if not unclear:
            return None
        best = est[(level, self.best_arm(est, level))]  # type: ignore[index]
        # Re-measure the noisier side of the closest contest that still has windows left.
        rival = max(unclear, key=lambda e: e.mean)
        for e in sorted((best, rival), key=lambda e: -e.se_or_fallback() / max(e.mean, 1e-9)):
            if e.windows < self.config.max_windows_per_cell:
                return (level, e.arm)
        return None

    def next_cell(self, ms: Iterable[Measurement]) -> Cell | None:
        """The next cell to measure, or None when the sweep is done."""
        ms = list(ms)
        est = self.estimates(ms)
        # 1. Every level gets its candidate arms, low levels first, likely winner first.
        for level in self.levels:
            skipped = self.skipped(est, level)
            pending = [a for a in self.arms if (level, a) not in est and a not in skipped]
            if pending:
                pred = self.arms.index(self._predicted_best(est, level))
                # Ties go to the smaller arm: higher levels favour fewer draft steps.
                pending.sort(key=lambda a: (abs(self.arms.index(a) - pred), a))
                return (level, pending[0])
        # 2. Levels whose winner is not clear yet.
        for level in self.levels:
            cell = self._refine_cell(est, level)
            if cell is not None:
                return cell
        # 3. The learned table, where it mixes arms (a one-row table is just that arm).
        table = self.learned_table(est)
        if self.config.table_pass and table is not None and len(table) > 1:
            for level in self.levels:
                if (level, TABLE_ARM) not in est:
                    return (level, TABLE_ARM)
        return None


# --- Optuna glue ----------------------------------------------------------------------------


def measurements_from_study(study: optuna.Study) -> list[Measurement]:
    """Every stored window of a sweep study (complete and pruned trials), oldest first."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        raw = t.user_attrs.get(_MEASUREMENT_ATTR)
        if raw is None:
            continue
        try:
            out.append(Measurement.from_json(raw, trial=t.number))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("study %s trial %d: unreadable measurement skipped: %s",
                        study.study_name, t.number, exc)
    return out


class SweepSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler whose suggestion is :meth:`Planner.next_cell` over the study's trials.

    Deterministic: the same stored measurements give the same next cell, which is what makes
    a resumed sweep skip what was measured.
    """

    def __init__(
        self,
        planner: Planner,
        *,
        measurements: Callable[[optuna.Study], list[Measurement]] = measurements_from_study,
    ) -> None:
        self.planner = planner
        self.measurements = measurements

    def next_cell(self, study: optuna.Study) -> Cell | None:
        return self.planner.next_cell(self.measurements(study))

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return dict(_DISTRIBUTIONS)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        cell = self.next_cell(study)
        if cell is None:
            # Asked after the plan ran out (only by a caller that ignores next_cell): repeat
            # the most informative cell rather than invent one.
            cell = (self.planner.levels[0], self.planner.arms[0])
        return {"concurrency": cell[0], "arm": cell[1]}

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        raise ValueError(f"the sweep sampler only samples concurrency and arm, not {param_name!r}")


class RacePruner(optuna.pruners.BasePruner):
    """Prunes a window whose arm is clearly behind the best measured arm at its level.

    "Clearly": the trial's running tokens/s plus ``z`` standard errors of the difference is
    still below the leader's pooled mean. Table windows are never pruned.
    """

    def __init__(
        self,
        planner: Planner,
        *,
        measurements: Callable[[optuna.Study], list[Measurement]] = measurements_from_study,
    ) -> None:
        self.planner = planner
        self.measurements = measurements

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        cfg = self.planner.config
        if cfg.exhaustive or len(trial.intermediate_values) < cfg.min_steps:
            return False
        level, arm = trial.params.get("concurrency"), trial.params.get("arm")
        if level is None or arm is None or arm == TABLE_ARM:
            return False
        value = trial.intermediate_values[max(trial.intermediate_values)]
        if not math.isfinite(value):
            return False
        se = trial.user_attrs.get(_RUNNING_SE_ATTR)
        se = float(se) if isinstance(se, (int, float)) and math.isfinite(se) else math.nan
        done = [
            m
            for m in self.measurements(study)
            if m.level == level and m.arm != arm and m.arm != TABLE_ARM and not m.pruned
        ]
        est = self.planner.estimates(done)
        leader = self.planner.best_arm(est, level)
        if leader is None:
            return False
        lead = est[(level, leader)]
        mine = CellEstimate(level, arm, value, se, 1, 0.0, False, lead.last)
        return value + cfg.z * _sigma_diff(mine, lead) < lead.mean


def open_study(
    db_url: str,
    name: str,
    *,
    planner: Planner,
    attrs: Mapping[str, Any] | None = None,
    measurements: Callable[[optuna.Study], list[Measurement]] = measurements_from_study,
) -> optuna.Study:
    """Create or load the sweep's study; fail trials a killed run left RUNNING.

    ``attrs`` (endpoint, max tokens, prompts digest ...) are stored on a new study and must
    match on an existing one, so a resumed sweep never pools incomparable windows.

    Raises:
        StorageError: the database cannot be opened.
        ConfigError: the study exists with different settings.
    """
    try:
        storage = optuna.storages.RDBStorage(db_url)
        if storage.engine.name == "sqlite":
            _sqlite_like_storage(storage.engine)
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            sampler=SweepSampler(planner, measurements=measurements),
            pruner=RacePruner(planner, measurements=measurements),
            direction="maximize",
            load_if_exists=True,
        )
    except (optuna.exceptions.StorageInternalError, ImportError, ValueError) as exc:
        raise StorageError(f"cannot open the sweep database {redact_url(db_url)}: {exc}") from exc
    except Exception as exc:  # SQLAlchemy errors on a bad URL or an unwritable file
        if type(exc).__module__.startswith("sqlalchemy"):
            raise StorageError(
                f"cannot open the sweep database {redact_url(db_url)}: {exc}"
            ) from exc
        raise
    stored = study.user_attrs
    for key, value in (attrs or {}).items():
        if key in stored and stored[key] != value:
            raise ConfigError(
                f"study {name!r} was measured with {key}={stored[key]!r}, this sweep has "
                f"{key}={value!r}; name another study (--study) to start afresh"
            )
        if key not in stored:
            study.set_user_attr(key, value)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        log.info("study %s: trial %d was left running by an interrupted sweep; marking it failed",
                 name, t.number)
        storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
    return study


def _sqlite_like_storage(engine: Any) -> None:
    """Open the study's SQLite file as :mod:`storage` opens the history (they may share it):
    WAL, so the daemon's reads and the sweep's writes do not block each other, and
    ``synchronous=NORMAL``, so each step's few small commits cost no fsync."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        try:
            cur.execute("PRAGMA busy_timeout=10000")
            if engine.url.database and engine.url.database != ":memory:":
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
        finally:
            cur.close()

    engine.dispose()  # connections opened while Optuna created its tables lack the pragmas


# --- the server side ------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSetup:
    """What the sweep can do on this server.

    ``pinnable`` False means stock SGLang (no plugin): only ``arms[0]``, the configured arm,
    is measured, and ``note`` says so.
    """

    arms: tuple[int, ...]
    pinnable: bool
    note: str | None = None


class ArmControl(Protocol):
    """Pins the server's table and reads its counters (synchronous; run in a thread)."""

    def setup(self) -> ServerSetup: ...

    def pin(self, table: Table) -> None: ...

    def counters(self) -> CounterSnapshot | None: ...

    def restore(self) -> None: ...


class PluginArmControl:
    """:class:`ArmControl` over :class:`~tuner.client.SGLangClient` (the plugin's update path).

    Each pin pushes a table with a version above every replica's current one; ``restore``
    pushes back the table the server ran before the sweep (with a yet higher version). On
    stock SGLang it measures the configured arm only.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._original: Table | None = None
        self._version = 0
        self._pinned = False

    def setup(self) -> ServerSetup:
        try:
            states = self.client.read_state()
        except PluginMissingError:
            info = self.client.server_info()
            arm = _configured_arm(info)
            what = f"the configured arm (k={arm})"
            if info.get("speculative_adaptive") and arm > 0:
                what = (f"SGLang's own adaptive choice (--speculative-adaptive; shown as k={arm}, "
                        "its startup steps)")
            return ServerSetup(
                arms=(arm,),
                pinnable=False,
                note=(
                    f"{self.client.address}: stock SGLang (no dynspec plugin): measuring only "
                    f"{what}; install the plugin to compare arms"
                ),
            )
        self._original = states[0].table
        self._version = max(s.policy_version for s in states)
        arms = set(states[0].arms)
        for s in states[1:]:
            arms &= set(s.arms)
        return ServerSetup(arms=tuple(sorted(arms)), pinnable=True)

    def pin(self, table: Table) -> None:
        self._version += 1
        reply = self.client.push(table, self._version)
        if not all(reply):
            # A replica refused (e.g. its version moved on): re-read and retry once.
            self._version = max(s.policy_version for s in self.client.read_state()) + 1
            reply = self.client.push(table, self._version)
            if not all(reply):
                raise UpdateRejectedError(
                    self.client.address, f"refused the table {format_table(table)}: {reply}"
                )
        self._pinned = True

    def counters(self) -> CounterSnapshot | None:
        try:
            states = self.client.read_state()
        except PluginMissingError:
            return None
        out: dict[tuple[int, int], CounterRow] = {}
        for s in states:
            for row in s.counters:
                prev = out.get((row.b, row.k))
                if prev is None:
                    out[(row.b, row.k)] = row
                else:
                    out[(row.b, row.k)] = CounterRow(
                        row.b,
                        row.k,
                        prev.decode_steps + row.decode_steps,
                        prev.emitted_tokens + row.emitted_tokens,
                        prev.accepted_drafts + row.accepted_drafts,
                        prev.drafted_tokens + row.drafted_tokens,
                        prev.busy_s + row.busy_s,
                    )
        return CounterSnapshot(tuple(st.started_at for st in states), out)

    def restore(self) -> None:
        if self._pinned and self._original is not None:
            self.pin(self._original)
            self._pinned = False


def _configured_arm(info: Mapping[str, Any]) -> int:
    """The arm a stock server runs: its startup draft steps, or 0 without speculation."""
    algo = info.get("speculative_algorithm")
    if not algo or str(algo).upper() in ("NONE", "NULL"):
        return 0
    steps = info.get("speculative_num_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        return 0
    return steps


# --- measuring ------------------------------------------------------------------------------


class Measurer(Protocol):
    """Runs one window of one cell. :class:`LiveMeasurer` is the real one."""

    async def setup(self) -> ServerSetup: ...

    async def measure(
        self,
        level: int,
        table: Table | None,
        *,
        warmup_s: float,
        step_s: float,
        on_phase: Callable[[str], None],
        on_step: Callable[[int, WindowStats], bool],
    ) -> tuple[WindowStats, ServerWindow | None]:
        """Pin ``table`` (None: leave the server as it is), run ``level`` requests, wait out
        the warm-up, then measure step by step until ``on_step`` returns True."""
        ...

    async def restore(self) -> None: ...


class LiveMeasurer:
    """A :class:`Measurer` over a running :class:`~tuner.loadgen.ClosedLoop` and an
    :class:`ArmControl` (called in a worker thread so the load never stalls)."""

    def __init__(
        self,
        load: ClosedLoop,
        control: ArmControl,
        *,
        clock: Callable[[], float],
        history: Any = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """Args:
            history: a :class:`storage.Storage`; each window's per-``(b, k)`` counter deltas
                are recorded there as observations (the daemon warm-starts from them and
                ``report`` shows them). A storage failure is logged, never fatal.
            wall: wall clock for the observations' timestamps.
        """
        self.load = load
        self.control = control
        self.clock = clock
        self.history = history
        self.wall = wall
        self._arms: tuple[int, ...] = ()
        self._history_failed = False

    async def setup(self) -> ServerSetup:
        setup = await asyncio.to_thread(self.control.setup)
        self._arms = setup.arms
        return setup

    async def measure(
        self,
        level: int,
        table: Table | None,
        *,
        warmup_s: float,
        step_s: float,
        on_phase: Callable[[str], None],
        on_step: Callable[[int, WindowStats], bool],
    ) -> tuple[WindowStats, ServerWindow | None]:
        if table is not None:
            on_phase("switching")
            await asyncio.to_thread(self.control.pin, table)
        epoch = self.load.set_concurrency(level)
        on_phase("warm-up")
        # Every request from before the switch is done, and every worker has turned over
        # once since (a queue behind the running-request cap reaches its steady rhythm).
        await self.load.settle(epoch)
        await self.load.wait_completed(level, epoch=epoch)
        await self.load.run_for(warmup_s)
        before = await asyncio.to_thread(self.control.counters)
        mark = self.load.mark()
        on_phase("measuring")
        step = 0
        while True:
            step += 1
            await self.load.run_for(mark.t + step * step_s - self.clock())
            stats = self.load.stats_since(mark)
            if on_step(step, stats):
                break
        after = await asyncio.to_thread(self.control.counters)
        server = None
        if before is not None and after is not None:
            deltas = counter_deltas(before, after)
            if deltas is not None:
                server = ServerWindow.from_deltas(deltas)
                if self.history is not None and deltas:
                    await asyncio.to_thread(self._record, deltas, after.started_at)
        return stats, server

    def _record(self, deltas: list[CounterRow], started_at: tuple[float, ...]) -> None:
        from storage import ObservationRecord, ServerSeen

        address = self.load.server
        now = self.wall()
        try:
            self.history.record_tick(
                servers=[ServerSeen(address, self._arms, now, min(started_at, default=None))],
                observations=[
                    ObservationRecord(address, now, d.b, d.k, d.decode_steps, d.emitted_tokens,
                                      d.accepted_drafts, d.drafted_tokens, d.busy_s)
                    for d in deltas
                ],
            )
        except StorageError as exc:
            if not self._history_failed:
                log.warning("sweep windows are not recorded in the history: %s", exc)
            self._history_failed = True

    async def restore(self) -> None:
        await asyncio.to_thread(self.control.restore)


# --- the driver -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepEvent:
    """Progress for whoever shows it (the CLI draws bars from these).

    kinds: ``"setup"`` (message), ``"trial"`` (a window starts: level, arm), ``"phase"``
    (message: switching / warm-up / measuring), ``"step"`` (step, steps, stats), ``"done"``
    (measurement, message: complete / pruned / precise / failed), ``"status"`` (status).
    """

    kind: str
    level: int | None = None
    arm: int | None = None
    step: int | None = None
    steps: int | None = None
    stats: WindowStats | None = None
    measurement: Measurement | None = None
    message: str | None = None
    status: tuple[LevelStatus, ...] = ()


class Sweep:
    """Runs a sweep: ask Optuna for a cell, measure it, tell the result; restore at the end.

    Args:
        config: what to measure.
        measurer: the server and load (a :class:`LiveMeasurer`, or a fake in tests).
        db_url: SQLAlchemy URL of the Optuna storage (the daemon's database works).
        study_attrs: settings a resumed study must share (see :func:`open_study`).
        clock: monotonic seconds, for the elapsed-time figure.
        on_event: progress callback.
    """

    def __init__(
        self,
        config: SweepConfig,
        *,
        measurer: Measurer,
        db_url: str,
        study_attrs: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[SweepEvent], None] | None = None,
    ) -> None:
        self.config = config
        self.measurer = measurer
        self.db_url = db_url
        self.study_attrs = dict(study_attrs or {})
        self.clock = clock
        self.on_event = on_event or (lambda e: None)

    async def run(self) -> SweepResult:
        """Measure until the plan is done, ``max_trials`` is reached or the task is cancelled
        (Ctrl-C): then finish cleanly and return what was measured (``interrupted`` set)."""
        cfg = self.config
        started = self.clock()
        setup = await self.measurer.setup()
        notes: list[str] = [setup.note] if setup.note else []
        arms = setup.arms
        if setup.pinnable and cfg.arms is not None:
            missing = sorted(set(cfg.arms) - set(setup.arms))
            if missing:
                raise ConfigError(
                    f"arms {missing} are not built on the server (it has {list(setup.arms)}); "
                    "arms are fixed when SGLang starts (--speculative-adaptive-config)"
                )
            arms = cfg.arms
        elif not setup.pinnable and cfg.arms is not None and set(cfg.arms) != set(arms):
            notes.append(f"--arms {','.join(map(str, cfg.arms))} ignored: nothing can be pinned")
        if not setup.pinnable:
            cfg = replace(cfg, table_pass=False)
        planner = Planner(cfg, arms)
        # The study is the record; this list mirrors its finished windows so the sampler and
        # pruner need not re-read every trial at every step.
        self._ms: list[Measurement] = []
        study = open_study(
            self.db_url,
            cfg.study_name,
            planner=planner,
            attrs=self.study_attrs,
            measurements=lambda _study: self._ms,
        )
        self._ms = measurements_from_study(study)
        sampler: SweepSampler = study.sampler  # type: ignore[assignment]
        resumed = len(self._ms)
        if resumed:
            notes.append(f"resumed study {cfg.study_name!r}: {resumed} windows already measured")
        for note in notes:
            self.on_event(SweepEvent("setup", message=note))
        interrupted = False
        trials_run = 0
        try:
            while True:
                ms = self._ms
                self.on_event(SweepEvent("status", status=tuple(planner.status(ms))))
                if cfg.max_trials is not None and len(ms) >= cfg.max_trials:
                    notes.append(f"stopped at --trials {cfg.max_trials}")
                    break
                if sampler.next_cell(study) is None:
                    break
                await self._trial(study, planner, setup)
                trials_run += 1
        except asyncio.CancelledError:
            # Ctrl-C (asyncio.run cancels the main task): stop measuring, keep the rest.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            interrupted = True
            notes.append("interrupted: kept every completed window")
        finally:
            try:
                if setup.pinnable:
                    await self.measurer.restore()
            except DynspecError as exc:
                notes.append(f"could not restore the server's table: {exc}")
        ms = measurements_from_study(study)
        self.on_event(SweepEvent("status", status=tuple(planner.status(ms))))
        return SweepResult.build(
            planner,
            ms,
            study_name=cfg.study_name,
            notes=tuple(notes),
            interrupted=interrupted,
            trials_run=trials_run,
            elapsed_s=self.clock() - started,
            pinnable=setup.pinnable,
            server_arms=setup.arms,
        )

    async def _trial(self, study: optuna.Study, planner: Planner, setup: ServerSetup) -> None:
        cfg = self.config
        trial = study.ask(dict(_DISTRIBUTIONS))
        level, arm = int(trial.params["concurrency"]), int(trial.params["arm"])
        table: Table | None
        if arm == TABLE_ARM:
            table = planner.learned_table(planner.estimates(self._ms))
        else:
            table = ((None, arm),) if setup.pinnable else None
        self.on_event(SweepEvent("trial", level=level, arm=arm, steps=cfg.steps))
        outcome = {"state": "complete"}
        max_steps = cfg.steps * _MAX_EXTENSION

        def on_step(step: int, stats: WindowStats) -> bool:
            self.on_event(SweepEvent("step", level=level, arm=arm, step=step, steps=cfg.steps,
                                     stats=stats))
            if not math.isfinite(stats.tok_s):
                if step >= max_steps:
                    outcome["state"] = "empty"
                    return True
                return False  # nothing completed yet: keep measuring
            # Little's law over completions is only fair once every worker has turned over
            # in the window; a shorter window picks the requests that happened to be fast.
            turned_over = stats.requests >= level
            if not turned_over and step < max_steps:
                trial.report(stats.tok_s, step)
                return False
            trial.set_user_attr(
                _RUNNING_SE_ATTR, stats.tok_s_se if math.isfinite(stats.tok_s_se) else None
            )
            trial.report(stats.tok_s, step)
            if not turned_over:
                outcome["state"] = "short"
                return True
            if step >= cfg.min_steps and not cfg.exhaustive:
                if trial.should_prune():
                    outcome["state"] = "pruned"
                    return True
                if stats.rel_se <= cfg.precision:
                    outcome["state"] = "precise"
                    return True
            return step >= cfg.steps

        try:
            stats, server = await self.measurer.measure(
                level,
                table,
                warmup_s=cfg.warmup_s,
                step_s=cfg.step_s,
                on_phase=lambda p: self.on_event(
                    SweepEvent("phase", level=level, arm=arm, message=p)
                ),
                on_step=on_step,
            )
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
        pruned = outcome["state"] == "pruned"
        m = Measurement.from_window(
            level, arm, stats, server, pruned=pruned, table=table if arm == TABLE_ARM else None
        )
        m = replace(m, trial=trial.number)
        trial.set_user_attr(_MEASUREMENT_ATTR, m.to_json())
        if outcome["state"] == "short":
            log.warning(
                "concurrency %d, %s: only %d requests completed in %.0f s (fewer than the "
                "concurrency); raise --per-level for a fairer window",
                level, _arm_label(arm), m.requests, m.window_s,
            )
        if outcome["state"] == "empty":
            study.tell(trial, state=TrialState.FAIL)
            raise DynspecError(
                f"no request completed within {max_steps * cfg.step_s:.0f} s at concurrency "
                f"{level}: raise --per-level or lower --max-tokens"
            )
        if pruned:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, m.tok_s)
        self._ms.append(m)
        self.on_event(SweepEvent("done", level=level, arm=arm, measurement=m,
                                 message=outcome["state"]))


# --- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepResult:
    """The sweep's answer: pooled tokens/s per cell, best arm per level, the learned table."""

    levels: tuple[int, ...]
    arms: tuple[int, ...]
    cells: dict[Cell, CellEstimate]
    best: dict[int, int]
    skipped: dict[Cell, str]
    table: Table | None
    crossover: str
    study_name: str
    notes: tuple[str, ...] = ()
    interrupted: bool = False
    trials_run: int = 0
    windows: int = 0
    elapsed_s: float = 0.0
    measured_s: float = 0.0
    pinnable: bool = True
    tolerance: float = DEFAULT_TOLERANCE
    server_arms: tuple[int, ...] = ()  # every arm the server built (the sweep may use fewer)

    @classmethod
    def build(cls, planner: Planner, ms: Sequence[Measurement], **kw: Any) -> SweepResult:
        est = planner.estimates(ms)
        best = {
            lv: a for lv in planner.levels if (a := planner.best_arm(est, lv)) is not None
        }
        skipped: dict[Cell, str] = {}
        for lv in planner.levels:
            for arm, why in planner.skipped(est, lv).items():
                skipped[(lv, arm)] = why
        notes = tuple(kw.pop("notes", ())) + _starved_levels(est, best)
        return cls(
            notes=notes,
            levels=planner.levels,
            arms=planner.arms,
            cells=est,
            best=best,
            skipped=skipped,
            table=planner.learned_table(est),
            crossover=crossover_text(best, planner.arms),
            windows=len(ms),
            measured_s=sum(m.window_s for m in ms),
            tolerance=planner.config.tolerance,
            **kw,
        )

    @property
    def grid_cells(self) -> int:
        return len(self.levels) * len(self.arms)

    def to_json(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return round(x, 6) if math.isfinite(x) else None

        cells = []
        for (lv, arm), e in sorted(self.cells.items()):
            m = e.last
            cells.append(
                {
                    "concurrency": lv,
                    "arm": "table" if arm == TABLE_ARM else arm,
                    "tok_s": num(e.mean),
                    "tok_s_se": num(e.se),
                    "windows": e.windows,
                    "window_s": num(e.window_s),
                    "pruned": e.pruned,
                    "best": self.best.get(lv) == arm,
                    "tpot_p50_ms": num(m.tpot_p50_ms),
                    "tpot_p99_ms": num(m.tpot_p99_ms),
                    "server": None
                    if e.server is None
                    else {
                        "goodput_tok_s": num(e.server.goodput),
                        "mean_batch": num(e.server.mean_batch),
                        "accept_rate": num(e.server.accept_rate),
                        **e.server.to_json(),
                    },
                }
            )
        return {
            "study": self.study_name,
            "levels": list(self.levels),
            "arms": list(self.arms),
            "pinnable": self.pinnable,
            "cells": cells,
            "skipped": [
                {"concurrency": lv, "arm": arm, "why": why}
                for (lv, arm), why in sorted(self.skipped.items())
            ],
            "best": {str(lv): arm for lv, arm in sorted(self.best.items())},
            "table": None if self.table is None else table_to_json(self.table),
            "crossover": self.crossover,
            "grid_cells": self.grid_cells,
            "windows": self.windows,
            "trials_run": self.trials_run,
            "measured_s": num(self.measured_s),
            "elapsed_s": num(self.elapsed_s),
            "interrupted": self.interrupted,
            "notes": list(self.notes),
        }


# A level whose server-side decode batch stays below this share of what it should be is
# flagged: the requests are not reaching the server as fast as the level asks.
_STARVED_BATCH_SHARE = 0.7


def _starved_levels(est: Mapping[Cell, CellEstimate], best: Mapping[int, int]) -> tuple[str, ...]:
    batches = {
        lv: w.mean_batch
        for lv, arm in best.items()
        if (w := est[(lv, arm)].server) is not None and math.isfinite(w.mean_batch)
    }
    if not batches:
        return ()
    cap = max(batches.values())  # the running-request cap, or the largest level
    out = []
    for lv, b in sorted(batches.items()):
        expected = min(lv, cap)
        if b < _STARVED_BATCH_SHARE * expected:
            out.append(
                f"concurrency {lv}: the server's decode batch averaged {b:.1f}, not "
                f"~{expected:.0f}: requests are not reaching it as fast as the level asks "
                "(a client too slow for the load, or a prefill-bound server); its numbers are "
                "not that level's"
            )
    return tuple(out)


def crossover_text(best: Mapping[int, int], arms: Sequence[int]) -> str:
    """Name where the best arm changes, and where speculation stops paying (arm 0 wins)."""
    if not best:
        return "nothing measured yet"
    levels = sorted(best)
    runs: list[tuple[int, int, int]] = []  # (first level, last level, arm)
    for lv in levels:
        if runs and runs[-1][2] == best[lv]:
            runs[-1] = (runs[-1][0], lv, best[lv])
        else:
            runs.append((lv, lv, best[lv]))
    parts = [
        f"k={arm} at {a}" if a == b else f"k={arm} at {a}-{b}" for a, b, arm in runs
    ]
    text = "best arm: " + ", ".join(parts)
    if 0 in arms:
        off = [lv for lv in levels if best[lv] == 0]
        if not off:
            text += "; speculation pays at every level measured"
        elif all(best[lv] == 0 for lv in levels if lv >= off[0]):
            text += (
                "; speculation stops paying at concurrency "
                f"{off[0]}" + (" (at every level measured)" if off[0] == levels[0] else "")
            )
        else:
            text += f"; no drafting wins at {', '.join(map(str, off))} (not monotone: re-measure)"
    return text


def _fmt(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else ""


def render_text(result: SweepResult, *, header: str | None = None) -> str:
    """The table people draw by hand: tokens/s per level for each arm and the learned table.

    ``*`` marks the best arm, ``~`` an arm within ``tolerance`` of it, ``<`` a window the
    pruner cut short (clearly behind), ``-`` a skipped cell (ruled out by another level).
    """
    cols = [*result.arms] + ([TABLE_ARM] if any(a == TABLE_ARM for _, a in result.cells) else [])
    head = ["conc"] + [_arm_label(a) for a in cols] + [
        "best", "vs k=0", "TPOT p50/p99 ms", "server busy tok/s", "batch", "accept"
    ]
    rows = []
    for lv in result.levels:
        best = result.best.get(lv)
        best_e = result.cells.get((lv, best)) if best is not None else None
        row = [str(lv)]
        for arm in cols:
            e = result.cells.get((lv, arm))
            if e is None:
                row.append("-" if (lv, arm) in result.skipped else "")
                continue
            mark = ""
            if arm == best:
                mark = "*"
            elif e.pruned:
                mark = "<"
            elif (
                best_e is not None and arm >= 0 and e.mean >= best_e.mean * (1 - result.tolerance)
            ):
                mark = "~"
            row.append(f"{e.mean:,.1f}{mark}")
        zero = result.cells.get((lv, 0))
        row.append("" if best is None else f"k={best}")
        row.append(
            f"{best_e.mean / zero.mean:.2f}x" if best_e is not None and zero is not None else ""
        )
        if best_e is not None:
            m, w = best_e.last, best_e.server
            row.append(f"{m.tpot_p50_ms:.1f} / {m.tpot_p99_ms:.1f}")
            row.append("" if w is None else _fmt(w.goodput, ",.0f"))
            row.append("" if w is None else _fmt(w.mean_batch, ".1f"))
            row.append("" if w is None else _fmt(w.accept_rate, ".2f"))
        else:
            row += ["", "", "", ""]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = []
    if header:
        lines.append(header)
    lines.append("output tokens/s by concurrency (* best, ~ within "
                 f"{result.tolerance:.0%}, < pruned early, - skipped); for the best arm: "
                 "client TPOT, and the server's goodput, batch and acceptance (its counters)")
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    lines.append("")
    lines.append(result.crossover)
    if result.table is not None:
        lines.append(f"learned table: {format_table(result.table)}")
        lines.extend(f"note: {n}" for n in table_notes(result))
    measured = sum(1 for (_, a) in result.cells if a >= 0)
    lines.append(
        f"measured {measured} of {result.grid_cells} (level, arm) cells in {result.windows} "
        f"windows ({result.measured_s:.0f} s measured, {result.elapsed_s:.0f} s elapsed)"
    )
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot_png(result: SweepResult, path: str | Path, *, title: str | None = None) -> Path:
    """Tokens/s against concurrency, one line per arm, the learned table dashed, best points
    ringed and the crossover marked; written with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    try:
        for arm in [*result.arms, TABLE_ARM]:
            pts = sorted((lv, e.mean) for (lv, a), e in result.cells.items() if a == arm)
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            style = {"linestyle": "--", "color": "black"} if arm == TABLE_ARM else {}
            ax.plot(xs, ys, marker="o", label=_arm_label(arm), **style)
        best_pts = [(lv, result.cells[(lv, a)].mean) for lv, a in result.best.items()]
        if best_pts:
            xs, ys = zip(*best_pts, strict=True)
            ax.scatter(xs, ys, s=160, facecolors="none", edgecolors="red", label="best arm")
        off = sorted(lv for lv, a in result.best.items() if a == 0)
        if off and off[0] != min(result.best):
            ax.axvline(off[0], color="grey", linestyle=":")
            ax.annotate(f"k=0 wins from {off[0]}", (off[0], ax.get_ylim()[1]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(result.levels), [str(lv) for lv in result.levels])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("output tokens/s")
        # Wrapped: a server address and study name do not fit one line of a 7-inch figure.
        ax.set_title(textwrap.fill(title or "dynspec-tuner sweep", 70), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def write_json(result: SweepResult, path: str | Path, **extra: Any) -> Path:
    """The result as JSON (plus ``extra`` top-level keys, e.g. the server)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**extra, **result.to_json()}, indent=2) + "\n", encoding="utf-8")
    return path


def write_policy_file(
    result: SweepResult, path: str | Path, *, server: str, now: float | None = None
) -> Path | None:
    """The learned table as the plugin's versioned policy file (``DYNSPEC_POLICY_FILE`` at
    server start, or ``export``), via :mod:`tuner.policyfile`; None when there is no table.

    Provenance: policy ``"sweep"``, the levels as bucket edges, and per (level, arm) the
    server's goodput (emitted tokens per busy second) where the plugin reported counters.
    """
    if result.table is None:
        return None
    from tuner import __version__, policyfile

    estimates = []
    for (level, arm), e in sorted(result.cells.items()):
        w = e.server
        if arm < 0 or w is None or not math.isfinite(w.goodput):
            continue
        rel = e.se_or_fallback() / e.mean if e.mean > 0 else 0.0
        estimates.append(policyfile.Estimate(
            result.levels.index(level), arm, w.goodput, w.goodput * rel, w.decode_steps
        ))
    doc = policyfile.PolicyFile(
        table=result.table,
        arms=result.server_arms or result.arms,
        policy_version=1,
        provenance=policyfile.Provenance(
            server=server,
            created_at=time.time() if now is None else now,
            tool_version=__version__,
            policy="sweep",
            buckets=result.levels,
            data_window=policyfile.DataWindow(observations=result.windows),
            estimates=tuple(estimates),
            notes=table_notes(result),
        ),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return policyfile.save(doc, path)


def table_notes(result: SweepResult) -> tuple[str, ...]:
    """What the policy file's table covers without a measurement: levels where no arm was
    measured (merged into the next measured level's row) and every batch above the largest
    measured level (the table stops there and keeps that level's arm)."""
    if result.table is None:
        return ()
    measured = sorted({lv for (lv, a) in result.cells if a >= 0})
    if not measured:
        return ()
    notes = []
    gaps = [lv for lv in result.levels if lv < measured[-1] and lv not in measured]
    if gaps:
        notes.append(f"no arm measured at concurrency {', '.join(map(str, gaps))}: those "
                     "batch sizes run the next measured level's arm")
    notes.append(f"nothing measured above concurrency {measured[-1]}: the table stops there "
                 f"and runs k{result.table[-1][1]} for every larger batch")
    return tuple(notes)


# --- one call for the CLI and the benchmark --------------------------------------------------


async def sweep_server(
    server: str,
    config: SweepConfig,
    *,
    prompts: Sequence[str],
    load_config: Any = None,
    db_url: str,
    api_key: str | None = None,
    on_event: Callable[[SweepEvent], None] | None = None,
    record: bool = True,
) -> SweepResult:
    """Sweep one live server: closed-loop load through ``load_config.endpoint`` plus arm pinning
    through the plugin (``SGLangClient``), recorded in the Optuna study at ``db_url`` and,
    with ``record``, each window's counters as observations in the history at the same URL
    (what ``run`` warm-starts from and ``report`` reads).

    Raises:
        ServerError: the server is unreachable, refuses the key or answers nonsense.
        ConfigError: bad arms for this server, or a study measured with other settings.
        StorageError: the database cannot be opened.
    """
    from storage import Storage
    from tuner.client import SGLangClient
    from tuner.loadgen import LoadConfig

    load_config = load_config or LoadConfig()
    attrs = {
        "server": server,
        "endpoint": load_config.endpoint,
        "max_tokens": load_config.max_tokens,
        "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
    }
    history = Storage(db_url) if record else None
    with contextlib.ExitStack() as stack:
        if history is not None:
            stack.callback(history.close)
        client = stack.enter_context(SGLangClient(server, api_key=api_key))
        async with ClosedLoop(server, prompts, config=load_config, api_key=api_key) as load:
            measurer = LiveMeasurer(load, PluginArmControl(client), clock=time.monotonic,
                                    history=history)
            sweep = Sweep(config, measurer=measurer, db_url=db_url, study_attrs=attrs,
                          on_event=on_event)
            return await sweep.run()

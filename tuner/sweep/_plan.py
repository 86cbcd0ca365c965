"""The sweep's decision logic, pure: which cell next, which arms are ruled out, when a level
is resolved and what table the measurements teach (:class:`Planner`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tuner.errors import ConfigError
from tuner.protocol import Table, validate_table
from tuner.sweep._config import TABLE_ARM, Cell, SweepConfig
from tuner.sweep._measure import CellEstimate, Measurement, _sigma_diff


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

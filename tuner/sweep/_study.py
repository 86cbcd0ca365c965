"""Optuna glue: the study that stores every window, the sampler that asks the
:class:`~tuner.sweep._plan.Planner` for the next cell and the pruner that races windows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from storage import redact_url
from tuner.errors import ConfigError, StorageError
from tuner.sweep._config import (
    TABLE_ARM,
    _DISTRIBUTIONS,
    _MEASUREMENT_ATTR,
    _RUNNING_SE_ATTR,
    Cell,
)
from tuner.sweep._measure import CellEstimate, Measurement, _sigma_diff
from tuner.sweep._plan import Planner

# The logger keeps the name of the module this came from, so log filters stay valid.
log = logging.getLogger("tuner.sweep")


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


class _ReadsMeasurements:
    """What the sampler and the pruner share: the pure :class:`Planner` and how the study's
    measurements are read (:func:`measurements_from_study`, or the driver's own list)."""

    def __init__(
        self,
        planner: Planner,
        *,
        measurements: Callable[[optuna.Study], list[Measurement]] = measurements_from_study,
    ) -> None:
        self.planner = planner
        self.measurements = measurements


class SweepSampler(_ReadsMeasurements, optuna.samplers.BaseSampler):
    """An Optuna sampler whose suggestion is :meth:`Planner.next_cell` over the study's trials.

    Deterministic: the same stored measurements give the same next cell, which is what makes
    a resumed sweep skip what was measured.
    """

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


class RacePruner(_ReadsMeasurements, optuna.pruners.BasePruner):
    """Prunes a window whose arm is clearly behind the best measured arm at its level.

    "Clearly": the trial's running tokens/s plus ``z`` standard errors of the difference is
    still below the leader's pooled mean. Table windows are never pruned.
    """

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

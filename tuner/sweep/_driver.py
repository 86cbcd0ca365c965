"""The async driver (:class:`Sweep`: ask, pin, measure, tell, restore) and
:func:`sweep_server`, the one call for the CLI and the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import optuna
from optuna.trial import TrialState

from tuner.errors import ConfigError, DynspecError
from tuner.loadgen import ClosedLoop, WindowStats
from tuner.protocol import Table
from tuner.sweep._config import (
    TABLE_ARM,
    _DISTRIBUTIONS,
    _MAX_EXTENSION,
    _MEASUREMENT_ATTR,
    _RUNNING_SE_ATTR,
    SweepConfig,
    _arm_label,
)
from tuner.sweep._control import LiveMeasurer, Measurer, PluginArmControl, ServerSetup
from tuner.sweep._measure import Measurement
from tuner.sweep._plan import LevelStatus, Planner
from tuner.sweep._result import SweepResult
from tuner.sweep._study import SweepSampler, measurements_from_study, open_study

# The logger keeps the name of the module this came from, so log filters stay valid.
log = logging.getLogger("tuner.sweep")


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

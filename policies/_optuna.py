"""Optuna policy: TPE over each bucket's arm, driven ask/tell like any Optuna study.

One study per bucket (``<study_name>:b<low>-<high>``), one categorical parameter ``k``. When a
bucket's open trial has run ``trial_steps`` decode steps at its arm, the policy tells the
trial the goodput measured over them and asks the next; ``propose`` runs the open trial's arm.
So the study's history is exactly the arms tried and the goodput they gave, and
``optuna-dashboard sqlite:///dynspec.db`` shows it when the studies live in the daemon's
database (``storage_url``; in memory when None).

TPE remembers every trial and does not forget, so the *greedy* table comes from the shared,
discounted measurements (:mod:`policies._learning`), which follow a changing workload; TPE
only decides what to try. This is the one policy that does I/O, and only through Optuna's
storage at the URL the caller passes. Optuna is imported lazily, so ``import policies``
stays light.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from policies._base import Observation
from policies._learning import LearnerParams, LearningPolicy, _require

__all__ = [
    "DEFAULT_N_STARTUP_TRIALS",
    "DEFAULT_STUDY_NAME",
    "DEFAULT_TRIAL_STEPS",
    "OptunaParams",
    "OptunaPolicy",
]

DEFAULT_STUDY_NAME = "dynspec"
# Decode steps of a bucket behind one trial: enough that its goodput is a fair measurement.
DEFAULT_TRIAL_STEPS = 40
# Random trials before TPE models the arms (per bucket).
DEFAULT_N_STARTUP_TRIALS = 5


@dataclass(frozen=True, kw_only=True)
class OptunaParams(LearnerParams):
    """:class:`LearnerParams` plus the study's.

    Attributes:
        storage_url: Optuna RDB storage URL (e.g. ``sqlite:///dynspec.db``); None = in memory.
        study_name: prefix of the per-bucket study names.
        trial_steps: decode steps of a bucket behind one trial.
        n_startup_trials: random trials before TPE takes over.
    """

    storage_url: str | None = None
    study_name: str = DEFAULT_STUDY_NAME
    trial_steps: int = DEFAULT_TRIAL_STEPS
    n_startup_trials: int = DEFAULT_N_STARTUP_TRIALS

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.storage_url is None or (isinstance(self.storage_url, str)
                                               and "://" in self.storage_url),
                 "storage_url", "None or a database URL", self.storage_url)
        _require(isinstance(self.study_name, str) and bool(self.study_name.strip()),
                 "study_name", "a non-empty string", self.study_name)
        _require(isinstance(self.trial_steps, int) and self.trial_steps >= 1, "trial_steps",
                 "an int >= 1", self.trial_steps)
        _require(isinstance(self.n_startup_trials, int) and self.n_startup_trials >= 0,
                 "n_startup_trials", "an int >= 0", self.n_startup_trials)


class _Trial:
    __slots__ = ("trial", "arm", "w", "s", "wb", "steps")

    def __init__(self, trial: Any, arm: int) -> None:
        self.trial, self.arm = trial, arm
        self.w = self.s = self.wb = 0.0
        self.steps = 0  # raw decode steps at the arm (the weights discount switch transients)


class OptunaPolicy(LearningPolicy):
    """TPE per bucket through Optuna's ask/tell (name ``"optuna"``). See the module docstring."""

    name = "optuna"
    params_class = OptunaParams
    params: OptunaParams

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self._studies: dict[int, Any] = {}
        self._open: dict[int, _Trial] = {}

    def _study(self, j: int) -> Any:
        study = self._studies.get(j)
        if study is None:
            import optuna  # lazily: the rest of policies/ must not pay for it

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            p = self.params
            label = self.buckets.label(j)
            study = optuna.create_study(
                storage=p.storage_url,
                study_name=f"{p.study_name}:b{label}",
                direction="maximize",
                load_if_exists=True,
                sampler=optuna.samplers.TPESampler(
                    seed=self.seed * 1009 + j, n_startup_trials=p.n_startup_trials
                ),
            )
            study.set_user_attr("bucket", label)
            study.set_user_attr("arms", list(self.arms))
            self._studies[j] = study
        return study

    def _ask(self, j: int) -> _Trial:
        import optuna

        trial = self._study(j).ask(
            {"k": optuna.distributions.CategoricalDistribution(list(self.arms))}
        )
        return _Trial(trial, int(trial.params["k"]))

    def _observed(self, j: int, obs: Observation, r: float, weight: float) -> None:
        t = self._open.get(j)
        if t is not None and obs.k == t.arm:
            t.w += weight
            t.s += weight * r
            t.wb += weight * obs.b
            t.steps += int(obs.decode_steps)

    def _explore(self, j: int, greedy: int) -> int:
        t = self._open.get(j)
        st = self._state[j]
        # A trial ends after trial_steps at its arm, or earlier once the guardrail has found
        # its arm measurably worse than the greedy one: its measurement is then told (TPE
        # learns from it) instead of the trial being retried in slivers forever.
        condemned = st.last_revert is not None and st.last_revert[0] == getattr(t, "arm", None)
        if t is not None and t.w > 0 and (
            t.steps >= self.params.trial_steps
            or (condemned and t.steps >= self.params.min_dwell_steps)
        ):
            # Told in tokens/s at the trial's mean batch size, so the dashboard reads naturally.
            value = (t.wb / t.w) * math.exp(t.s / t.w)
            self._study(j).tell(t.trial, value)
            t = None
        if t is None:
            t = self._open[j] = self._ask(j)
        return t.arm

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

The package's private modules, one concern each: ``_config`` (defaults and
:class:`SweepConfig`), ``_measure`` (windows, measurements, pooled estimates), ``_plan``
(:class:`Planner`), ``_study`` (the Optuna study, :class:`SweepSampler`, :class:`RacePruner`),
``_control`` (:class:`PluginArmControl`, :class:`LiveMeasurer`), ``_driver`` (:class:`Sweep`,
:func:`sweep_server`) and ``_result`` (:class:`SweepResult` and its writers).
"""

from tuner.config import DEFAULT_SWEEP_LEVELS as DEFAULT_LEVELS
from tuner.config import DEFAULT_SWEEP_PER_LEVEL_S as DEFAULT_PER_LEVEL_S
from tuner.config import DEFAULT_SWEEP_WARMUP_S as DEFAULT_WARMUP_S
from tuner.sweep._config import (
    DEFAULT_MAX_WINDOWS_PER_CELL,
    DEFAULT_MIN_STEPS,
    DEFAULT_PRECISION,
    DEFAULT_SKIP_MARGIN,
    DEFAULT_STEPS,
    DEFAULT_TOLERANCE,
    DEFAULT_Z,
    FALLBACK_REL_SE,
    TABLE_ARM,
    Cell,
    SweepConfig,
    default_study_name,
)
from tuner.sweep._control import (
    ArmControl,
    LiveMeasurer,
    Measurer,
    PluginArmControl,
    ServerSetup,
)
from tuner.sweep._driver import Sweep, SweepEvent, sweep_server
from tuner.sweep._measure import (
    CellEstimate,
    CounterSnapshot,
    Measurement,
    ServerWindow,
    counter_deltas,
)
from tuner.sweep._plan import LevelStatus, Planner
from tuner.sweep._result import (
    SweepResult,
    crossover_text,
    plot_png,
    render_text,
    table_notes,
    write_json,
    write_policy_file,
)
from tuner.sweep._study import RacePruner, SweepSampler, measurements_from_study, open_study

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

"""``dynspec-tuner calibrate``: cost tables for the simulator, measured or fitted.

Two sources:

- :func:`measure` (in :mod:`tuner.calibrate.gpu`, the package's only torch importer, loaded
  lazily) times a random-weight decoder of a given shape (dense, or mixture of experts) and its
  EAGLE-3-style draft on a CUDA device, over a grid of batch sizes and tokens per sequence.
- :func:`fit_observations` / :func:`fit_from_storage` turn what a live server reported (busy
  seconds per decode step at each ``(b, k)``) into a table of the same format, so the
  simulator replays that server.

Both write the JSON-lines format of ``shared/calibration/`` (:func:`write_table`).
Importing this package never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tuner.calibrate import _shapes
from tuner.calibrate._fit import (
    DEFAULT_DRAFT_RATIO,
    DEFAULT_MIN_STEPS,
    FitResult,
    StepCell,
    fit_from_storage,
    fit_observations,
)
from tuner.calibrate._grid import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CTX,
    DEFAULT_DTYPE,
    DEFAULT_REPLAYS,
    DEFAULT_TOKENS_PER_SEQ,
    DEFAULT_WARMUP,
    DTYPES,
    CalibrationGrid,
    CalibrationSettings,
)
from tuner.calibrate._moe import expected_experts, touched_experts
from tuner.calibrate._shapes import *  # noqa: F403  (the model shapes, listed in _shapes)
from tuner.calibrate._table import CalibrationTable, CostRow, read_table, write_table

if TYPE_CHECKING:
    from tuner.calibrate.gpu import CalibrationResult

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_CTX",
    "DEFAULT_DRAFT_RATIO",
    "DEFAULT_DTYPE",
    "DEFAULT_MIN_STEPS",
    "DEFAULT_REPLAYS",
    "DEFAULT_TOKENS_PER_SEQ",
    "DEFAULT_WARMUP",
    "DTYPES",
    "CalibrationGrid",
    "CalibrationSettings",
    "CalibrationTable",
    "CostRow",
    "FitResult",
    "StepCell",
    "expected_experts",
    "fit_from_storage",
    "fit_observations",
    "measure",
    "read_table",
    "touched_experts",
    "write_table",
]
__all__ += _shapes.__all__


def measure(*args: Any, **kwargs: Any) -> CalibrationResult:
    """Time a grid on the CUDA device; see :func:`tuner.calibrate.gpu.measure`.

    Imports torch on first call only.
    """
    from tuner.calibrate import gpu

    return gpu.measure(*args, **kwargs)

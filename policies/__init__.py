"""Decision algorithms: which arm each batch-size bucket should run. Pure code only.

Build one by name with :func:`make_policy` (``POLICIES`` lists the names, ``DEFAULT_POLICY``
is the one the bench chose); every policy has ``update(observation)``, ``propose()``,
``greedy()`` and ``snapshot()``. Learning policies share one mechanism for discounting,
switching cost, dwell, guardrail and exploration budget (:class:`LearnerParams`).
"""

from __future__ import annotations

from policies import _base
from policies._acceptance import expected_accepted, expected_emitted
from policies._banded import BandObservation, BandTable, band_observations
from policies._base import *  # noqa: F403  (the policy interface, listed in _base)
from policies._guard import GuardVerdict, guard_check
from policies._learning import LearnerParams, LearningPolicy
from policies._model import ModelParams, ModelPolicy
from policies._optuna import OptunaParams, OptunaPolicy
from policies._probes import PROBE_REQUEST_STEPS, Probe, probe_steps, split_probes
from policies._registry import DEFAULT_POLICY, POLICIES, make_policy, policy_parameters
from policies._static import (
    DEFAULT_SGLANG_SLOTS,
    SGLANG_DEFAULT_CUDA_GRAPH_BS,
    AlwaysParams,
    AlwaysPolicy,
    NeverPolicy,
    SGLangDefaultParams,
    SGLangDefaultPolicy,
    StaticPolicy,
    TableParams,
    TablePolicy,
    ThresholdParams,
    ThresholdPolicy,
    sglang_settled_arm,
    sglang_static_table,
)
from policies._stats import ArmStats, reward
from policies._thompson import ThompsonParams, ThompsonPolicy
from policies._ucb import UCBParams, UCBPolicy

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_SGLANG_SLOTS",
    "POLICIES",
    "PROBE_REQUEST_STEPS",
    "SGLANG_DEFAULT_CUDA_GRAPH_BS",
    "AlwaysParams",
    "AlwaysPolicy",
    "ArmStats",
    "BandObservation",
    "BandTable",
    "GuardVerdict",
    "LearnerParams",
    "LearningPolicy",
    "ModelParams",
    "ModelPolicy",
    "NeverPolicy",
    "OptunaParams",
    "OptunaPolicy",
    "Probe",
    "SGLangDefaultParams",
    "SGLangDefaultPolicy",
    "StaticPolicy",
    "TableParams",
    "TablePolicy",
    "ThompsonParams",
    "ThompsonPolicy",
    "ThresholdParams",
    "ThresholdPolicy",
    "UCBParams",
    "UCBPolicy",
    "band_observations",
    "expected_accepted",
    "expected_emitted",
    "guard_check",
    "make_policy",
    "policy_parameters",
    "probe_steps",
    "reward",
    "sglang_settled_arm",
    "sglang_static_table",
    "split_probes",
]
__all__ += _base.__all__

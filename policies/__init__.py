"""Decision algorithms: which arm each batch-size bucket should run. Pure code only.

Build one by name with :func:`make_policy` (``POLICIES`` lists the names); every policy has
``update(observation)``, ``propose()``, ``greedy()`` and ``snapshot()``.
"""

from __future__ import annotations

from policies._base import (
    DEFAULT_BUCKET_EDGES,
    ArmEstimate,
    BasePolicy,
    Buckets,
    Observation,
    PolicySnapshot,
    Table,
)
from policies._guard import GuardVerdict, guard_check
from policies._learning import LearnerParams, LearningPolicy
from policies._registry import DEFAULT_POLICY, POLICIES, make_policy, policy_parameters
from policies._stats import ArmStats, reward
from policies._thompson import ThompsonParams, ThompsonPolicy

__all__ = [
    "DEFAULT_BUCKET_EDGES",
    "DEFAULT_POLICY",
    "POLICIES",
    "ArmEstimate",
    "ArmStats",
    "BasePolicy",
    "Buckets",
    "GuardVerdict",
    "LearnerParams",
    "LearningPolicy",
    "Observation",
    "PolicySnapshot",
    "Table",
    "ThompsonParams",
    "ThompsonPolicy",
    "guard_check",
    "make_policy",
    "policy_parameters",
    "reward",
]

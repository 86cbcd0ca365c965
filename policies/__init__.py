"""Decision algorithms: which arm each batch-size bucket should run. Pure code only."""

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

__all__ = [
    "DEFAULT_BUCKET_EDGES",
    "ArmEstimate",
    "BasePolicy",
    "Buckets",
    "Observation",
    "PolicySnapshot",
    "Table",
]

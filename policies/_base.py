"""The policy interface, its data types and the bucketing of batch sizes.

Pure: no I/O, no clock reads, no HTTP. The daemon and the bench drive a policy the way a
caller drives Optuna's ask/tell: ``update`` with observations, ``propose`` each decision
period, ``greedy`` when leaving, ``snapshot`` for reports and export.
"""

from __future__ import annotations

import abc
import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_BUCKET_EDGES",
    "ArmEstimate",
    "BasePolicy",
    "Buckets",
    "Observation",
    "PolicySnapshot",
    "Table",
    "sum_by_arm",
    "table_from_arms",
]

# A table: ordered (max_batch_size, k) rows, last bound None (= everything larger).
# The same shape as tuner.protocol.Table; policies never import tuner.
Table = tuple[tuple[int | None, int], ...]

# Upper bounds of the default buckets. All are batch sizes SGLang captures CUDA graphs for
# (1..8, 10..32 step 2, 40..64 step 4, 72..256 step 8), so graph padding never carries a batch
# across a bucket boundary. Everything above the last edge is one more bucket.
DEFAULT_BUCKET_EDGES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def table_from_arms(arms_by_bound: Iterable[tuple[int | None, int]]) -> Table:
    """``(upper bound, arm)`` pairs in increasing bound order -> a table.

    Neighbouring ranges with the same arm merge into one row; the last row becomes unbounded.
    """
    rows: list[tuple[int | None, int]] = []
    for bound, k in arms_by_bound:
        if rows and rows[-1][1] == k:
            rows[-1] = (bound, k)
        else:
            rows.append((bound, k))
    if not rows:
        raise ValueError("a table needs at least one (bound, arm) pair")
    rows[-1] = (None, rows[-1][1])
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class Observation:
    """What one server did at one ``(b, k)`` over one sampling interval.

    ``emitted_tokens`` counts accepted drafts plus one bonus token per request per step;
    ``goodput`` is emitted tokens per busy second.
    """

    b: int
    k: int
    decode_steps: int
    emitted_tokens: int
    accepted_drafts: int
    drafted_tokens: int
    busy_s: float

    @property
    def goodput(self) -> float:
        return self.emitted_tokens / self.busy_s if self.busy_s > 0 else float("nan")

    def problem(self) -> str | None:
        """Why this observation must not reach a policy, or None if it is usable."""
        counters = (
            "b", "k", "decode_steps", "emitted_tokens", "accepted_drafts", "drafted_tokens",
        )
        for name in counters:
            value = getattr(self, name)
            # NaN slips through every comparison below, so non-finite values are refused first.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"{name} {value!r} is not a number"
            if not math.isfinite(value):
                return f"{name} {value!r} is not finite"
        if isinstance(self.busy_s, bool) or not isinstance(self.busy_s, (int, float)):
            return f"busy_s {self.busy_s!r} is not a number"
        if self.b < 1:
            return f"batch size {self.b} < 1"
        if self.k < 0:
            return f"arm {self.k} < 0"
        if min(self.decode_steps, self.emitted_tokens, self.accepted_drafts,
               self.drafted_tokens) < 0:
            return "negative counter"
        if not math.isfinite(self.busy_s) or self.busy_s <= 0:
            return f"busy_s {self.busy_s} is not a positive finite number"
        if self.decode_steps == 0:
            return "no decode steps"
        if self.accepted_drafts > self.drafted_tokens:
            return "more accepted drafts than drafted tokens"
        if self.emitted_tokens < self.decode_steps:
            # Every request gets at least its bonus token in every step.
            return "fewer emitted tokens than decode steps"
        return None


def sum_by_arm(rows: Iterable[Any]) -> list[Observation]:
    """Per-``(b, k)`` sums of counter rows (anything with :class:`Observation`'s fields: DP
    replicas' counter deltas, stored rows of several time bins), in ``(b, k)`` order; a
    ``(b, k)`` without decode steps is left out."""
    acc: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        v = acc.setdefault((r.b, r.k), [0, 0, 0, 0, 0.0])
        v[0] += r.decode_steps
        v[1] += r.emitted_tokens
        v[2] += r.accepted_drafts
        v[3] += r.drafted_tokens
        v[4] += r.busy_s
    return [Observation(b, k, int(v[0]), int(v[1]), int(v[2]), int(v[3]), float(v[4]))
            for (b, k), v in sorted(acc.items()) if v[0] > 0]


@dataclass(frozen=True)
class Buckets:
    """Contiguous batch-size ranges sharing one decision.

    Bucket ``i`` covers ``(edges[i-1], edges[i]]`` (bucket 0 starts at 1); the last bucket
    covers everything above ``edges[-1]``. Every batch size >= 1 falls in exactly one bucket.
    """

    edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES

    def __post_init__(self) -> None:
        edges = tuple(int(e) for e in self.edges)
        if not edges:
            raise ValueError("bucket edges must not be empty")
        if edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
            raise ValueError(f"bucket edges must be positive and strictly increasing: {edges}")
        object.__setattr__(self, "edges", edges)

    @classmethod
    def parse(cls, text: str) -> Buckets:
        """``"1,2,4,8,16"`` -> Buckets. Raises ValueError naming the bad part."""
        try:
            return cls(tuple(int(p) for p in text.replace(" ", "").split(",") if p))
        except ValueError as exc:
            raise ValueError(f"bad bucket edges {text!r}: {exc}") from exc

    def __len__(self) -> int:
        return len(self.edges) + 1

    def index(self, batch_size: int) -> int:
        return bisect_left(self.edges, batch_size)

    def bounds(self, i: int) -> tuple[int, int | None]:
        """Inclusive ``(low, high)`` of bucket ``i``; ``high`` None for the last bucket."""
        low = 1 if i == 0 else self.edges[i - 1] + 1
        high = self.edges[i] if i < len(self.edges) else None
        return low, high

    def label(self, i: int) -> str:
        low, high = self.bounds(i)
        if high is None:
            return f">{low - 1}"
        return str(low) if low == high else f"{low}-{high}"

    def table(self, arms: Sequence[int]) -> Table:
        """Per-bucket arms -> a table, merging neighbouring buckets with the same arm."""
        if len(arms) != len(self):
            raise ValueError(f"need {len(self)} arms (one per bucket), got {len(arms)}")
        return table_from_arms((self.bounds(i)[1], k) for i, k in enumerate(arms))

    def arms_of(self, table: Table) -> tuple[int, ...]:
        """The arm a table gives each bucket (taken at the bucket's upper bound)."""
        out = []
        for i in range(len(self)):
            low, high = self.bounds(i)
            probe = high if high is not None else low
            for bound, k in table:
                if bound is None or probe <= bound:
                    out.append(k)
                    break
        return tuple(out)


@dataclass(frozen=True, slots=True)
class ArmEstimate:
    """A policy's belief about one arm in one bucket (goodput in tokens/s)."""

    bucket: int
    arm: int
    estimate: float
    std: float
    n: int  # decode steps behind the estimate (after discounting, rounded)


@dataclass(frozen=True)
class PolicySnapshot:
    """What a policy believes now: feeds status lines, reports and export."""

    policy: str
    buckets: Buckets
    arms: tuple[int, ...]
    chosen: tuple[int, ...]  # greedy arm per bucket
    estimates: tuple[ArmEstimate, ...]
    notes: tuple[str, ...] = ()  # e.g. guardrail reverts, with reasons


class BasePolicy(abc.ABC):
    """Chooses an arm per bucket from observations.

    Implementations must be deterministic for a given seed and sequence of calls, must never
    raise on a bad observation (``update`` returns False and leaves state unchanged), and must
    only ever return tables whose arms are among ``arms``.

    Args:
        arms: the arms the server built (``k`` values; 0 = no drafting).
        buckets: the batch-size buckets to decide for.
        seed: seeds the policy's own random generator.
    """

    name: str = "base"

    def __init__(self, *, arms: Iterable[int], buckets: Buckets | None = None, seed: int = 0):
        self.arms = tuple(sorted(set(int(a) for a in arms)))
        if not self.arms or self.arms[0] < 0:
            raise ValueError(f"arms must be a non-empty set of ints >= 0, got {self.arms}")
        self.buckets = buckets or Buckets()
        self.seed = seed

    def set_verify_tokens(self, tokens: Mapping[int, int]) -> None:
        """How many tokens an arm verifies per request where that is not ``k + 1``: on an
        EAGLE tree server the arm ``steps`` verifies ``draft_tokens`` (from the readout's
        ``tree``). Call before the first :meth:`update`. Policies that price an arm by a
        step-time model use it; the others, which only compare measurements, ignore it."""
        for k, n in tokens.items():
            if k not in self.arms or k == 0 or not k + 1 <= n:
                raise ValueError(f"arm {k} cannot verify {n} tokens per request "
                                 f"(arms {list(self.arms)}; arm k verifies at least k + 1)")

    def update(self, obs: Observation) -> bool:
        """Feed one observation. Returns False (state unchanged) if it is unusable."""
        if obs.problem() is not None or obs.k not in self.arms:
            return False
        self._update(self.buckets.index(obs.b), obs)
        return True

    @abc.abstractmethod
    def _update(self, bucket: int, obs: Observation) -> None: ...

    @abc.abstractmethod
    def propose(self) -> Table:
        """The table to run until the next decision (may explore)."""

    @abc.abstractmethod
    def greedy(self) -> Table:
        """The best table by current estimates (no exploration)."""

    @abc.abstractmethod
    def snapshot(self) -> PolicySnapshot: ...

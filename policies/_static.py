"""Static baselines: tables that never learn, to measure the learning policies against.

- ``never``: no drafting (k = 0) at every batch size.
- ``always``: one arm ``k`` everywhere.
- ``threshold``: the seed's rule, a fixed ``k`` up to ``max_batch`` requests, off above.
- ``table``: any fixed table.
- ``sglang-default``: SGLang 0.5.23's default ``--speculative-adaptive-config`` as the static
  table its EMA would settle on for a workload (:func:`sglang_settled_arm`, derived from the
  workload's mean accepted drafts, not hard-coded per workload).

A static policy still counts what it observes (undiscounted), so its snapshot shows measured
goodput per bucket and arm like any other policy's.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies._acceptance import expected_accepted
from policies._base import (
    ArmEstimate,
    BasePolicy,
    Buckets,
    Observation,
    PolicySnapshot,
    Table,
    table_from_arms,
)
from policies._stats import ArmStats, reward

__all__ = [
    "DEFAULT_SGLANG_SLOTS",
    "DEFAULT_THRESHOLD_K",
    "DEFAULT_THRESHOLD_MAX_BATCH",
    "SGLANG_DEFAULT_CUDA_GRAPH_BS",
    "AlwaysParams",
    "AlwaysPolicy",
    "NeverPolicy",
    "SGLangDefaultParams",
    "SGLangDefaultPolicy",
    "StaticPolicy",
    "TableParams",
    "TablePolicy",
    "ThresholdParams",
    "ThresholdPolicy",
    "sglang_settled_arm",
    "sglang_static_table",
]

# The seed ran a fixed k = 3 (SGLang's default num_steps) below 5 running requests, off above.
DEFAULT_THRESHOLD_K = 3
DEFAULT_THRESHOLD_MAX_BATCH = 5

# SGLang 0.5.23 DEFAULT_ADAPTIVE_CONFIG: slot lower bound -> candidate steps.
DEFAULT_SGLANG_SLOTS: tuple[tuple[int, tuple[int, ...]], ...] = (
    (1, (1, 3, 5, 7)),
    (8, (0, 1, 3)),
    (32, (0, 1)),
    (64, (0,)),
)
# ... its defaults: num_steps = union[len // 2] = 3, the hysteresis of every slot.
DEFAULT_SGLANG_INITIAL_STEPS = 3
DEFAULT_SGLANG_DOWN_HYSTERESIS = -0.25
DEFAULT_SGLANG_UP_HYSTERESIS = 0.0
# SGLang's default captured decode batch sizes: 1..8, 10..32 step 2, 40..64 step 4,
# 72..256 step 8, then step 16. Slots apply to the *padded* batch size.
SGLANG_DEFAULT_CUDA_GRAPH_BS: tuple[int, ...] = tuple(
    list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
    + list(range(72, 257, 8)) + list(range(272, 513, 16))
)


class StaticPolicy(BasePolicy):
    """A fixed table. ``propose()`` and ``greedy()`` both return it.

    Args:
        arms: the arms the server built; every arm of ``table`` must be among them.
        table: the fixed table (canonical: bounds increasing, last row unbounded).
    """

    name = "static"

    def __init__(
        self, *, arms: Iterable[int], buckets: Buckets | None = None, seed: int = 0,
        table: Table | None = None,
    ) -> None:
        super().__init__(arms=arms, buckets=buckets, seed=seed)
        if table is None:
            table = self._make_table()
        self.table = _check_table(table, self.arms)
        self._stats = [{a: ArmStats() for a in self.arms} for _ in range(len(self.buckets))]

    def _make_table(self) -> Table:
        raise ValueError(f"{type(self).__name__} needs a table")

    def _update(self, bucket: int, obs: Observation) -> None:
        s = int(obs.decode_steps)
        self._stats[bucket][obs.k].add(reward(obs), s, 1.0, obs.b, s)

    def update(self, obs: Observation) -> bool:
        if obs.problem() is not None or obs.k not in self.arms or obs.emitted_tokens <= 0:
            return False
        self._update(self.buckets.index(obs.b), obs)
        return True

    def propose(self) -> Table:
        return self.table

    def greedy(self) -> Table:
        return self.table

    def snapshot(self) -> PolicySnapshot:
        est = []
        for j, per_arm in enumerate(self._stats):
            for arm, st in per_arm.items():
                if st.seen:
                    g = st.goodput()
                    est.append(ArmEstimate(j, arm, g, g * st.mean_sd(0.5, 2.0), round(st.w)))
        return PolicySnapshot(
            policy=self.name, buckets=self.buckets, arms=self.arms,
            chosen=self.buckets.arms_of(self.table), estimates=tuple(est),
        )


def _check_table(table: Iterable[Sequence[object]], arms: Sequence[int]) -> Table:
    rows = [tuple(r) for r in table]
    if not rows:
        raise ValueError("table must have at least one row")
    prev = 0
    out: list[tuple[int | None, int]] = []
    for i, row in enumerate(rows):
        if len(row) != 2:
            raise ValueError(f"table row {i} must be (max_batch_size, k), got {row!r}")
        bound, k = row
        last = i == len(rows) - 1
        if bound is None:
            if not last:
                raise ValueError(f"table row {i}: only the last row may be unbounded")
        elif last or not isinstance(bound, int) or bound <= prev:
            raise ValueError(
                f"table row {i}: bound {bound!r} must be an int > {prev}, and the last row "
                "unbounded (None)"
            )
        else:
            prev = bound
        if not isinstance(k, int) or k not in arms:
            raise ValueError(f"table row {i}: k={k!r} is not a built arm {list(arms)}")
        out.append((bound, k))
    return tuple(out)


def _require_arm(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


class _ParamsPolicy(StaticPolicy):
    """A static policy whose table its parameters (a ``params_class`` instance) make."""

    params_class: type

    def __init__(self, *, arms: Iterable[int], buckets: Buckets | None = None, seed: int = 0,
                 params: Any = None) -> None:
        self.params = params or self.params_class()
        super().__init__(arms=arms, buckets=buckets, seed=seed)


class NeverPolicy(StaticPolicy):
    """No drafting anywhere (name ``"never"``); needs arm 0."""

    name = "never"

    def _make_table(self) -> Table:
        return ((None, 0),)


@dataclass(frozen=True, kw_only=True)
class AlwaysParams:
    """``k``: the arm for every batch size."""

    k: int = DEFAULT_THRESHOLD_K

    def __post_init__(self) -> None:
        _require_arm("k", self.k)


class AlwaysPolicy(_ParamsPolicy):
    """One arm everywhere (name ``"always"``)."""

    name = "always"
    params_class = AlwaysParams

    def _make_table(self) -> Table:
        return ((None, self.params.k),)


@dataclass(frozen=True, kw_only=True)
class ThresholdParams:
    """The seed's rule: arm ``k`` up to ``max_batch`` running requests, 0 above."""

    k: int = DEFAULT_THRESHOLD_K
    max_batch: int = DEFAULT_THRESHOLD_MAX_BATCH

    def __post_init__(self) -> None:
        _require_arm("k", self.k)
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) \
                or self.max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {self.max_batch!r}")


class ThresholdPolicy(_ParamsPolicy):
    """Fixed ``k`` up to ``max_batch``, no drafting above (name ``"threshold"``)."""

    name = "threshold"
    params_class = ThresholdParams

    def _make_table(self) -> Table:
        return ((self.params.max_batch, self.params.k), (None, 0))


@dataclass(frozen=True, kw_only=True)
class TableParams:
    """``table``: ``((max_batch_size, k), ..., (None, k))``."""

    table: tuple[tuple[int | None, int], ...] = ((None, 0),)

    def __post_init__(self) -> None:
        try:
            rows = tuple((r[0], r[1]) for r in self.table)
        except (TypeError, IndexError):
            raise ValueError(
                f"table must be (max_batch_size, k) rows, got {self.table!r}"
            ) from None
        object.__setattr__(self, "table", rows)


class TablePolicy(_ParamsPolicy):
    """Any fixed table (name ``"table"``)."""

    name = "table"
    params_class = TableParams

    def _make_table(self) -> Table:
        return self.params.table


# --- SGLang's default adaptive table ------------------------------------------------------


def sglang_settled_arm(
    candidates: Sequence[int],
    mean_accepted: Callable[[int], float] | Mapping[int, float],
    *,
    start: int | None = None,
    down_hysteresis: float = DEFAULT_SGLANG_DOWN_HYSTERESIS,
    up_hysteresis: float = DEFAULT_SGLANG_UP_HYSTERESIS,
) -> int:
    """The arm SGLang's EMA rule settles on for one slot, given the workload's acceptance.

    At arm ``c`` the EMA of the batch-mean accepted drafts converges to ``mean_accepted(c)``;
    each recompute then applies SGLang 0.5.23's rule (``sglang-integration.md`` §2): drop
    ``c_i -> c_{i-1}`` while ``ema <= c_{i-1} - 0.5 + down`` (``0.5 + down`` when
    ``c_{i-1} = 0``), possibly several levels; otherwise rise while ``ema > c_i - 0.5 + up``.
    At ``c = 0`` the EMA is frozen and each recompute probes one candidate up. The fixed
    point of that map is the settled arm. If the rule cycles (typically 0 <-> 1 when even
    one draft is rarely accepted), the smallest arm of the cycle is returned: SGLang keeps
    falling back to it.

    Args:
        candidates: the slot's candidate steps.
        mean_accepted: mean accepted drafts per request-step at each arm (bonus excluded).
        start: the arm the slot starts at; default SGLang's (3 if listed, else the middle
            candidate).
    """
    cands = sorted(set(int(c) for c in candidates))
    if not cands:
        raise ValueError("candidates must not be empty")
    acc = mean_accepted if callable(mean_accepted) else mean_accepted.__getitem__
    if start is None:
        start = DEFAULT_SGLANG_INITIAL_STEPS
    i = cands.index(start) if start in cands else len(cands) // 2
    seen: list[int] = []
    while i not in seen:
        seen.append(i)
        c = cands[i]
        if c == 0:
            j = min(i + 1, len(cands) - 1)
        else:
            ema = float(acc(c))
            j = i
            while j > 0:
                prev = cands[j - 1]
                threshold = (0.5 if prev == 0 else prev - 0.5) + down_hysteresis
                if ema <= threshold:
                    j -= 1
                else:
                    break
            if j == i:
                while j + 1 < len(cands) and ema > cands[j] - 0.5 + up_hysteresis:
                    j += 1
                    if cands[j] > c:  # from the new arm, the EMA moves towards acc(new)
                        break
        if j == i:
            return c
        i = j
    cycle = seen[seen.index(i):]
    return min(cands[x] for x in cycle)


def sglang_static_table(
    mean_accepted: Callable[[int], float] | Mapping[int, float] | None,
    *,
    arms: Sequence[int],
    slots: Sequence[tuple[int, Sequence[int]]] = DEFAULT_SGLANG_SLOTS,
    initial_steps: int = DEFAULT_SGLANG_INITIAL_STEPS,
    down_hysteresis: float = DEFAULT_SGLANG_DOWN_HYSTERESIS,
    up_hysteresis: float = DEFAULT_SGLANG_UP_HYSTERESIS,
    cuda_graph_bs: Sequence[int] = SGLANG_DEFAULT_CUDA_GRAPH_BS,
) -> Table:
    """SGLang's slot config as a policy table over raw batch sizes.

    Each slot's arm is :func:`sglang_settled_arm` (its starting arm when ``mean_accepted`` is
    None). Slots are lower bounds of the *padded* batch size, as SGLang routes them, so the
    table's bounds are where padding crosses a slot key (bs 31 pads to 32). An arm the server
    did not build maps to the largest built arm below it (the smallest built arm if none).
    """
    slot_keys = sorted(int(k) for k, _ in slots)
    by_key = {int(k): tuple(c) for k, c in slots}
    built = sorted(set(arms))

    def fit(k: int) -> int:
        lower = [a for a in built if a <= k]
        return lower[-1] if lower else built[0]

    slot_arm = {}
    for key in slot_keys:
        cands = by_key[key]
        if mean_accepted is None:
            c = sorted(cands)
            slot_arm[key] = initial_steps if initial_steps in c else c[len(c) // 2]
        else:
            slot_arm[key] = sglang_settled_arm(
                cands, mean_accepted, start=initial_steps,
                down_hysteresis=down_hysteresis, up_hysteresis=up_hysteresis,
            )
    graphs = sorted(cuda_graph_bs)

    def arm_at(b: int) -> int:
        i = bisect_left(graphs, b)
        padded = graphs[i] if i < len(graphs) else b
        pos = bisect_left(slot_keys, padded + 1) - 1  # largest key <= padded
        return fit(slot_arm[slot_keys[max(pos, 0)]])

    # Past the last slot key and the largest graph, nothing changes any more.
    horizon = max(slot_keys[-1], max(graphs) if graphs else 1) + 1
    return table_from_arms((b, arm_at(b)) for b in range(1, horizon + 1))


@dataclass(frozen=True, kw_only=True)
class SGLangDefaultParams:
    """SGLang's default adaptive config, settled for a workload.

    Give the workload's acceptance either as ``alpha``/``delta`` (chain model) or as
    ``mean_accepted`` (``((k, mean accepted drafts), ...)``); with neither, each slot keeps
    its starting arm.
    """

    alpha: float | None = None
    delta: float = 1.0
    mean_accepted: tuple[tuple[int, float], ...] | None = None
    slots: tuple[tuple[int, tuple[int, ...]], ...] = DEFAULT_SGLANG_SLOTS
    initial_steps: int = DEFAULT_SGLANG_INITIAL_STEPS
    down_hysteresis: float = DEFAULT_SGLANG_DOWN_HYSTERESIS
    up_hysteresis: float = DEFAULT_SGLANG_UP_HYSTERESIS

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if not 0 <= self.delta <= 1:
            raise ValueError(f"delta must be in [0, 1], got {self.delta!r}")
        if self.mean_accepted is not None:
            for k, m in self.mean_accepted:
                if not (isinstance(m, (int, float)) and math.isfinite(m) and 0 <= m <= k):
                    raise ValueError(f"mean_accepted[{k}] must be in [0, {k}], got {m!r}")
        if not self.slots:
            raise ValueError("slots must not be empty")
        for key, cands in self.slots:
            if not isinstance(key, int) or key < 1 or not cands or min(cands) < 0:
                raise ValueError(f"slots: bad slot {key!r}: {cands!r}")
        _require_arm("initial_steps", self.initial_steps)
        for name in ("down_hysteresis", "up_hysteresis"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")

    def accepted(self) -> Callable[[int], float] | None:
        if self.mean_accepted is not None:
            table = dict(self.mean_accepted)
            return lambda k: table[k]
        if self.alpha is not None:
            alpha, delta = self.alpha, self.delta
            return lambda k: expected_accepted(alpha, delta, k)
        return None


class SGLangDefaultPolicy(_ParamsPolicy):
    """SGLang 0.5.23's default adaptive table, settled for a workload (``"sglang-default"``)."""

    name = "sglang-default"
    params_class = SGLangDefaultParams

    def _make_table(self) -> Table:
        p = self.params
        return sglang_static_table(
            p.accepted(), arms=self.arms, slots=p.slots, initial_steps=p.initial_steps,
            down_hysteresis=p.down_hysteresis, up_hysteresis=p.up_hysteresis,
        )

"""Wire protocol v1 between the daemon, the SGLang plugin and the simulator.

This module is the protocol's only implementation. It is pure (builtins only) because the
plugin imports it inside SGLang's scheduler processes.

Read: ``GET /server_info`` -> ``internal_states[i]["dynspec"]``, a :class:`DynspecState`.
Write: ``POST /set_internal_state`` with ``{"server_args": encode_update(table, version)}``;
SGLang's request validation accepts only flat ``str -> number`` maps, so a table travels as
numbered keys (``dynspec_r<i>_max_bs``, ``dynspec_r<i>_k``; ``-1`` = no upper bound).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KEY_PREFIX",
    "MAX_INT",
    "MAX_ROWS",
    "PROTOCOL_VERSION",
    "UNBOUNDED",
    "CounterRow",
    "DynspecState",
    "ProtocolError",
    "Table",
    "TableIndex",
    "TreeShape",
    "counter_deltas",
    "decode_update",
    "encode_update",
    "format_table",
    "has_dynspec_keys",
    "lookup",
    "sglang_start_arm",
    "table_from_json",
    "table_to_json",
    "validate_table",
]

PROTOCOL_VERSION = 1
KEY_PREFIX = "dynspec_"
UNBOUNDED = -1
# A table has one row per bucket at most; SGLang's graph batch sizes give well under this.
MAX_ROWS = 64
# Every integer on the wire (versions, bounds, arms, counters) stays within what a JSON double
# holds exactly and a 64-bit database column stores: a hostile or broken peer sending 1e308
# must be refused here, not poison the history or lock the version out of reach.
MAX_INT = 2**53 - 1

Row = tuple[int | None, int]
Table = tuple[Row, ...]


class ProtocolError(ValueError):
    """A message or table that breaks protocol v1. The message says which rule."""


def _as_int(value: object, what: str) -> int:
    # bool is an int subclass, and SGLang's pydantic layer coerces true -> 1; we refuse it
    # here so a malformed update can never be read as a valid number.
    if isinstance(value, bool):
        raise ProtocolError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        out = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        out = int(value)
    else:
        raise ProtocolError(f"{what} must be an integer, got {value!r}")
    if not -MAX_INT <= out <= MAX_INT:
        raise ProtocolError(f"{what} must be within +-2^53, got {value!r}")
    return out


def _as_float(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"{what} must be a finite number, got {value!r}")
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:
        raise ProtocolError(f"{what} must be within +-2^53, got {value!r}")
    if not math.isfinite(value):
        raise ProtocolError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def validate_table(rows: Iterable[Sequence[object]], arms: Iterable[int] | None = None) -> Table:
    """Check a policy table and return it in canonical form.

    Rules: at least one row; every ``max_batch_size`` a positive integer, strictly
    increasing; only the last row unbounded (``None``), and it must be; every ``k`` among
    ``arms`` when arms are given.

    Raises:
        ProtocolError: naming the first rule broken.
    """
    try:
        raw = [tuple(r) for r in rows]
    except TypeError as exc:
        raise ProtocolError(f"table must be a list of [max_batch_size, k] rows: {exc}") from exc
    if not raw:
        raise ProtocolError("table must have at least one row")
    if len(raw) > MAX_ROWS:
        raise ProtocolError(f"table has {len(raw)} rows, at most {MAX_ROWS} allowed")
    allowed = None if arms is None else frozenset(arms)
    out: list[Row] = []
    prev = 0
    for i, row in enumerate(raw):
        if len(row) != 2:
            raise ProtocolError(f"row {i} must be [max_batch_size, k], got {list(row)!r}")
        bound, k = row
        last = i == len(raw) - 1
        if bound is None or bound == UNBOUNDED:
            if not last:
                raise ProtocolError(f"row {i}: only the last row may be unbounded")
            bound_v: int | None = None
        else:
            bound_v = _as_int(bound, f"row {i} max_batch_size")
            if last:
                raise ProtocolError(f"row {i}: the last row must be unbounded (null / -1)")
            if bound_v <= prev:
                raise ProtocolError(
                    f"row {i}: max_batch_size must be > {prev} (strictly increasing), "
                    f"got {bound_v}"
                )
            prev = bound_v
        k_v = _as_int(k, f"row {i} k")
        if k_v < 0:
            raise ProtocolError(f"row {i}: k must be >= 0, got {k_v}")
        if allowed is not None and k_v not in allowed:
            raise ProtocolError(f"row {i}: k={k_v} is not a built arm {sorted(allowed)}")
        out.append((bound_v, k_v))
    return tuple(out)


def lookup(table: Table, batch_size: int) -> int:
    """The arm a canonical table gives a batch size (first row whose bound is >= it)."""
    for bound, k in table:
        if bound is None or batch_size <= bound:
            return k
    return table[-1][1]


def sglang_start_arm(arms: Iterable[int]) -> int:
    """The step SGLang starts on without ``--speculative-num-steps``: the middle of the sorted
    candidate steps (``union[len // 2]``; sglang-integration.md, "Resolution"). A server's
    table before any update is this arm everywhere."""
    ordered = sorted(set(arms))
    return ordered[len(ordered) // 2]


def format_table(table: Table) -> str:
    """``b<=8:k5 b<=64:k3 rest:k1`` — compact, for logs and status lines."""
    return " ".join(f"b<={b}:k{k}" if b is not None else f"rest:k{k}" for b, k in table)


def table_to_json(table: Table) -> list[list[int | None]]:
    return [[b, k] for b, k in table]


def table_from_json(obj: object, arms: Iterable[int] | None = None) -> Table:
    if not isinstance(obj, list):
        raise ProtocolError(f"table must be a JSON list, got {type(obj).__name__}")
    return validate_table(obj, arms)


class TableIndex:
    """A table prepared for the hot path: bisect over the bounds (O(log rows), no allocation)."""

    __slots__ = ("bounds", "arms")

    def __init__(self, table: Table) -> None:
        self.bounds = [b for b, _ in table[:-1]]
        self.arms = [k for _, k in table]

    def __call__(self, batch_size: int) -> int:
        return self.arms[bisect_left(self.bounds, batch_size)]


# --- write direction ------------------------------------------------------------------------


def encode_update(table: Table, version: int) -> dict[str, int]:
    """Flatten a table for ``/set_internal_state``'s ``server_args`` (numbers only)."""
    table = validate_table(table)
    if version < 1:
        raise ProtocolError(f"version must be >= 1, got {version}")
    flat = {
        "dynspec_protocol": PROTOCOL_VERSION,
        "dynspec_version": int(version),
        "dynspec_rows": len(table),
    }
    for i, (bound, k) in enumerate(table):
        flat[f"dynspec_r{i}_max_bs"] = UNBOUNDED if bound is None else bound
        flat[f"dynspec_r{i}_k"] = k
    return flat


def has_dynspec_keys(server_args: Mapping[str, object]) -> bool:
    return any(isinstance(key, str) and key.startswith(KEY_PREFIX) for key in server_args)


def decode_update(
    server_args: Mapping[str, object], *, arms: Iterable[int], current_version: int
) -> tuple[Table, int]:
    """Validate the ``dynspec_*`` keys of an update as a whole and return ``(table, version)``.

    Keys without the prefix are ignored (they belong to SGLang). Nothing here mutates state:
    the caller applies the result only if this returns.

    Raises:
        ProtocolError: naming the rule broken; the update must then change nothing.
    """
    if not isinstance(server_args, Mapping):
        raise ProtocolError(f"server_args must be an object, got {type(server_args).__name__}")
    ours = {k: v for k, v in server_args.items() if isinstance(k, str) and k.startswith(KEY_PREFIX)}
    if "dynspec_protocol" not in ours:
        raise ProtocolError("dynspec_protocol is missing")
    proto = _as_int(ours["dynspec_protocol"], "dynspec_protocol")
    if proto != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: update speaks v{proto}, this side speaks "
            f"v{PROTOCOL_VERSION}"
        )
    for key in ("dynspec_version", "dynspec_rows"):
        if key not in ours:
            raise ProtocolError(f"{key} is missing")
    version = _as_int(ours["dynspec_version"], "dynspec_version")
    if version <= current_version:
        raise ProtocolError(
            f"dynspec_version {version} is not greater than the current version "
            f"{current_version}"
        )
    n = _as_int(ours["dynspec_rows"], "dynspec_rows")
    if not 1 <= n <= MAX_ROWS:
        raise ProtocolError(f"dynspec_rows must be in 1..{MAX_ROWS}, got {n}")
    expected = {"dynspec_protocol", "dynspec_version", "dynspec_rows"}
    rows = []
    for i in range(n):
        bk, kk = f"dynspec_r{i}_max_bs", f"dynspec_r{i}_k"
        if bk not in ours or kk not in ours:
            raise ProtocolError(f"row {i} is missing ({bk} and {kk} are required)")
        rows.append((ours[bk], ours[kk]))
        expected.update((bk, kk))
    extra = sorted(set(ours) - expected)
    if extra:
        raise ProtocolError(f"unexpected keys for a {n}-row table: {', '.join(extra[:5])}")
    return validate_table(rows, arms), version


# --- read direction -------------------------------------------------------------------------

COUNTER_FIELDS = (
    "b",
    "k",
    "decode_steps",
    "emitted_tokens",
    "accepted_drafts",
    "drafted_tokens",
    "busy_s",
)


@dataclass(frozen=True, slots=True)
class CounterRow:
    """Cumulative counters of one ``(batch size, arm)`` since the server started."""

    b: int
    k: int
    decode_steps: int
    emitted_tokens: int
    accepted_drafts: int
    drafted_tokens: int
    busy_s: float

    def to_json(self) -> list[int | float]:
        return [
            self.b,
            self.k,
            self.decode_steps,
            self.emitted_tokens,
            self.accepted_drafts,
            self.drafted_tokens,
            self.busy_s,
        ]

    @classmethod
    def from_json(cls, row: object) -> CounterRow:
        if not isinstance(row, (list, tuple)) or len(row) != len(COUNTER_FIELDS):
            raise ProtocolError(f"counter row must have {len(COUNTER_FIELDS)} numbers: {row!r}")
        ints = [_as_int(v, f"counter {name}") for v, name in zip(row[:6], COUNTER_FIELDS)]
        busy = _as_float(row[6], "counter busy_s")
        if min(ints) < 0 or busy < 0:
            raise ProtocolError(f"counter row has a negative value: {row!r}")
        if ints[0] < 1:
            raise ProtocolError(f"counter batch size must be >= 1: {row!r}")
        return cls(*ints, float(busy))


def counter_deltas(
    before: Iterable[CounterRow], after: Iterable[CounterRow]
) -> tuple[CounterRow, ...] | None:
    """What accrued between two readings of one replica's cumulative counters.

    Returns the per-``(b, k)`` differences that contain decode steps, in ``(b, k)`` order, or
    None when the counters cannot come from the same run (a row vanished or a counter went
    backwards: the server restarted in between). Busy seconds tolerate float round-off.
    """
    old = {(c.b, c.k): c for c in before}
    new = {(c.b, c.k): c for c in after}
    if any(key not in new for key in old):
        return None
    out = []
    for key in sorted(new):
        c, o = new[key], old.get(key)
        if o is None:
            d = c
        else:
            d = CounterRow(
                c.b,
                c.k,
                c.decode_steps - o.decode_steps,
                c.emitted_tokens - o.emitted_tokens,
                c.accepted_drafts - o.accepted_drafts,
                c.drafted_tokens - o.drafted_tokens,
                max(c.busy_s - o.busy_s, 0.0),
            )
            if min(d.decode_steps, d.emitted_tokens, d.accepted_drafts, d.drafted_tokens) < 0 or (
                c.busy_s < o.busy_s - 1e-9
            ):
                return None
        if d.decode_steps:
            out.append(d)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TreeShape:
    """The draft tree a server's non-zero arm runs (``--speculative-eagle-topk`` > 1).

    A tree server has two arms, ``0`` and ``steps``; the readout names the arm by its depth
    ``steps`` and describes the tree here. Its counters keep the chain meaning of
    ``drafted_tokens``: ``steps`` per request (the depth a verify can accept), not the
    ``draft_tokens - 1`` tree nodes, so ``accepted / drafted`` stays a per-depth rate in [0, 1].
    """

    topk: int
    steps: int
    draft_tokens: int

    def __post_init__(self) -> None:
        for name in ("topk", "steps", "draft_tokens"):
            _as_int(getattr(self, name), f"tree {name}")
        if self.topk < 2:
            raise ProtocolError(f"tree topk must be >= 2 (1 is a chain), got {self.topk}")
        if self.steps < 1:
            raise ProtocolError(f"tree steps must be >= 1, got {self.steps}")
        if self.draft_tokens < 2:
            raise ProtocolError(f"tree draft_tokens must be >= 2, got {self.draft_tokens}")

    def to_json(self) -> dict[str, int]:
        return {"topk": self.topk, "steps": self.steps, "draft_tokens": self.draft_tokens}

    @classmethod
    def from_json(cls, obj: object) -> TreeShape:
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"tree must be an object, got {type(obj).__name__}")
        try:
            return cls(
                topk=_as_int(obj["topk"], "tree topk"),
                steps=_as_int(obj["steps"], "tree steps"),
                draft_tokens=_as_int(obj["draft_tokens"], "tree draft_tokens"),
            )
        except KeyError as exc:
            raise ProtocolError(f"tree lacks field {exc.args[0]!r}") from exc


@dataclass(frozen=True)
class DynspecState:
    """The ``"dynspec"`` section one DP replica reports."""

    arms: tuple[int, ...]
    policy_version: int
    table: Table
    counters: tuple[CounterRow, ...]
    started_at: float
    updates_applied: int = 0
    updates_rejected: int = 0
    hooks_live: bool = True
    reason: str | None = None
    untimed_steps: int = 0
    last_rejection: str | None = None
    protocol: int = PROTOCOL_VERSION
    # Present only on a tree server (v1-compatible: readers that do not know it ignore it).
    tree: TreeShape | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "protocol": self.protocol,
            "arms": list(self.arms),
            "policy_version": self.policy_version,
            "table": table_to_json(self.table),
            "counters": [c.to_json() for c in self.counters],
            "started_at": self.started_at,
            "updates_applied": self.updates_applied,
            "updates_rejected": self.updates_rejected,
            "hooks_live": self.hooks_live,
            "untimed_steps": self.untimed_steps,
        }
        if self.reason is not None:
            out["reason"] = self.reason
        if self.last_rejection is not None:
            out["last_rejection"] = self.last_rejection
        if self.tree is not None:
            out["tree"] = self.tree.to_json()
        return out

    @classmethod
    def from_json(cls, obj: object) -> DynspecState:
        """Parse and validate a readout.

        Raises:
            ProtocolError: on any missing or malformed field, or another protocol version.
        """
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"dynspec section must be an object, got {type(obj).__name__}")
        try:
            proto = _as_int(obj["protocol"], "protocol")
            if proto != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"protocol version mismatch: server speaks v{proto}, this side speaks "
                    f"v{PROTOCOL_VERSION}"
                )
            arms_raw = obj["arms"]
            if not isinstance(arms_raw, list) or not arms_raw:
                raise ProtocolError("arms must be a non-empty list")
            arms = tuple(sorted({_as_int(a, "arm") for a in arms_raw}))
            if arms[0] < 0:
                raise ProtocolError(f"arms must be >= 0, got {list(arms)}")
            counters_raw = obj["counters"]
            if not isinstance(counters_raw, list):
                raise ProtocolError("counters must be a list")
            started = obj["started_at"]
            if isinstance(started, bool) or not isinstance(started, (int, float)):
                raise ProtocolError(f"started_at must be a number, got {started!r}")
            # Finite: NaN never equals itself, and would read as a restart at every tick.
            started = _as_float(started, "started_at")
            version = _as_int(obj["policy_version"], "policy_version")
            if version < 0:
                raise ProtocolError(f"policy_version must be >= 0, got {version}")
            tree = None if obj.get("tree") is None else TreeShape.from_json(obj["tree"])
            if tree is not None and tree.steps not in arms:
                raise ProtocolError(f"tree steps {tree.steps} is not among arms {list(arms)}")
            hooks_live = obj.get("hooks_live", True)
            if not isinstance(hooks_live, bool):
                # bool("false") is True: a malformed flag must not read as live hooks.
                raise ProtocolError(f"hooks_live must be true or false, got {hooks_live!r}")
            return cls(
                arms=arms,
                policy_version=version,
                table=table_from_json(obj["table"], arms),
                counters=tuple(CounterRow.from_json(r) for r in counters_raw),
                started_at=started,
                updates_applied=_as_int(obj.get("updates_applied", 0), "updates_applied"),
                updates_rejected=_as_int(obj.get("updates_rejected", 0), "updates_rejected"),
                hooks_live=hooks_live,
                reason=None if obj.get("reason") is None else str(obj.get("reason")),
                untimed_steps=_as_int(obj.get("untimed_steps", 0), "untimed_steps"),
                last_rejection=(
                    None if obj.get("last_rejection") is None else str(obj["last_rejection"])
                ),
                protocol=proto,
                tree=tree,
            )
        except KeyError as exc:
            raise ProtocolError(f"dynspec section lacks field {exc.args[0]!r}") from exc

"""Tables and the validation rules every protocol message shares (pure: builtins only)."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence

# This side writes v2 and reads v1 and v2 (a fleet upgrades one server at a time).
PROTOCOL_VERSION = 2
SUPPORTED_PROTOCOLS = (1, 2)
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
    """A message or table that breaks the protocol. The message says which rule."""


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

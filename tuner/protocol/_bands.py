"""Acceptance bands, batch-size classes and banded tables (protocol v2; builtins only).

A v2 table maps ``(batch-size bucket, acceptance band) -> k``. The band is the plugin's live
per-position acceptance estimate of the running batch (:mod:`tuner.plugin.acceptance`), cut
at :data:`BAND_EDGES`; band :data:`UNKNOWN_BAND` is "no recent evidence" (nothing drafted
for a while, or the server just started). A row's unknown-band ``k`` is its band-agnostic
choice: a v1 table is a v2 table whose every band equals it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence

from tuner.protocol._base import (
    MAX_ROWS,
    ProtocolError,
    Table,
    _as_int,
    validate_table,
)

UNKNOWN_BAND = 0
# Upper edges of the known bands 1..4 on the per-position acceptance alpha: band 1 is
# alpha < 0.55, band 4 is alpha >= 0.85. Fixed by the protocol (both sides must agree on what
# a band means); changing them is a protocol version change.
BAND_EDGES = (0.55, 0.70, 0.85)
N_BANDS = len(BAND_EDGES) + 2  # the unknown band and the known ones
# The band counters' batch-size classes (upper bounds; a last class takes the rest). Step
# time is kept per exact batch size; acceptance varies with the band and k, not b, so it is
# kept per class, which is what keeps the readout bounded (docs/protocol.md).
CLASS_EDGES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# The largest batch whose requests the plugin looks at one by one (a class edge): above it the
# band counters count no first-draft rejections (the hook's cost stays flat in the batch size;
# BandCounter.first_counted).
COUNTED_MAX_BATCH = 32
# How many drafts each request accepted (DepthCounter) is counted on one decode forward in
# this many (by forward_iter, the same on every rank), for at most COUNTED_MAX_BATCH of its
# requests: a few hundred requests a second is plenty, and the count costs a loop over them.
DEPTH_EVERY = 8
N_CLASSES = len(CLASS_EDGES) + 1
# Batch sizes a table index expands into a flat list (above: bisect).
_FLAT_MAX_BS = 4096

BandRow = tuple[int | None, tuple[int, ...]]
BandTable = tuple[BandRow, ...]


def band_of(alpha: float) -> int:
    """The known band (1..) of a per-position acceptance estimate."""
    return 1 + bisect_right(BAND_EDGES, alpha)


def class_of(batch_size: int) -> int:
    """The batch-size class (0..N_CLASSES-1) a batch size falls in."""
    return bisect_left(CLASS_EDGES, batch_size)


def class_range(cls: int) -> tuple[int, int | None]:
    """``(lowest, highest)`` batch size of a class; ``None``: no upper bound."""
    lo = 1 if cls == 0 else CLASS_EDGES[cls - 1] + 1
    return lo, CLASS_EDGES[cls] if cls < len(CLASS_EDGES) else None


def banded(table: Table) -> BandTable:
    """A v1 table as a v2 table: every band of a row runs the row's ``k``."""
    return tuple((bound, (k,) * N_BANDS) for bound, k in table)


def band_agnostic(table: BandTable) -> Table:
    """Each row's band-agnostic choice (its unknown-band ``k``): what a v1 reader sees."""
    return tuple((bound, ks[UNKNOWN_BAND]) for bound, ks in table)


def is_uniform(table: BandTable) -> bool:
    return all(len(set(ks)) == 1 for _, ks in table)


def validate_band_table(
    rows: Iterable[Sequence[object]], arms: Iterable[int] | None = None
) -> BandTable:
    """Check a banded table and return it in canonical form.

    A row is ``[max_batch_size, k]`` (every band runs ``k``) or
    ``[max_batch_size, k_unknown, k_band1, ..., k_band4]``. The bounds and every ``k`` follow
    :func:`validate_table`'s rules. One more rule keeps speculation from locking off: a row
    whose known bands draft anywhere (some ``k > 0``) must draft in the unknown band too, so
    that once the estimate has gone stale (nothing drafted for a while) the next step drafts
    and measures acceptance again.

    Raises:
        ProtocolError: naming the first rule broken.
    """
    try:
        raw = [tuple(r) for r in rows]
    except TypeError as exc:
        raise ProtocolError(f"table must be a list of rows: {exc}") from exc
    if len(raw) > MAX_ROWS:
        raise ProtocolError(f"table has {len(raw)} rows, at most {MAX_ROWS} allowed")
    widths = (2, N_BANDS + 1)
    for i, row in enumerate(raw):
        if len(row) not in widths:
            raise ProtocolError(
                f"row {i} must be [max_batch_size, k] or [max_batch_size, k_unknown, "
                f"{N_BANDS - 1} band ks], got {list(row)!r}"
            )
    allowed = None if arms is None else list(arms)
    agnostic = validate_table([(r[0], r[1]) for r in raw], allowed)
    out: list[BandRow] = []
    for i, (row, (bound, k0)) in enumerate(zip(raw, agnostic, strict=True)):
        if len(row) == 2:
            out.append((bound, (k0,) * N_BANDS))
            continue
        ks = [k0]
        for j, v in enumerate(row[2:], start=1):
            # The same rules as the row's own k, through a one-row table.
            (_, kv), = validate_table([(None, _as_int(v, f"row {i} band {j} k"))], allowed)
            ks.append(kv)
        if k0 == 0 and any(ks):
            raise ProtocolError(
                f"row {i}: the unknown band must draft (k > 0) where a known band does, or a "
                f"stale estimate would lock speculation off, got {ks}"
            )
        out.append((bound, tuple(ks)))
    return tuple(out)


def band_table_to_json(table: BandTable) -> list[list[int | None]]:
    """Uniform rows as v1's ``[bound, k]``, others with every band's ``k``."""
    return [
        [b, ks[0]] if len(set(ks)) == 1 else [b, *ks] for b, ks in table
    ]


def format_band_table(table: BandTable) -> str:
    """``b<=8:k5 b<=64:k3/1,1,3,5 rest:k1`` (unknown band / known bands where they differ)."""
    parts = []
    for b, ks in table:
        head = f"b<={b}" if b is not None else "rest"
        tail = f"k{ks[0]}" if len(set(ks)) == 1 else f"k{ks[0]}/{','.join(map(str, ks[1:]))}"
        parts.append(f"{head}:{tail}")
    return " ".join(parts)


def band_row_keys(i: int) -> list[str]:
    """The update keys of row ``i``'s known bands (protocol v2)."""
    return [f"dynspec_r{i}_k{j}" for j in range(1, N_BANDS)]


class BandIndex:
    """A banded table prepared for the hot path: ``ks_for(b)[band]``.

    Batch sizes up to the last finite bound (at most 4096) index a flat list; above, a bisect.
    """

    __slots__ = ("bounds", "rows", "flat", "n_flat")

    def __init__(self, table: BandTable) -> None:
        self.bounds = [b for b, _ in table[:-1]]
        self.rows = [ks for _, ks in table]
        top = min(self.bounds[-1], _FLAT_MAX_BS) if self.bounds else 0
        self.flat = [self.rows[bisect_left(self.bounds, b)] for b in range(top + 1)]
        self.n_flat = top + 1

    def ks_for(self, batch_size: int) -> tuple[int, ...]:
        if 0 <= batch_size < self.n_flat:
            return self.flat[batch_size]
        return self.rows[bisect_left(self.bounds, batch_size)]

    def __call__(self, batch_size: int, band: int = UNKNOWN_BAND) -> int:
        return self.ks_for(batch_size)[band]


__all__ = [
    "BAND_EDGES",
    "CLASS_EDGES",
    "N_BANDS",
    "N_CLASSES",
    "UNKNOWN_BAND",
    "BandIndex",
    "BandRow",
    "BandTable",
    "band_agnostic",
    "band_of",
    "band_row_keys",
    "band_table_to_json",
    "banded",
    "class_of",
    "class_range",
    "format_band_table",
    "is_uniform",
    "validate_band_table",
]

"""Tables of either protocol as the daemon keeps them.

A server whose policy learns per acceptance band (protocol v2, not a tree) is given banded
tables; every other server band-agnostic ones. The daemon keeps a table in one canonical
form so that "the server already runs it" is a plain comparison: a banded table whose every
row runs one ``k`` in all bands is kept as the v1 table it equals; only a table whose bands
differ is a :data:`~tuner.protocol.BandTable`. Consumers that understand only v1 tables (the
gain, the switchback's baseline, the history's ``table`` column, reports) read :func:`flat`:
each row's unknown-band ``k``, which is what a v1 reader of that table would run.
"""

from __future__ import annotations

from collections.abc import Iterable

from tuner.protocol import (
    BandTable,
    Table,
    band_agnostic,
    format_band_table,
    format_table,
    is_uniform,
    validate_band_table,
    validate_table,
)

AnyTable = Table | BandTable


def is_banded(table: AnyTable | None) -> bool:
    return bool(table) and isinstance(table[0][1], tuple)  # type: ignore[index]


def canon(table: AnyTable) -> AnyTable:
    """The daemon's form of a table: v1 where its bands agree."""
    if is_banded(table) and is_uniform(table):  # type: ignore[arg-type]
        return band_agnostic(table)  # type: ignore[arg-type]
    return table


def flat(table: AnyTable) -> Table:
    """What a v1 reader of ``table`` runs (each row's unknown-band ``k``)."""
    return band_agnostic(table) if is_banded(table) else table  # type: ignore[arg-type]


def validate_any(table: AnyTable, arms: Iterable[int]) -> AnyTable:
    """Check a proposal by the protocol's rules and return it in canonical form.

    Raises:
        ProtocolError: naming the first rule broken.
    """
    if is_banded(table):
        rows = ((b, *ks) for b, ks in table)  # type: ignore[misc]
        return canon(validate_band_table(rows, arms))
    return validate_table(table, arms)  # type: ignore[arg-type]


def show_table(table: AnyTable) -> str:
    """``b<=8:k5 rest:k1``; a banded row as ``k3/1,1,3,5`` (unknown band / bands 1..4)."""
    if is_banded(table):
        return format_band_table(table)  # type: ignore[arg-type]
    return format_table(table)  # type: ignore[arg-type]


__all__ = ["AnyTable", "canon", "flat", "is_banded", "show_table", "validate_any"]

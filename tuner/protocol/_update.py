"""The write direction: a table as ``/set_internal_state``'s flat numeric keys (v1 and v2).

SGLang's request validation accepts only flat ``str -> number`` maps, so a table travels as
numbered keys: ``dynspec_r<i>_max_bs`` (``-1`` = no upper bound) and ``dynspec_r<i>_k`` (the
row's band-agnostic ``k``, which is also its unknown band's). Protocol v2 adds, per row and
only for a banded table, ``dynspec_r<i>_k1`` .. ``_k4``. A v1 update is therefore a valid v2
update with one band, and a v2 plugin applies either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from tuner.protocol._bands import (
    N_BANDS,
    BandTable,
    band_row_keys,
    is_uniform,
    validate_band_table,
)
from tuner.protocol._base import (
    KEY_PREFIX,
    MAX_ROWS,
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOLS,
    UNBOUNDED,
    ProtocolError,
    Table,
    _as_int,
)


def as_band_table(table: Sequence[Sequence[object]]) -> BandTable:
    """A v1 table (``(bound, k)`` rows) or a banded one (``(bound, ks)`` rows), as banded."""
    if table and isinstance(table[0][1], tuple):
        return validate_band_table((b, *ks) for b, ks in table)  # type: ignore[misc]
    return validate_band_table(table)


def encode_update(
    table: Table | BandTable, version: int, *, protocol: int = PROTOCOL_VERSION
) -> dict[str, int]:
    """Flatten a table for ``/set_internal_state``'s ``server_args`` (numbers only).

    ``protocol`` is the version the receiving plugin speaks (from its readout): a v1 plugin
    gets v1 keys, and only a band-agnostic table can be sent to it.

    Raises:
        ProtocolError: an invalid table or version, or a banded table for a v1 plugin.
    """
    bt = as_band_table(table)
    if protocol not in SUPPORTED_PROTOCOLS:
        raise ProtocolError(f"cannot write protocol v{protocol}, only {SUPPORTED_PROTOCOLS}")
    if version < 1:
        raise ProtocolError(f"version must be >= 1, got {version}")
    uniform = is_uniform(bt)
    if protocol == 1 and not uniform:
        raise ProtocolError("a banded table cannot be sent to a protocol v1 plugin")
    flat = {
        "dynspec_protocol": protocol,
        "dynspec_version": int(version),
        "dynspec_rows": len(bt),
    }
    for i, (bound, ks) in enumerate(bt):
        flat[f"dynspec_r{i}_max_bs"] = UNBOUNDED if bound is None else bound
        flat[f"dynspec_r{i}_k"] = ks[0]
        if not uniform:
            flat.update(zip(band_row_keys(i), ks[1:], strict=True))
    return flat


def has_dynspec_keys(server_args: Mapping[str, object]) -> bool:
    return any(isinstance(key, str) and key.startswith(KEY_PREFIX) for key in server_args)


def decode_update(
    server_args: Mapping[str, object],
    *,
    arms: Iterable[int],
    current_version: int,
    accept: Sequence[int] = SUPPORTED_PROTOCOLS,
) -> tuple[BandTable, int]:
    """Validate the ``dynspec_*`` keys of an update as a whole and return ``(table, version)``.

    Keys without the prefix are ignored (they belong to SGLang). Nothing here mutates state:
    the caller applies the result only if this returns. ``accept``: the protocol versions
    this side applies (a plugin that speaks only v1 passes ``(1,)``).

    Raises:
        ProtocolError: naming the rule broken; the update must then change nothing.
    """
    if not isinstance(server_args, Mapping):
        raise ProtocolError(f"server_args must be an object, got {type(server_args).__name__}")
    ours = {k: v for k, v in server_args.items() if isinstance(k, str) and k.startswith(KEY_PREFIX)}
    if "dynspec_protocol" not in ours:
        raise ProtocolError("dynspec_protocol is missing")
    proto = _as_int(ours["dynspec_protocol"], "dynspec_protocol")
    if proto not in accept:
        speaks = "/".join(f"v{p}" for p in accept)
        raise ProtocolError(
            f"protocol version mismatch: update speaks v{proto}, this side speaks {speaks}"
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
    banded_rows = proto >= 2 and "dynspec_r0_k1" in ours
    rows: list[tuple[object, ...]] = []
    for i in range(n):
        bk, kk = f"dynspec_r{i}_max_bs", f"dynspec_r{i}_k"
        if bk not in ours or kk not in ours:
            raise ProtocolError(f"row {i} is missing ({bk} and {kk} are required)")
        row: list[object] = [ours[bk], ours[kk]]
        expected.update((bk, kk))
        if banded_rows:
            keys = band_row_keys(i)
            missing = [key for key in keys if key not in ours]
            if missing:
                raise ProtocolError(
                    f"row {i} lacks {', '.join(missing)} (a banded update gives every row "
                    f"its {N_BANDS - 1} band ks)"
                )
            row.extend(ours[key] for key in keys)
            expected.update(keys)
        rows.append(tuple(row))
    extra = sorted(set(ours) - expected)
    if extra:
        raise ProtocolError(f"unexpected keys for a {n}-row table: {', '.join(extra[:5])}")
    table = validate_band_table(rows, arms)
    return table, version


__all__ = ["as_band_table", "decode_update", "encode_update", "has_dynspec_keys"]

"""The write direction: a table as ``/set_internal_state``'s flat numeric keys (v1 and v2).

SGLang's request validation accepts only flat ``str -> number`` maps, so a table travels as
numbered keys: ``dynspec_r<i>_max_bs`` (``-1`` = no upper bound) and ``dynspec_r<i>_k`` (the
row's band-agnostic ``k``, which is also its unknown band's). Protocol v2 adds, per row and
only for a banded table, ``dynspec_r<i>_k1`` .. ``_k4``. A v1 update is therefore a valid v2
update with one band, and a v2 plugin applies either.

Protocol v2 may also carry **probes** (``dynspec_probes`` and ``dynspec_p<j>_*``): a range of
batch sizes that runs one ``k`` in every band for its next ``steps`` decode launches and then
goes back to the table. An exploring measurement then costs a few steps instead of the time
until the next update (docs/protocol.md, "Probes").
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

# A probe: batch sizes ``lo..hi`` (``hi`` None: no upper bound) run ``k`` in every band for
# their next ``steps`` decode launches.
Probe = tuple[int, int | None, int, int]
PROBE_FIELDS = ("min_bs", "max_bs", "k", "steps")
# A probe longer than this is a table row, not a probe.
MAX_PROBE_STEPS = 1_000_000


def validate_probes(probes: Iterable[Sequence[object]], arms: Iterable[int] | None = None
                    ) -> tuple[Probe, ...]:
    """Check probes and return them in canonical form.

    Rules: at most ``MAX_ROWS``; ``1 <= lo <= hi`` (``hi`` None only for the last); ranges
    sorted and disjoint; ``k`` a built arm when arms are given; ``1 <= steps <=
    MAX_PROBE_STEPS``.

    Raises:
        ProtocolError: naming the first rule broken.
    """
    try:
        raw = [tuple(p) for p in probes]
    except TypeError as exc:
        raise ProtocolError(f"probes must be a list of [lo, hi, k, steps]: {exc}") from exc
    if len(raw) > MAX_ROWS:
        raise ProtocolError(f"{len(raw)} probes, at most {MAX_ROWS} allowed")
    allowed = None if arms is None else set(arms)
    out: list[Probe] = []
    for j, p in enumerate(raw):
        if len(p) != 4:
            raise ProtocolError(f"probe {j} must be [lo, hi, k, steps], got {list(p)!r}")
        lo = _as_int(p[0], f"probe {j} lo")
        hi = None if p[1] is None or p[1] == UNBOUNDED else _as_int(p[1], f"probe {j} hi")
        k = _as_int(p[2], f"probe {j} k")
        steps = _as_int(p[3], f"probe {j} steps")
        if lo < 1 or (hi is not None and hi < lo):
            raise ProtocolError(f"probe {j} covers {lo}..{hi}: need 1 <= lo <= hi")
        if out and (out[-1][1] is None or lo <= out[-1][1]):
            raise ProtocolError(f"probe {j} ({lo}..) overlaps or precedes probe {j - 1}")
        if allowed is not None and k not in allowed:
            raise ProtocolError(f"probe {j}: k={k} is not a built arm {sorted(allowed)}")
        if not 1 <= steps <= MAX_PROBE_STEPS:
            raise ProtocolError(f"probe {j} steps must be in 1..{MAX_PROBE_STEPS}, got {steps}")
        out.append((lo, hi, k, steps))
    return tuple(out)


def probes_to_json(probes: Iterable[Probe]) -> list[list[int]]:
    """``[[lo, hi, k, steps], ...]`` with ``hi`` UNBOUNDED (-1) where there is none: the
    readout's form, which :func:`validate_probes` reads back."""
    return [[lo, UNBOUNDED if hi is None else hi, k, n] for lo, hi, k, n in probes]


def probe_keys(j: int) -> list[str]:
    """The update keys of probe ``j`` (protocol v2)."""
    return [f"dynspec_p{j}_{f}" for f in PROBE_FIELDS]


def as_band_table(table: Sequence[Sequence[object]]) -> BandTable:
    """A v1 table (``(bound, k)`` rows) or a banded one (``(bound, ks)`` rows), as banded."""
    if table and isinstance(table[0][1], tuple):
        return validate_band_table((b, *ks) for b, ks in table)  # type: ignore[misc]
    return validate_band_table(table)


def encode_update(
    table: Table | BandTable, version: int, *, protocol: int = PROTOCOL_VERSION,
    probes: Sequence[Probe] = (),
) -> dict[str, int]:
    """Flatten a table (and probes) for ``/set_internal_state``'s ``server_args`` (numbers only).

    ``protocol`` is the version the receiving plugin speaks (from its readout): a v1 plugin
    gets v1 keys, and only a band-agnostic table without probes can be sent to it.

    Raises:
        ProtocolError: an invalid table, probe or version, or a banded table or probes for a
            v1 plugin.
    """
    bt = as_band_table(table)
    checked = validate_probes(probes)
    if checked and protocol < 2:
        raise ProtocolError("probes cannot be sent to a protocol v1 plugin")
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
    if checked:
        flat["dynspec_probes"] = len(checked)
        for j, values in enumerate(probes_to_json(checked)):
            flat.update(zip(probe_keys(j), values, strict=True))
    return flat


def has_dynspec_keys(server_args: Mapping[str, object]) -> bool:
    return any(isinstance(key, str) and key.startswith(KEY_PREFIX) for key in server_args)


def decode_update_with_probes(
    server_args: Mapping[str, object],
    *,
    arms: Iterable[int],
    current_version: int,
    accept: Sequence[int] = SUPPORTED_PROTOCOLS,
) -> tuple[BandTable, int, tuple[Probe, ...]]:
    """Validate the ``dynspec_*`` keys of an update as a whole and return ``(table, version)``.

    Keys without the prefix are ignored (they belong to SGLang). Nothing here mutates state:
    the caller applies the result only if this returns. ``accept``: the protocol versions
    this side applies (a plugin that speaks only v1 passes ``(1,)``).

    Raises:
        ProtocolError: naming the rule broken; the update must then change nothing.
    """
    if not isinstance(server_args, Mapping):
        raise ProtocolError(f"server_args must be an object, got {type(server_args).__name__}")
    ours = _ours(server_args)
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
    probes = _probe_rows(ours, proto, expected)
    extra = sorted(set(ours) - expected)
    if extra:
        raise ProtocolError(f"unexpected keys for a {n}-row table: {', '.join(extra[:5])}")
    table = validate_band_table(rows, arms)
    return table, version, validate_probes(probes, arms)


def decode_update(
    server_args: Mapping[str, object],
    *,
    arms: Iterable[int],
    current_version: int,
    accept: Sequence[int] = SUPPORTED_PROTOCOLS,
) -> tuple[BandTable, int]:
    """:func:`decode_update_with_probes` without the probes."""
    table, version, _ = decode_update_with_probes(
        server_args, arms=arms, current_version=current_version, accept=accept
    )
    return table, version


def decode_probes(server_args: Mapping[str, object], *, arms: Iterable[int]) -> tuple[Probe, ...]:
    """The probes of an update (none in a v1 update), validated as
    :func:`decode_update_with_probes` validates them, the table and version aside."""
    ours = _ours(server_args)
    proto = _as_int(ours.get("dynspec_protocol"), "dynspec_protocol")
    return validate_probes(_probe_rows(ours, proto, set()), arms)


def _ours(server_args: Mapping[str, object]) -> dict[str, object]:
    """The update's ``dynspec_*`` keys (the rest belong to SGLang)."""
    return {k: v for k, v in server_args.items()
            if isinstance(k, str) and k.startswith(KEY_PREFIX)}


def _probe_rows(ours: Mapping[str, object], proto: int, expected: set[str]) -> list[tuple]:
    if "dynspec_probes" not in ours:
        return []
    if proto < 2:
        raise ProtocolError("a protocol v1 update has no probes")
    m = _as_int(ours["dynspec_probes"], "dynspec_probes")
    if not 0 <= m <= MAX_ROWS:
        raise ProtocolError(f"dynspec_probes must be in 0..{MAX_ROWS}, got {m}")
    expected.add("dynspec_probes")
    rows = []
    for j in range(m):
        keys = probe_keys(j)
        missing = [key for key in keys if key not in ours]
        if missing:
            raise ProtocolError(f"probe {j} lacks {', '.join(missing)}")
        expected.update(keys)
        rows.append(tuple(ours[key] for key in keys))
    return rows


__all__ = [
    "MAX_PROBE_STEPS",
    "Probe",
    "as_band_table",
    "decode_probes",
    "decode_update",
    "decode_update_with_probes",
    "encode_update",
    "has_dynspec_keys",
    "probe_keys",
    "probes_to_json",
    "validate_probes",
]

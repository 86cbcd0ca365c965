"""The ``dynspec`` policy file: a learned table plus where it came from.

``dynspec-tuner export --format dynspec`` writes one with :func:`save`; the SGLang plugin
reads it at server start (``DYNSPEC_POLICY_FILE``) with :func:`load` and installs its table
as if it had arrived as a protocol v1 update. Builtins only (json): the plugin imports this
module inside SGLang's scheduler processes.

Format (JSON object, version 1)::

    {"format": "dynspec-policy", "format_version": 1, "protocol": 1,
     "policy_version": 12, "arms": [0, 1, 3, 5],
     "table": [[8, 5], [64, 3], [null, 1]],
     "provenance": {
        "server": "http://gpu-7:30000",          # or null
        "created_at": 1764400000.0,              # wall clock, seconds
        "tool_version": "0.1.0",
        "policy": "thompson",
        "buckets": [1, 2, 4, 8, 16, 32, 64],      # bucket upper edges
        "data_window": {"start": 1764390000.0, "end": 1764400000.0, "observations": 5210},
        "estimates": [[bucket, arm, goodput_tok_s, std, n], ...]}}

The table is validated exactly as an update is (protocol v1 rules, every ``k`` among
``arms``); a file that is not ours, or is from a newer format, is refused with an error that
names the file and the problem.

A table learnt per acceptance band (protocol v2) adds ``"bands"``: the banded table, a row
``[max_batch_size, k_unknown, k_band1, ..., k_band4]`` where its bands differ (``[bound, k]``
where they do not), validated as a v2 update is, whose unknown-band ``k`` per row is
``"table"``. A v2 plugin without a draft tree installs the bands; a v1 plugin, and a reader
from before bands, ignore the key and install ``"table"``, so the format version stays 1.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner._atomic import write_atomic
from tuner.protocol import (
    BandTable,
    ProtocolError,
    Table,
    as_band_table,
    band_agnostic,
    band_table_to_json,
    is_uniform,
    table_to_json,
    validate_band_table,
    validate_table,
)

# The protocol version of a file's (band-agnostic) table: v1, which every plugin installs.
PROTOCOL_VERSION = 1

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "DataWindow",
    "Estimate",
    "PolicyFile",
    "PolicyFileError",
    "Provenance",
    "dumps",
    "load",
    "loads",
    "save",
]

FORMAT = "dynspec-policy"
FORMAT_VERSION = 1
# A policy file is a few KB; anything far larger is not one (and must not stall a server start).
MAX_FILE_BYTES = 4 * 1024 * 1024


class PolicyFileError(ValueError):
    """A policy file that cannot be used. The message names the file and the problem.

    Subclasses ``ValueError`` so callers without the tuner's exception tree (the plugin) can
    catch it plainly; the CLI maps it to a configuration error.
    """

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


def _num(value: object, what: str, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _int(value: object, what: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True, slots=True)
class Estimate:
    """A policy's belief about one arm in one bucket when the file was written."""

    bucket: int
    arm: int
    goodput: float  # emitted tokens per busy second
    std: float
    n: int

    def to_json(self) -> list[int | float]:
        return [self.bucket, self.arm, self.goodput, self.std, self.n]

    @classmethod
    def from_json(cls, row: object) -> Estimate:
        if not isinstance(row, (list, tuple)) or len(row) != 5:
            raise ValueError(f"an estimate must be [bucket, arm, goodput, std, n], got {row!r}")
        return cls(
            bucket=_int(row[0], "estimate bucket"),
            arm=_int(row[1], "estimate arm"),
            goodput=_num(row[2], "estimate goodput"),  # type: ignore[arg-type]
            std=_num(row[3], "estimate std"),  # type: ignore[arg-type]
            n=_int(row[4], "estimate n"),
        )


@dataclass(frozen=True, slots=True)
class DataWindow:
    """The observations behind the policy: wall-clock span and how many there were."""

    start: float | None = None
    end: float | None = None
    observations: int = 0

    def __post_init__(self) -> None:
        if self.start is not None and self.end is not None and self.end < self.start:
            raise ValueError(f"data window ends ({self.end}) before it starts ({self.start})")
        if self.observations < 0:
            raise ValueError(f"data window observations must be >= 0, got {self.observations}")

    def to_json(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "observations": self.observations}

    @classmethod
    def from_json(cls, obj: object) -> DataWindow:
        if not isinstance(obj, Mapping):
            raise ValueError(f"data_window must be an object, got {type(obj).__name__}")
        return cls(
            start=_num(obj.get("start"), "data_window.start", allow_none=True),
            end=_num(obj.get("end"), "data_window.end", allow_none=True),
            observations=_int(obj.get("observations", 0), "data_window.observations"),
        )


@dataclass(frozen=True)
class Provenance:
    """Where a policy came from. Informational: the plugin installs the table regardless."""

    server: str | None = None
    created_at: float | None = None
    tool_version: str | None = None
    policy: str | None = None
    buckets: tuple[int, ...] = ()
    data_window: DataWindow = field(default_factory=DataWindow)
    estimates: tuple[Estimate, ...] = ()
    # What the data did not decide: batch sizes without data and how they were filled.
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(str(n) for n in self.notes))
        edges = tuple(int(e) for e in self.buckets)
        if edges and (edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:]))):
            raise ValueError(f"bucket edges must be positive and strictly increasing: {edges}")
        object.__setattr__(self, "buckets", edges)
        object.__setattr__(self, "estimates", tuple(self.estimates))

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "created_at": self.created_at,
            "tool_version": self.tool_version,
            "policy": self.policy,
            "buckets": list(self.buckets),
            "data_window": self.data_window.to_json(),
            "estimates": [e.to_json() for e in self.estimates],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, obj: object) -> Provenance:
        if not isinstance(obj, Mapping):
            raise ValueError(f"provenance must be an object, got {type(obj).__name__}")
        for key in ("server", "tool_version", "policy"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise ValueError(f"provenance.{key} must be a string or null, got {obj[key]!r}")
        buckets = obj.get("buckets", [])
        if not isinstance(buckets, list):
            raise ValueError(f"provenance.buckets must be a list, got {buckets!r}")
        estimates = obj.get("estimates", [])
        if not isinstance(estimates, list):
            raise ValueError(f"provenance.estimates must be a list, got {estimates!r}")
        notes = obj.get("notes", [])
        if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
            raise ValueError(f"provenance.notes must be a list of strings, got {notes!r}")
        return cls(
            server=obj.get("server"),
            created_at=_num(obj.get("created_at"), "provenance.created_at", allow_none=True),
            tool_version=obj.get("tool_version"),
            policy=obj.get("policy"),
            buckets=tuple(_int(b, "bucket edge", minimum=1) for b in buckets),
            data_window=DataWindow.from_json(obj.get("data_window", {})),
            estimates=tuple(Estimate.from_json(e) for e in estimates),
            notes=tuple(notes),
        )


@dataclass(frozen=True)
class PolicyFile:
    """A validated policy: the table to install, its version, the arms it was learned for.

    Args:
        table: protocol v1 table; every ``k`` must be among ``arms``.
        arms: the arms of the server the policy was learned on. A server started with other
            arms can still use the file if every ``k`` of the table is among its own arms.
        policy_version: the version the plugin reports after installing the table; updates
            the daemon pushes later must carry a greater one.
        provenance: where it came from.
        bands: the banded table (protocol v2) the table is the band-agnostic view of, or
            None; a banded table whose bands all agree is kept as None.

    Raises:
        ValueError: if the table breaks protocol v1 or names an arm outside ``arms``, or the
            bands break protocol v2 or their unknown band is not the table.
    """

    table: Table
    arms: tuple[int, ...]
    policy_version: int = 1
    provenance: Provenance = field(default_factory=Provenance)
    bands: BandTable | None = None

    def __post_init__(self) -> None:
        arms = tuple(sorted({int(a) for a in self.arms}))
        if not arms or arms[0] < 0:
            raise ValueError(f"arms must be a non-empty set of ints >= 0, got {list(self.arms)}")
        object.__setattr__(self, "arms", arms)
        object.__setattr__(self, "table", validate_table(self.table, arms))
        if isinstance(self.policy_version, bool) or self.policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {self.policy_version}")
        if self.bands is not None:
            bands = _checked_bands(self.bands, arms)
            if band_agnostic(bands) != self.table:
                raise ValueError("bands: each row's unknown-band k must be the table's, got "
                                 f"{band_table_to_json(bands)} for {table_to_json(self.table)}")
            object.__setattr__(self, "bands", None if is_uniform(bands) else bands)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "protocol": PROTOCOL_VERSION,
            "policy_version": self.policy_version,
            "arms": list(self.arms),
            "table": table_to_json(self.table),
            **({} if self.bands is None else {"bands": band_table_to_json(self.bands)}),
            "provenance": self.provenance.to_json(),
        }

    @classmethod
    def from_snapshot(
        cls,
        snapshot: Any,
        *,
        table: Table,
        policy_version: int = 1,
        server: str | None = None,
        created_at: float | None = None,
        tool_version: str | None = None,
        data_window: DataWindow | None = None,
    ) -> PolicyFile:
        """Build a file from a ``policies.PolicySnapshot`` (duck-typed: this module stays pure
        and never imports ``policies``)."""
        return cls(
            table=table,
            arms=tuple(snapshot.arms),
            policy_version=policy_version,
            provenance=Provenance(
                server=server,
                created_at=created_at,
                tool_version=tool_version,
                policy=str(snapshot.policy),
                buckets=tuple(snapshot.buckets.edges),
                data_window=data_window or DataWindow(),
                estimates=tuple(
                    Estimate(e.bucket, e.arm, float(e.estimate), float(e.std), int(e.n))
                    for e in snapshot.estimates
                ),
            ),
        )

    def table_for(self, arms: Iterable[int]) -> Table:
        """The table, checked against a server's built ``arms``.

        Raises:
            ProtocolError: if the table names an arm the server did not build.
        """
        return validate_table(self.table, arms)

    def bands_for(self, arms: Iterable[int]) -> BandTable:
        """The banded table (every band the row's ``k`` where the file has no bands), checked
        against a server's built ``arms``.

        Raises:
            ProtocolError: if the table names an arm the server did not build.
        """
        return _checked_bands(self.bands or self.table, arms)


def _checked_bands(table: Table | BandTable, arms: Iterable[int]) -> BandTable:
    """A v1 or banded table as a banded one, every ``k`` among ``arms``."""
    return validate_band_table(band_table_to_json(as_band_table(table)), arms)


def _parse(obj: object) -> PolicyFile:
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    fmt = obj.get("format")
    if fmt != FORMAT:
        if isinstance(obj, Mapping) and any(str(k).isdigit() for k in obj):
            raise ValueError(
                "this is an SGLang --speculative-adaptive-config file, not a dynspec policy "
                "file (export with --format dynspec)"
            )
        raise ValueError(f'not a dynspec policy file ("format" is {fmt!r}, expected {FORMAT!r})')
    version = obj.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"format_version must be an integer, got {version!r}")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"format_version {version} is not supported (this dynspec-tuner reads "
            f"version {FORMAT_VERSION}; upgrade it to read newer files)"
        )
    proto = obj.get("protocol")
    if proto != PROTOCOL_VERSION:
        raise ValueError(f"protocol {proto!r} is not supported (expected {PROTOCOL_VERSION})")
    for key in ("arms", "table", "policy_version"):
        if key not in obj:
            raise ValueError(f"field {key!r} is missing")
    arms = obj["arms"]
    if not isinstance(arms, list) or not arms:
        raise ValueError(f"arms must be a non-empty list, got {arms!r}")
    table = obj["table"]
    if not isinstance(table, list):
        raise ValueError(f"table must be a list of [max_batch_size, k] rows, got {table!r}")
    bands = obj.get("bands")
    if bands is not None and not isinstance(bands, list):
        raise ValueError(f"bands must be a list of [max_batch_size, k_unknown, k_band...] "
                         f"rows, got {bands!r}")
    return PolicyFile(
        table=validate_table(table, [_int(a, "arm") for a in arms]),
        arms=tuple(_int(a, "arm") for a in arms),
        policy_version=_int(obj["policy_version"], "policy_version"),
        provenance=Provenance.from_json(obj.get("provenance", {})),
        bands=None if bands is None else validate_band_table(bands),
    )


def loads(text: str | bytes, *, source: str = "<string>") -> PolicyFile:
    """Parse and validate a policy file's text.

    Raises:
        PolicyFileError: naming ``source`` and the first problem found.
    """
    try:
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PolicyFileError(source, f"not valid JSON: {exc}") from exc
    try:
        return _parse(obj)
    except (ProtocolError, ValueError, TypeError) as exc:
        raise PolicyFileError(source, str(exc)) from exc


def load(path: str | os.PathLike[str]) -> PolicyFile:
    """Read and validate a policy file.

    Raises:
        PolicyFileError: the file cannot be read, is not a dynspec policy file, or its table
            breaks protocol v1. The message names the file.
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise PolicyFileError(source, f"cannot read: {exc.strerror or exc}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise PolicyFileError(source, f"larger than {MAX_FILE_BYTES} bytes; not a policy file")
    return loads(data, source=source)


def dumps(policy: PolicyFile) -> str:
    return json.dumps(policy.to_json(), indent=2, sort_keys=False) + "\n"


def save(policy: PolicyFile, path: str | os.PathLike[str]) -> Path:
    """Write a policy file atomically (temp file + rename), so a server starting at the same
    moment reads either the old file or the new one, never half of one.

    Returns:
        The path written.

    Raises:
        PolicyFileError: if the file cannot be written (named in the message).
    """
    target = Path(path)
    text = dumps(policy)
    try:
        write_atomic(target, text, parents=False)
    except OSError as exc:
        raise PolicyFileError(str(target), f"cannot write: {exc.strerror or exc}") from exc
    return target

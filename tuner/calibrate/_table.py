"""The calibration table file: JSON lines, one info row, then cost rows.

Format (``shared/calibration/README.md``)::

    {"kind": "info", "gpu": ..., "torch": ..., "shape": ..., "ctx": ..., "hidden": ..., ...}
    {"kind": "cost", "b": B, "q": Q, "target_ms": T, "draft_ms": D}

``q`` is tokens per sequence in the forward. A speculative step of ``k`` drafts costs
``k * draft(b, 1) + target(b, k + 1) + draft(b, k + 1)``; no speculation costs ``target(b, 1)``.
Cost rows may carry extra keys (a fitted table adds ``"source"``); readers ignore unknown keys.

Pure: no torch.
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
from tuner.errors import ConfigError, DynspecError

__all__ = ["CalibrationTable", "CostRow", "number_field", "parse_table", "read_table", "write_table"]


@dataclass(frozen=True, kw_only=True)
class CostRow:
    """Device time of one target forward and one draft forward at ``b`` sequences × ``q`` tokens."""

    b: int
    q: int
    target_ms: float
    draft_ms: float
    source: str | None = None  # "measured" / "interpolated" in fitted tables; None when timed

    def __post_init__(self) -> None:
        for name in ("b", "q"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("target_ms", "draft_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "kind": "cost",
            "b": self.b,
            "q": self.q,
            "target_ms": round(float(self.target_ms), 4),
            "draft_ms": round(float(self.draft_ms), 4),
        }
        if self.source is not None:
            row["source"] = self.source
        return row


@dataclass(frozen=True, kw_only=True)
class CalibrationTable:
    """An info mapping and cost rows keyed by ``(b, q)``."""

    info: Mapping[str, Any]
    rows: tuple[CostRow, ...] = field(default=())

    def cell(self, b: int, q: int) -> CostRow | None:
        for row in self.rows:
            if row.b == b and row.q == q:
                return row
        return None

    def as_dict(self) -> dict[tuple[int, int], CostRow]:
        return {(r.b, r.q): r for r in self.rows}

    def step_ms(self, b: int, k: int) -> float:
        """Cost of one decode step with ``k`` drafts at a measured ``b`` (no interpolation).

        Raises:
            KeyError: a needed ``(b, q)`` cell is missing.
        """
        cells = self.as_dict()
        if k == 0:
            return cells[(b, 1)].target_ms
        return k * cells[(b, 1)].draft_ms + cells[(b, k + 1)].target_ms + cells[(b, k + 1)].draft_ms


def write_table(path: str | os.PathLike[str], info: Mapping[str, Any], rows: Iterable[CostRow]) -> Path:
    """Write the table atomically (a temporary file in the same folder, then a rename).

    Raises:
        DynspecError: the file cannot be written; the message names it.
    """
    out = Path(path)
    lines = [json.dumps({"kind": "info", **{k: v for k, v in info.items() if k != "kind"}})]
    lines += [json.dumps(r.to_json()) for r in sorted(rows, key=lambda r: (r.b, r.q))]
    text = "\n".join(lines) + "\n"
    try:
        write_atomic(out, text)
    except OSError as exc:
        raise DynspecError(f"cannot write calibration table {out}: {exc.strerror or exc}") from exc
    return out


def read_table(path: str | os.PathLike[str]) -> CalibrationTable:
    """Read and validate a calibration table file (see :func:`parse_table`).

    Raises:
        ConfigError: unreadable file, or what :func:`parse_table` refuses.
    """
    src = Path(path)
    try:
        text = src.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read calibration table {src}: {exc}") from exc
    return parse_table(text, source=str(src))


def parse_table(text: str, *, source: str) -> CalibrationTable:
    """Parse the format; the one reader of it (``calibrate`` and the simulator alike).

    Rows of another ``kind`` are refused rather than skipped: a mistyped ``"cots"`` would
    otherwise drop a measurement without a word.

    Raises:
        ConfigError: bad JSON, a missing or unknown ``kind``, a bad, missing or duplicate
            cost field, or no cost rows; the message names ``source``, the line and the field.
    """
    info: dict[str, Any] = {}
    rows: dict[tuple[int, int], CostRow] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not a JSON object: {exc.msg}") from exc
        if not isinstance(obj, dict):
            raise ConfigError(
                f"{where}: each line must be a JSON object, got {type(obj).__name__}"
            )
        kind = obj.get("kind")
        if kind == "info":
            info.update({k: v for k, v in obj.items() if k != "kind"})
        elif kind == "cost":
            origin = obj.get("source")
            if origin is not None and not isinstance(origin, str):
                raise ConfigError(f"{where}: field 'source' must be a string, got {origin!r}")
            row = CostRow(
                b=number_field(obj, "b", where, integer=True),
                q=number_field(obj, "q", where, integer=True),
                target_ms=number_field(obj, "target_ms", where, positive=True),
                draft_ms=number_field(obj, "draft_ms", where),
                source=origin,
            )
            if (row.b, row.q) in rows:
                raise ConfigError(f"{where}: duplicate cost row for b={row.b}, q={row.q}")
            rows[(row.b, row.q)] = row
        elif kind is None:
            raise ConfigError(f'{where}: missing field \'kind\' ("cost" or "info")')
        else:
            raise ConfigError(f"{where}: unknown row kind {kind!r} (expected 'info' or 'cost')")
    if not rows:
        raise ConfigError(f'{source}: no cost rows (kind "cost")')
    return CalibrationTable(info=info, rows=tuple(sorted(rows.values(), key=lambda r: (r.b, r.q))))


def number_field(
    obj: Mapping[str, Any], key: str, where: str, *, integer: bool = False, positive: bool = False
) -> Any:
    """``obj[key]`` as a finite number: an integer >= 1 with ``integer``, else a float >= 0
    (> 0 with ``positive``). ConfigError naming ``where`` and the field otherwise."""
    if key not in obj:
        raise ConfigError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: field {key!r} must be a finite number, got {v!r}")
    if integer:
        if not float(v).is_integer() or v < 1:
            raise ConfigError(f"{where}: field {key!r} must be an integer >= 1, got {v!r}")
        return int(v)
    if v < 0 or (v == 0 and positive):
        raise ConfigError(f"{where}: field {key!r} must be {'>' if positive else '>='} 0, got {v!r}")
    return float(v)

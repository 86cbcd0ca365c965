"""What one window measured: the server's counters (:class:`ServerWindow`), the client's
figures with them (:class:`Measurement`) and the pooled estimate of a cell
(:class:`CellEstimate`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner.loadgen import WindowStats
from tuner.protocol import CounterRow, Table, table_to_json, validate_table
from tuner.protocol import counter_deltas as protocol_counter_deltas
from tuner.sweep._config import FALLBACK_REL_SE


@dataclass(frozen=True)
class ServerWindow:
    """The plugin's counters over one window (deltas, all DP replicas summed).

    ``busy_s`` is the server's decode time (launch to launch), so ``goodput`` is emitted
    tokens per busy second — the daemon's reward, free of client and prefill time.
    """

    decode_steps: int
    emitted_tokens: int
    accepted_drafts: int
    drafted_tokens: int
    busy_s: float
    batch_steps: int  # Σ b over decode steps (mean batch = batch_steps / decode_steps)
    steps_by_arm: dict[int, int] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.emitted_tokens / self.busy_s if self.busy_s > 0 else math.nan

    def __add__(self, other: ServerWindow) -> ServerWindow:
        by_arm = dict(self.steps_by_arm)
        for k, v in other.steps_by_arm.items():
            by_arm[k] = by_arm.get(k, 0) + v
        return ServerWindow(
            self.decode_steps + other.decode_steps,
            self.emitted_tokens + other.emitted_tokens,
            self.accepted_drafts + other.accepted_drafts,
            self.drafted_tokens + other.drafted_tokens,
            self.busy_s + other.busy_s,
            self.batch_steps + other.batch_steps,
            by_arm,
        )

    @property
    def mean_batch(self) -> float:
        return self.batch_steps / self.decode_steps if self.decode_steps else math.nan

    @property
    def accept_rate(self) -> float:
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "decode_steps": self.decode_steps,
            "emitted_tokens": self.emitted_tokens,
            "accepted_drafts": self.accepted_drafts,
            "drafted_tokens": self.drafted_tokens,
            "busy_s": self.busy_s,
            "batch_steps": self.batch_steps,
            "steps_by_arm": {str(k): v for k, v in sorted(self.steps_by_arm.items())},
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ServerWindow:
        return cls(
            decode_steps=int(obj["decode_steps"]),
            emitted_tokens=int(obj["emitted_tokens"]),
            accepted_drafts=int(obj["accepted_drafts"]),
            drafted_tokens=int(obj["drafted_tokens"]),
            busy_s=float(obj["busy_s"]),
            batch_steps=int(obj["batch_steps"]),
            steps_by_arm={int(k): int(v) for k, v in obj.get("steps_by_arm", {}).items()},
        )

    @classmethod
    def from_deltas(cls, deltas: Iterable[CounterRow]) -> ServerWindow:
        """Totals of per-``(b, k)`` deltas (see :func:`counter_deltas`)."""
        steps = emitted = accepted = drafted = batch = 0
        busy = 0.0
        by_arm: dict[int, int] = {}
        for d in deltas:
            steps += d.decode_steps
            emitted += d.emitted_tokens
            accepted += d.accepted_drafts
            drafted += d.drafted_tokens
            busy += d.busy_s
            batch += d.b * d.decode_steps
            by_arm[d.k] = by_arm.get(d.k, 0) + d.decode_steps
        return cls(steps, emitted, accepted, drafted, busy, batch, by_arm)


@dataclass(frozen=True)
class CounterSnapshot:
    """The plugin's cumulative counters, all DP replicas summed, and each replica's start."""

    started_at: tuple[float, ...]
    rows: dict[tuple[int, int], CounterRow]


def counter_deltas(before: CounterSnapshot, after: CounterSnapshot) -> list[CounterRow] | None:
    """Per-``(b, k)`` counters accrued between two snapshots (rows with steps only); None if
    the server restarted in between (a new start time, or a counter that went backwards)."""
    if before.started_at != after.started_at:
        return None
    deltas = protocol_counter_deltas(before.rows.values(), after.rows.values())
    return None if deltas is None else list(deltas)


@dataclass(frozen=True)
class Measurement:
    """One measured window of one cell (what a trial stores in its ``measurement`` attr)."""

    level: int
    arm: int
    window_s: float
    requests: int
    output_tokens: int
    tok_s: float
    tok_s_se: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    avg_in_flight: float
    errors: int = 0
    server: ServerWindow | None = None
    pruned: bool = False
    table: Table | None = None
    trial: int | None = None

    @classmethod
    def from_window(
        cls,
        level: int,
        arm: int,
        stats: WindowStats,
        server: ServerWindow | None,
        *,
        pruned: bool = False,
        table: Table | None = None,
    ) -> Measurement:
        return cls(
            level=level,
            arm=arm,
            window_s=stats.duration,
            requests=stats.requests,
            output_tokens=stats.output_tokens,
            tok_s=stats.tok_s,
            tok_s_se=stats.tok_s_se,
            tpot_p50_ms=stats.tpot_p50_s * 1e3,
            tpot_p99_ms=stats.tpot_p99_s * 1e3,
            avg_in_flight=stats.avg_in_flight,
            errors=stats.errors,
            server=server,
            pruned=pruned,
            table=table,
        )

    def to_json(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "level": self.level,
            "arm": self.arm,
            "window_s": self.window_s,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "tok_s": num(self.tok_s),
            "tok_s_se": num(self.tok_s_se),
            "tpot_p50_ms": num(self.tpot_p50_ms),
            "tpot_p99_ms": num(self.tpot_p99_ms),
            "avg_in_flight": self.avg_in_flight,
            "errors": self.errors,
            "server": None if self.server is None else self.server.to_json(),
            "pruned": self.pruned,
            "table": None if self.table is None else table_to_json(self.table),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, trial: int | None = None) -> Measurement:
        def num(x: object) -> float:
            return math.nan if x is None else float(x)  # type: ignore[arg-type]

        table = obj.get("table")
        return cls(
            level=int(obj["level"]),
            arm=int(obj["arm"]),
            window_s=float(obj["window_s"]),
            requests=int(obj["requests"]),
            output_tokens=int(obj["output_tokens"]),
            tok_s=num(obj.get("tok_s")),
            tok_s_se=num(obj.get("tok_s_se")),
            tpot_p50_ms=num(obj.get("tpot_p50_ms")),
            tpot_p99_ms=num(obj.get("tpot_p99_ms")),
            avg_in_flight=float(obj.get("avg_in_flight", 0.0)),
            errors=int(obj.get("errors", 0)),
            server=None if obj.get("server") is None else ServerWindow.from_json(obj["server"]),
            pruned=bool(obj.get("pruned", False)),
            table=None if table is None else validate_table(table),
            trial=trial,
        )


@dataclass(frozen=True)
class CellEstimate:
    """Everything measured for one cell, pooled (windows weighted by their length)."""

    level: int
    arm: int
    mean: float
    se: float  # NaN when no window could estimate its spread
    windows: int
    window_s: float
    pruned: bool  # every window of it was cut short by the pruner
    last: Measurement
    server: ServerWindow | None = None  # the plugin's counters, summed over the windows

    def se_or_fallback(self) -> float:
        return self.se if math.isfinite(self.se) and self.se > 0 else FALLBACK_REL_SE * self.mean

    @classmethod
    def pool(cls, ms: Sequence[Measurement]) -> CellEstimate:
        usable = [m for m in ms if math.isfinite(m.tok_s)]
        last = ms[-1]
        if not usable:
            return cls(last.level, last.arm, math.nan, math.nan, 0, 0.0, False, last)
        w = [max(m.window_s, 1e-9) for m in usable]
        total = sum(w)
        mean = sum(wi * m.tok_s for wi, m in zip(w, usable, strict=True)) / total
        if all(math.isfinite(m.tok_s_se) for m in usable):
            sq = sum((wi * m.tok_s_se) ** 2 for wi, m in zip(w, usable, strict=True))
            se = math.sqrt(sq) / total
        elif len(usable) >= 2:
            spread = math.sqrt(sum((m.tok_s - mean) ** 2 for m in usable) / (len(usable) - 1))
            se = spread / math.sqrt(len(usable))
        else:
            se = math.nan
        server = None
        for m in usable:
            if m.server is not None:
                server = m.server if server is None else server + m.server
        return cls(
            last.level,
            last.arm,
            mean,
            se,
            len(usable),
            sum(m.window_s for m in usable),
            all(m.pruned for m in usable),
            usable[-1],
            server,
        )


def _sigma_diff(a: CellEstimate, b: CellEstimate) -> float:
    return math.hypot(a.se_or_fallback(), b.se_or_fallback())

"""Load generators for the engine: closed-loop concurrency schedules, Poisson arrivals, traces.

A load is attached to an :class:`~tuner.sim.engine.Engine` and submits requests through
``engine.submit``. The engine asks :meth:`Load.next_time` for the next moment the load wants
to act, calls :meth:`Load.fire` when virtual time reaches it, and calls :meth:`Load.on_finish`
when one of the load's requests completes.

Schedule syntax (:func:`parse_load`, the CLI's ``--load``):

- ``"60:1,60:4,60:16"`` — closed loop: 60 s with 1 request in flight, then 4, then 16; the last
  phase holds. Prefix ``loop:`` to cycle through the phases forever. A single number ``"64"``
  holds 64 in flight.
- ``"poisson:RATE"`` or ``"poisson:RATE:SECONDS"`` — open loop, Poisson arrivals at RATE
  requests/s (for SECONDS, else forever).
- ``"trace:FILE.csv"`` — replay a CSV with a header naming ``arrival_s`` (seconds from start)
  and optionally ``prompt_tokens`` and ``output_tokens`` (else drawn from the workload).
- ``"none"`` — no built-in load (external requests only).
"""

from __future__ import annotations

import abc
import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tuner.errors import ConfigError

if TYPE_CHECKING:
    from tuner.sim.engine import Engine, Request

__all__ = [
    "ClosedLoop",
    "Load",
    "NoLoad",
    "Poisson",
    "Trace",
    "TraceRow",
    "parse_load",
]

INF = math.inf
# Requests in flight a closed-loop phase may hold (each is a live object in the engine).
MAX_CONCURRENCY = 100_000


class Load(abc.ABC):
    """Something that submits requests to an engine over virtual time."""

    def start(self, engine: Engine) -> None:  # noqa: B027 - optional hook
        """Called once when attached, at ``engine.now``."""

    @abc.abstractmethod
    def next_time(self) -> float:
        """Virtual time of the next action, ``inf`` when there is none."""

    def fire(self, engine: Engine) -> None:  # noqa: B027 - optional hook
        """Act at ``engine.now`` (>= :meth:`next_time`)."""

    def on_finish(self, engine: Engine, request: Request) -> None:  # noqa: B027 - optional hook
        """One of this load's requests finished."""


class NoLoad(Load):
    """No built-in traffic: the engine only runs what is submitted from outside."""

    def next_time(self) -> float:
        return INF


class ClosedLoop(Load):
    """Keep a scheduled number of requests in flight (a new one as soon as one finishes).

    Args:
        phases: ``(duration_s, concurrency)`` pairs run in order; the last one holds unless
            ``repeat`` (then the schedule cycles).
    """

    def __init__(self, phases: Sequence[tuple[float, int]], *, repeat: bool = False) -> None:
        if not phases:
            raise ConfigError("a closed-loop schedule needs at least one phase")
        for d, c in phases:
            if not (d > 0 and math.isfinite(d)) or not 0 <= c <= MAX_CONCURRENCY or int(c) != c:
                raise ConfigError(
                    f"bad phase {d}:{c} (duration > 0 s, concurrency an integer in "
                    f"0..{MAX_CONCURRENCY})"
                )
        self.phases = tuple((float(d), int(c)) for d, c in phases)
        self.repeat = repeat
        self.in_flight = 0
        self._t0 = 0.0
        self._period = sum(d for d, _ in self.phases)
        self._next = INF

    def concurrency_at(self, t: float) -> int:
        rel = t - self._t0
        if self.repeat:
            rel %= self._period
        for d, c in self.phases:
            if rel < d:
                return c
            rel -= d
        return self.phases[-1][1]

    def _boundary_after(self, t: float) -> float:
        rel = t - self._t0
        base = self._t0
        if self.repeat:
            cycles = math.floor(rel / self._period)
            base += cycles * self._period
            rel -= cycles * self._period
        acc = 0.0
        for d, _ in self.phases:
            acc += d
            if rel < acc:
                return base + acc
        return base + self._period if self.repeat else INF

    def start(self, engine: Engine) -> None:
        self._t0 = engine.now
        self._next = self._boundary_after(engine.now)
        self._top_up(engine)

    def next_time(self) -> float:
        return self._next

    def fire(self, engine: Engine) -> None:
        while self._next <= engine.now:
            self._next = self._boundary_after(self._next)
        self._top_up(engine)

    def on_finish(self, engine: Engine, request: Request) -> None:
        self.in_flight -= 1
        self._top_up(engine)

    def _top_up(self, engine: Engine) -> None:
        target = self.concurrency_at(engine.now)
        while self.in_flight < target:
            self.in_flight += 1
            engine.submit(load=self)


class Poisson(Load):
    """Open-loop Poisson arrivals at ``rate`` requests per second (for ``duration_s``)."""

    def __init__(self, rate: float, *, duration_s: float | None = None, seed: int = 0) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ConfigError(f"poisson rate must be > 0 requests/s, got {rate}")
        if duration_s is not None and not duration_s > 0:
            raise ConfigError(f"poisson duration must be > 0 s, got {duration_s}")
        self.rate = float(rate)
        self.duration_s = duration_s
        self._rng = np.random.default_rng(seed)
        self._next = INF
        self._end = INF

    def start(self, engine: Engine) -> None:
        self._end = engine.now + self.duration_s if self.duration_s is not None else INF
        self._next = engine.now + self._rng.exponential(1.0 / self.rate)
        if self._next > self._end:
            self._next = INF

    def next_time(self) -> float:
        return self._next

    def fire(self, engine: Engine) -> None:
        while self._next <= engine.now:
            engine.submit(load=self, arrival=self._next)
            self._next += self._rng.exponential(1.0 / self.rate)
            if self._next > self._end:
                self._next = INF


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float
    prompt_tokens: int | None = None
    output_tokens: int | None = None


class Trace(Load):
    """Replay arrivals (seconds from attach time), optionally with fixed lengths."""

    def __init__(self, rows: Sequence[TraceRow]) -> None:
        self.rows = tuple(sorted(rows, key=lambda r: r.arrival_s))
        self._i = 0
        self._t0 = 0.0

    @classmethod
    def from_csv(cls, path: str | Path) -> Trace:
        """Read ``arrival_s[,prompt_tokens][,output_tokens]`` rows (header required).

        Raises:
            ConfigError: naming the file, line and column.
        """
        path = Path(path)
        try:
            with path.open(newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                header = reader.fieldnames or []
                if "arrival_s" not in header:
                    raise ConfigError(
                        f"{path}: trace CSV needs a header with 'arrival_s' "
                        "(optional: prompt_tokens, output_tokens)"
                    )
                rows = []
                for line, rec in enumerate(reader, 2):
                    rows.append(_trace_row(rec, f"{path}:{line}"))
        except OSError as exc:
            raise ConfigError(f"cannot read trace {path}: {exc}") from exc
        if not rows:
            raise ConfigError(f"{path}: trace has no rows")
        return cls(rows)

    def start(self, engine: Engine) -> None:
        self._t0 = engine.now
        self._i = 0

    def next_time(self) -> float:
        if self._i >= len(self.rows):
            return INF
        return self._t0 + self.rows[self._i].arrival_s

    def fire(self, engine: Engine) -> None:
        while self._i < len(self.rows) and self._t0 + self.rows[self._i].arrival_s <= engine.now:
            r = self.rows[self._i]
            self._i += 1
            engine.submit(
                load=self,
                arrival=self._t0 + r.arrival_s,
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.output_tokens,
            )


def _trace_row(rec: dict[str, str | None], where: str) -> TraceRow:
    def num(key: str, *, integer: bool) -> float | int | None:
        raw = rec.get(key)
        if raw is None or raw.strip() == "":
            if key == "arrival_s":
                raise ConfigError(f"{where}: column 'arrival_s' is empty")
            return None
        try:
            v = float(raw)
        except ValueError:
            raise ConfigError(f"{where}: column {key!r} is not a number: {raw!r}") from None
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"{where}: column {key!r} must be a finite number >= 0, got {raw!r}")
        if integer:
            if v < 1 or not v.is_integer():
                raise ConfigError(f"{where}: column {key!r} must be an integer >= 1, got {raw!r}")
            return int(v)
        return v

    return TraceRow(
        arrival_s=float(num("arrival_s", integer=False)),  # type: ignore[arg-type]
        prompt_tokens=num("prompt_tokens", integer=True),  # type: ignore[arg-type]
        output_tokens=num("output_tokens", integer=True),  # type: ignore[arg-type]
    )


def parse_load(spec: str, *, seed: int = 0) -> Load:
    """Build a load from the schedule syntax described in the module docstring.

    Raises:
        ConfigError: the message names the bad part.
    """
    s = spec.strip()
    if s in ("", "none", "off"):
        return NoLoad()
    if s.startswith("trace:"):
        return Trace.from_csv(s[len("trace:") :])
    if s.startswith("poisson:"):
        parts = s[len("poisson:") :].split(":")
        try:
            rate = float(parts[0])
            dur = float(parts[1]) if len(parts) > 1 and parts[1] else None
        except ValueError:
            raise ConfigError(f"bad load {spec!r}: expected poisson:RATE[:SECONDS]") from None
        if len(parts) > 2:
            raise ConfigError(f"bad load {spec!r}: expected poisson:RATE[:SECONDS]")
        return Poisson(rate, duration_s=dur, seed=seed)
    repeat = False
    if s.startswith("loop:"):
        repeat, s = True, s[len("loop:") :]
    phases: list[tuple[float, int]] = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        dur_s, sep, conc_s = part.partition(":")
        try:
            if not sep:  # "64": hold forever
                phases.append((INF if not repeat else 1.0, int(dur_s)))
                continue
            phases.append((float(dur_s), int(conc_s)))
        except ValueError:
            raise ConfigError(
                f"bad load {spec!r}: phase {part!r} is not SECONDS:CONCURRENCY "
                "(or use poisson:RATE, trace:FILE.csv, none)"
            ) from None
    if not phases:
        raise ConfigError(f"bad load {spec!r}: no phases")
    if any(d == INF for d, _ in phases[:-1]):
        raise ConfigError(f"bad load {spec!r}: only the last phase may omit its duration")
    if phases[-1][0] == INF:
        phases[-1] = (1e18, phases[-1][1])
    return ClosedLoop(phases, repeat=repeat)

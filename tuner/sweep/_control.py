"""The server side of a sweep: pinning the table to one arm through the plugin
(:class:`PluginArmControl`) and measuring a window under closed-loop load
(:class:`LiveMeasurer`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tuner.errors import PluginMissingError, StorageError, UpdateRejectedError
from tuner.loadgen import ClosedLoop, WindowStats
from tuner.protocol import CounterRow, Table, format_table
from tuner.sweep._measure import CounterSnapshot, ServerWindow, counter_deltas

# The logger keeps the name of the module this came from, so log filters stay valid.
log = logging.getLogger("tuner.sweep")


@dataclass(frozen=True)
class ServerSetup:
    """What the sweep can do on this server.

    ``pinnable`` False means stock SGLang (no plugin): only ``arms[0]``, the configured arm,
    is measured, and ``note`` says so.
    """

    arms: tuple[int, ...]
    pinnable: bool
    note: str | None = None


class ArmControl(Protocol):
    """Pins the server's table and reads its counters (synchronous; run in a thread)."""

    def setup(self) -> ServerSetup: ...

    def pin(self, table: Table) -> None: ...

    def counters(self) -> CounterSnapshot | None: ...

    def restore(self) -> None: ...


class PluginArmControl:
    """:class:`ArmControl` over :class:`~tuner.client.SGLangClient` (the plugin's update path).

    Each pin pushes a table with a version above every replica's current one; ``restore``
    pushes back the table the server ran before the sweep (with a yet higher version). On
    stock SGLang it measures the configured arm only.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        self._original: Table | None = None
        self._version = 0
        self._pinned = False

    def setup(self) -> ServerSetup:
        try:
            states = self.client.read_state()
        except PluginMissingError:
            info = self.client.server_info()
            arm = _configured_arm(info)
            what = f"the configured arm (k={arm})"
            if info.get("speculative_adaptive") and arm > 0:
                what = (f"SGLang's own adaptive choice (--speculative-adaptive; shown as k={arm}, "
                        "its startup steps)")
            return ServerSetup(
                arms=(arm,),
                pinnable=False,
                note=(
                    f"{self.client.address}: stock SGLang (no dynspec plugin): measuring only "
                    f"{what}; install the plugin to compare arms"
                ),
            )
        self._original = states[0].table
        self._version = max(s.policy_version for s in states)
        arms = set(states[0].arms)
        for s in states[1:]:
            arms &= set(s.arms)
        return ServerSetup(arms=tuple(sorted(arms)), pinnable=True)

    def pin(self, table: Table) -> None:
        self._version += 1
        reply = self.client.push(table, self._version)
        if not all(reply):
            # A replica refused (e.g. its version moved on): re-read and retry once.
            self._version = max(s.policy_version for s in self.client.read_state()) + 1
            reply = self.client.push(table, self._version)
            if not all(reply):
                raise UpdateRejectedError(
                    self.client.address, f"refused the table {format_table(table)}: {reply}"
                )
        self._pinned = True

    def counters(self) -> CounterSnapshot | None:
        try:
            states = self.client.read_state()
        except PluginMissingError:
            return None
        out: dict[tuple[int, int], CounterRow] = {}
        for s in states:
            for row in s.counters:
                prev = out.get((row.b, row.k))
                if prev is None:
                    out[(row.b, row.k)] = row
                else:
                    out[(row.b, row.k)] = CounterRow(
                        row.b,
                        row.k,
                        prev.decode_steps + row.decode_steps,
                        prev.emitted_tokens + row.emitted_tokens,
                        prev.accepted_drafts + row.accepted_drafts,
                        prev.drafted_tokens + row.drafted_tokens,
                        prev.busy_s + row.busy_s,
                    )
        return CounterSnapshot(tuple(st.started_at for st in states), out)

    def restore(self) -> None:
        if self._pinned and self._original is not None:
            self.pin(self._original)
            self._pinned = False


def _configured_arm(info: Mapping[str, Any]) -> int:
    """The arm a stock server runs: its startup draft steps, or 0 without speculation."""
    algo = info.get("speculative_algorithm")
    if not algo or str(algo).upper() in ("NONE", "NULL"):
        return 0
    steps = info.get("speculative_num_steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        return 0
    return steps


# --- measuring ------------------------------------------------------------------------------


class Measurer(Protocol):
    """Runs one window of one cell. :class:`LiveMeasurer` is the real one."""

    async def setup(self) -> ServerSetup: ...

    async def measure(
        self,
        level: int,
        table: Table | None,
        *,
        warmup_s: float,
        step_s: float,
        on_phase: Callable[[str], None],
        on_step: Callable[[int, WindowStats], bool],
    ) -> tuple[WindowStats, ServerWindow | None]:
        """Pin ``table`` (None: leave the server as it is), run ``level`` requests, wait out
        the warm-up, then measure step by step until ``on_step`` returns True."""
        ...

    async def restore(self) -> None: ...


class LiveMeasurer:
    """A :class:`Measurer` over a running :class:`~tuner.loadgen.ClosedLoop` and an
    :class:`ArmControl` (called in a worker thread so the load never stalls)."""

    def __init__(
        self,
        load: ClosedLoop,
        control: ArmControl,
        *,
        clock: Callable[[], float],
        history: Any = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """Args:
            history: a :class:`storage.Storage`; each window's per-``(b, k)`` counter deltas
                are recorded there as observations (the daemon warm-starts from them and
                ``report`` shows them). A storage failure is logged, never fatal.
            wall: wall clock for the observations' timestamps.
        """
        self.load = load
        self.control = control
        self.clock = clock
        self.history = history
        self.wall = wall
        self._arms: tuple[int, ...] = ()
        self._history_failed = False

    async def setup(self) -> ServerSetup:
        setup = await asyncio.to_thread(self.control.setup)
        self._arms = setup.arms
        return setup

    async def measure(
        self,
        level: int,
        table: Table | None,
        *,
        warmup_s: float,
        step_s: float,
        on_phase: Callable[[str], None],
        on_step: Callable[[int, WindowStats], bool],
    ) -> tuple[WindowStats, ServerWindow | None]:
        if table is not None:
            on_phase("switching")
            await asyncio.to_thread(self.control.pin, table)
        epoch = self.load.set_concurrency(level)
        on_phase("warm-up")
        # Every request from before the switch is done, and every worker has turned over
        # once since (a queue behind the running-request cap reaches its steady rhythm).
        await self.load.settle(epoch)
        await self.load.wait_completed(level, epoch=epoch)
        await self.load.run_for(warmup_s)
        before = await asyncio.to_thread(self.control.counters)
        mark = self.load.mark()
        on_phase("measuring")
        step = 0
        while True:
            step += 1
            await self.load.run_for(mark.t + step * step_s - self.clock())
            stats = self.load.stats_since(mark)
            if on_step(step, stats):
                break
        after = await asyncio.to_thread(self.control.counters)
        server = None
        if before is not None and after is not None:
            deltas = counter_deltas(before, after)
            if deltas is not None:
                server = ServerWindow.from_deltas(deltas)
                if self.history is not None and deltas:
                    await asyncio.to_thread(self._record, deltas, after.started_at)
        return stats, server

    def _record(self, deltas: list[CounterRow], started_at: tuple[float, ...]) -> None:
        from storage import ObservationRecord, ServerSeen

        address = self.load.server
        now = self.wall()
        try:
            self.history.record_tick(
                servers=[ServerSeen(address, self._arms, now, min(started_at, default=None))],
                observations=[
                    ObservationRecord(address, now, d.b, d.k, d.decode_steps, d.emitted_tokens,
                                      d.accepted_drafts, d.drafted_tokens, d.busy_s)
                    for d in deltas
                ],
            )
        except StorageError as exc:
            if not self._history_failed:
                log.warning("sweep windows are not recorded in the history: %s", exc)
            self._history_failed = True

    async def restore(self) -> None:
        await asyncio.to_thread(self.control.restore)

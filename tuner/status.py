"""What ``dynspec-tuner run`` shows while it works.

On a terminal: a live rich view (per server and bucket: the arm the server runs, the greedy
arm, estimated goodput per arm with its samples, the last push; the daemon's own CPU and
memory). Otherwise: plain log lines, one per server every ``plain_every_s`` of daemon time
(pushes, outages and restarts are logged by the daemon as they happen).

The renderers are pure functions of a :class:`~tuner.daemon.DaemonStatus`; :class:`StatusView`
owns the rich ``Live`` on the console the CLI hands it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table as RichTable
from rich.text import Text

from tuner.daemon import DaemonStatus, ServerStatus
from tuner.daemon._tables import flat, show_table
from tuner.protocol import format_table, lookup

__all__ = [
    "DEFAULT_PLAIN_EVERY_S",
    "ProcessStats",
    "StatusView",
    "exit_lines",
    "process_stats",
    "render_status",
    "status_lines",
]

log = logging.getLogger(__name__)

# A plain status line per server at most this often (daemon seconds), besides pushes.
DEFAULT_PLAIN_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class ProcessStats:
    """The daemon process's own footprint."""

    cpu_percent: float  # of one core, since the previous sample
    rss_mb: float


class _ProcessSampler:
    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # the first call only starts the measurement

    def __call__(self) -> ProcessStats:
        with self._proc.oneshot():
            return ProcessStats(self._proc.cpu_percent(None), self._proc.memory_info().rss / 2**20)


_sampler: _ProcessSampler | None = None


def process_stats() -> ProcessStats:
    """CPU (% of one core since the last call) and RSS of this process."""
    global _sampler
    if _sampler is None:
        _sampler = _ProcessSampler()
    return _sampler()


def _tok_s(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x / 1000:.1f}k" if x >= 10_000 else f"{x:,.0f}"


def _ago(now: float, then: float) -> str:
    s = max(0.0, now - then)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago"


def _server_header(st: ServerStatus, now: float) -> Text:
    t = Text()
    t.append(st.address, style="bold")
    if st.up is False:
        t.append("  DOWN", style="bold red")
        if st.down_since is not None:
            t.append(f" for {now - st.down_since:.0f}s")
        if st.last_error:
            t.append(f"  {st.last_error}", style="red")
        return t
    t.append(f"  {st.mode}", style="cyan")
    if st.arms:
        t.append(f"  arms {','.join(map(str, st.arms))}")
    if st.mode != "metrics-only":
        runs = st.server_version if st.server_version is not None else st.version
        t.append(f"  runs v{runs}")
    t.append(f"  pushes {st.pushes}  restarts {st.restarts}")
    t.append(f"  steps {st.decode_steps:,}  now {_tok_s(st.interval_goodput)} tok/s")
    sb = _switchback(st)
    if sb:
        t.append(f"\n  {sb}", style="magenta" if st.holdout_active else None)
    if st.probes:
        t.append(f"\n  {_probes(st)}", style="yellow")
    if st.last_push is not None:
        p = st.last_push
        t.append(f"\n  last push v{p.version} {_ago(now, p.ts)}: {show_table(p.table)} "
                 f"({p.reason}, {p.outcome})", style="dim")
    return t


def _bucket_table(st: ServerStatus) -> RichTable | None:
    snap = st.snapshot
    if snap is None:
        return None
    table = RichTable(box=None, pad_edge=False, header_style="bold")
    table.add_column("bucket", justify="right")
    table.add_column("runs", justify="right")
    table.add_column("greedy", justify="right")
    for arm in snap.arms:
        table.add_column(f"k={arm} tok/s (steps)", justify="right")
    by_bucket: dict[int, dict[int, tuple[float, float, int]]] = {}
    for e in snap.estimates:
        by_bucket.setdefault(e.bucket, {})[e.arm] = (e.estimate, e.std, e.n)
    for i in range(len(snap.buckets)):
        ests = by_bucket.get(i, {})
        if not any(n > 0 for _, _, n in ests.values()):
            continue  # a bucket without traffic says nothing
        high = snap.buckets.bounds(i)[1] or snap.buckets.bounds(i)[0]
        # A banded row's unknown-band arm: the one it runs until acceptance is measured.
        runs = str(lookup(flat(st.server_table), high)) if st.server_table else "?"
        greedy = snap.chosen[i] if i < len(snap.chosen) else None
        cells = []
        for arm in snap.arms:
            est, std, n = ests.get(arm, (math.nan, math.nan, 0))
            if n <= 0 or not math.isfinite(est):
                cells.append(Text("-", style="dim"))
                continue
            style = "bold green" if arm == greedy else ""
            cells.append(Text(f"{_tok_s(est)} ±{_tok_s(std)} ({n:,})", style=style))
        table.add_row(snap.buckets.label(i), runs, str(greedy), *cells)
    return table


def render_status(status: DaemonStatus, proc: ProcessStats | None = None) -> RenderableType:
    """The live view of one tick."""
    parts: list[RenderableType] = []
    head = Text()
    head.append("dynspec-tuner", style="bold")
    head.append(f"  policy {status.policy}")
    if status.dry_run:
        head.append("  DRY RUN (no pushes)", style="yellow")
    head.append(f"  tick {status.ticks}")
    if proc is not None:
        head.append(f"  daemon cpu {proc.cpu_percent:.1f}%  rss {proc.rss_mb:.0f} MB")
    if not status.storage_ok:
        head.append(f"  HISTORY UNAVAILABLE: {status.buffered_rows} rows buffered",
                    style="bold red")
    parts.append(head)
    for st in status.servers:
        parts.append(Text(""))
        parts.append(_server_header(st, status.ts))
        table = _bucket_table(st)
        if table is not None and table.row_count:
            parts.append(table)
    return Group(*parts)


def status_lines(status: DaemonStatus, proc: ProcessStats | None = None) -> list[str]:
    """One plain line per server (for logs)."""
    lines = []
    own = f" | daemon cpu {proc.cpu_percent:.1f}% rss {proc.rss_mb:.0f}MB" if proc else ""
    hist = "" if status.storage_ok else f" | history down, {status.buffered_rows} rows buffered"
    for st in status.servers:
        if st.up is False:
            lines.append(f"{st.address} DOWN ({st.last_error}){own}{hist}")
            continue
        greedy = _greedy(st)
        rate = (f"{_tok_s(st.interval_goodput)} tok/s" if math.isfinite(st.interval_goodput)
                else "no decode steps this interval")
        if st.mode == "metrics-only":
            # No plugin: nothing is pushed and the server's table is not visible.
            lines.append(
                f"{st.address} metrics-only (no plugin; nothing pushed) | best so far "
                f"{greedy or 'not known yet'} | {rate}, {st.decode_steps:,} steps, "
                f"{st.restarts} restarts{own}{hist}")
            continue
        # The version the server reports, not the last one this daemon decided: after a
        # restart the server runs its own default again.
        runs = ("?" if st.server_table is None
                else f"v{st.server_version if st.server_version is not None else st.version} "
                f"{show_table(st.server_table)}")
        sb = _switchback(st)
        probing = f" | {_probes(st)}" if st.probes else ""
        lines.append(
            f"{st.address} {st.mode} runs {runs}{probing} | greedy {greedy or '-'} | "
            f"{rate}, {st.decode_steps:,} steps, "
            f"{st.pushes} pushes, {st.restarts} restarts{' | ' + sb if sb else ''}{own}{hist}"
        )
    return lines


def _probes(st: ServerStatus) -> str:
    """The live probes: a batch-size range runs one arm for its steps left, then the table."""
    return "probing " + ", ".join(
        f"b {lo}..{'' if hi is None else hi} k={k} ({n:,} steps left)"
        for lo, hi, k, n in st.probes)


def _switchback(st: ServerStatus) -> str:
    """The switchback's state (run --holdout): empty without the experiment."""
    now = "on the baseline table now" if st.holdout_active else ""
    r = st.switchback
    if r is None:
        return f"switchback: {now}" if now else ""
    hi = f"{r.high:+.1%}" if math.isfinite(r.high) else "+inf"
    lo = f"{r.low:+.1%}" if math.isfinite(r.low) else "-inf"
    return (f"switchback: measured gain {r.ratio:+.1%} [{lo}, {hi}] from {r.pairs} pairs, "
            f"cost {r.cost:.2%}{'; ' + now if now else ''}")


def _greedy(st: ServerStatus) -> str | None:
    if st.snapshot is None:
        return None
    return format_table(st.snapshot.buckets.table(st.snapshot.chosen))


def exit_lines(
    status: DaemonStatus | None, unclean: Mapping[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """What ``run`` prints at exit, one line per server, and the servers that never answered
    as SGLang (nothing was learned from them: ``run`` exits non-zero)."""
    unclean = unclean or {}
    lines: list[str] = []
    never: list[str] = []
    for st in status.servers if status is not None else ():
        if st.mode == "connecting":
            never.append(st.address)
            lines.append(f"{st.address}: never answered as an SGLang server "
                         f"({st.last_error or 'no reading finished'}); nothing learned or pushed")
            continue
        greedy = _greedy(st) or "-"
        if st.mode == "metrics-only":
            lines.append(f"{st.address}: metrics-only (no plugin), nothing pushed; best by the "
                         f"data {greedy}")
            continue
        left = st.server_version if st.server_version is not None else st.version
        table = show_table(st.server_table) if st.server_table else "a table not confirmed"
        line = f"{st.address}: left on v{left} {table}; greedy {greedy}; {st.pushes} pushes"
        if st.read_only:
            line += " (observed only: another tuner pushes to it)"
        if st.address in unclean:
            line += "; NOT LEFT ON THE GREEDY TABLE (see the error above)"
        lines.append(line)
    return lines, never


class StatusView:
    """Shows each tick's :class:`DaemonStatus`: live on a terminal, log lines otherwise.

    Args:
        console: where the live view goes (the CLI's console).
        live: force the live view on/off; default: when ``console`` is a terminal.
        plain_every_s: spacing of plain lines per server, in daemon seconds.
        stats: process sampler (injected in tests).
    """

    def __init__(
        self,
        console: Console,
        *,
        live: bool | None = None,
        plain_every_s: float = DEFAULT_PLAIN_EVERY_S,
        stats: Callable[[], ProcessStats] = process_stats,
    ) -> None:
        self.console = console
        self.live = console.is_terminal if live is None else live
        self.plain_every_s = plain_every_s
        self._stats = stats
        self._live: Live | None = None
        self._last_plain: float | None = None
        self._last_render = 0.0
        self.last: DaemonStatus | None = None

    def __enter__(self) -> StatusView:
        if self.live:
            self._live = Live(console=self.console, auto_refresh=False, transient=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            if self.last is not None:
                self._live.update(render_status(self.last, self._stats()), refresh=True)
            self._live.stop()
            self._live = None

    def update(self, status: DaemonStatus) -> None:
        """Called by the daemon after every tick."""
        self.last = status
        if self._live is not None:
            # Accelerated simulations tick many times a second; 4 frames a second suffice.
            now = time.monotonic()
            if now - self._last_render >= 0.25:
                self._last_render = now
                self._live.update(render_status(status, self._stats()), refresh=True)
            return
        if self._last_plain is None or status.ts - self._last_plain >= self.plain_every_s:
            self._last_plain = status.ts
            for line in status_lines(status, self._stats()):
                log.info("%s", line)

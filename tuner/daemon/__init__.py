"""The loop: read servers -> observations -> storage -> policy -> push table.

One :class:`Daemon` drives every server of a :class:`~tuner.config.TunerConfig`. Each tick
(:meth:`Daemon.run_once`), for each server independently:

1. read the plugin's state (``/server_info``; ``/metrics`` for stock SGLang);
2. turn counter deltas into observations (a restart - new start time, counters going
   backwards - gives no negative deltas and schedules a re-push of the current table);
3. feed the policy;
4. each decision period, ask the policy for a table and push it when it differs, with a
   version above anything the server or the history has seen;

then write everything the tick produced in one transaction. With several servers each is
read on its own worker thread with its own timeout, so a slow or failing server never stalls
the others (and is not asked again while its last request is still out). A failing server is
retried with backoff and reported once per outage; a failing database is retried every tick
with the rows kept in memory. A table the server refused is not pushed again for a backoff
period. A version the server reports above anything this daemon sent means another tuner (or
an operator) is pushing: the daemon then stops pushing to that server and only observes.
With a ``pool``, this daemon's servers with the same model and arms share one policy
(identical replicas learn as one, for the price of one), warm-started from the whole pool's
history, and each tick also feeds it what the pool's servers under other daemons recorded;
servers of one pool that report different models learn apart, and the daemon says so. A
server that comes back with another model gets a fresh policy. On stop, each
server gets its greedy table (never an exploration table) and the history is flushed.

Time and waiting are injected (``clock``, ``wait``) so tests drive ticks with a fake clock.

The package: :mod:`._records` (the status records and the per-server state),
:mod:`._loop` (:class:`Daemon`: lifecycle, the tick, status), :mod:`._session` (reading one
server: plugin or metrics-only, restarts, foreign pushes, trouble), :mod:`._push` (learning,
deciding, pushing), :mod:`._book` (policies: building, warm start, pools, model changes) and
:mod:`._history` (the buffer, the flush, the roll-up).
"""

from __future__ import annotations

from tuner.daemon._loop import Daemon
from tuner.daemon._records import (
    DEFAULT_MAX_BUFFERED_ROWS,
    DEFAULT_PLUGIN_RECHECK_S,
    DEFAULT_POOL_LOOKBACK_IDS,
    DEFAULT_ROLLUP_EVERY_S,
    DaemonStatus,
    PushInfo,
    ServerStatus,
    TickSummary,
)


__all__ = [
    "DEFAULT_MAX_BUFFERED_ROWS",
    "DEFAULT_PLUGIN_RECHECK_S",
    "DEFAULT_POOL_LOOKBACK_IDS",
    "DEFAULT_ROLLUP_EVERY_S",
    "Daemon",
    "DaemonStatus",
    "PushInfo",
    "ServerStatus",
    "TickSummary",
]

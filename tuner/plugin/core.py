"""The plugin's pure core: policy-table lookup and per-``(b, k)`` telemetry.

Runs inside SGLang's scheduler processes (wrapped by the hooks) and inside the simulator's
engine, so both execute exactly this code. Builtins only: no sglang, numpy or I/O. Not
thread-safe by itself; SGLang calls it from one scheduler thread, the simulator under a lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tuner.protocol import (
    PROTOCOL_VERSION,
    CounterRow,
    DynspecState,
    ProtocolError,
    Table,
    TableIndex,
    TreeShape,
    decode_update,
    validate_table,
)

__all__ = ["MAX_STEP_GAP_S", "PluginCore", "Telemetry"]

# SGLang's own step counters ignore launch-to-launch gaps above 2 s (idle, not busy).
MAX_STEP_GAP_S = 2.0


class Telemetry:
    """Cumulative counters keyed by ``(b, k)``, as protocol v1 defines them.

    A decode step's busy time is the launch-to-launch gap to the next *contiguous* forward
    launch (the very next ``forward_iter``, no idle pass between, gap <= ``MAX_STEP_GAP_S``).
    The next forward may be another decode step or a prefill (``close``): under heavy load a
    prefill follows most decode steps, and timing only decode->decode pairs would leave most
    high-batch steps unmeasured. A step is committed to its row one step late, when that gap
    is known; a step whose successor is not contiguous has no measurable duration and is
    counted in ``untimed_steps`` instead, so every row's ``emitted / busy_s`` is unbiased.
    """

    __slots__ = ("_rows", "_pending", "untimed_steps")

    def __init__(self) -> None:
        # (b, k) -> [decode_steps, emitted, accepted, drafted, busy_s]
        self._rows: dict[tuple[int, int], list[float]] = {}
        self._pending: tuple[int, int, int, int, float, int] | None = None
        self.untimed_steps = 0

    def record(
        self,
        b: int,
        k: int,
        emitted: int,
        accepted: int,
        launch_ts: float,
        forward_iter: int,
        after_idle_gap: bool = False,
    ) -> None:
        """Record one decode step. ``k`` is the arm it was *launched* with.

        Args:
            b: requests in the step.
            k: draft steps the step was launched with (0 = no drafting).
            emitted: tokens the step produced (accepted drafts + one per request).
            accepted: accepted draft tokens.
            launch_ts: monotonic launch time of the step, seconds.
            forward_iter: the scheduler's forward counter at launch (contiguity check).
            after_idle_gap: the scheduler idled between the previous launch and this one
                (SGLang's ``batch.after_idle_gap``; an idle pass keeps ``forward_iter``
                contiguous, so the counter alone cannot tell).
        """
        if self._pending is not None:
            self.close(launch_ts, forward_iter, after_idle_gap)
        self._pending = (b, k, emitted, accepted, launch_ts, forward_iter)

    def close(self, launch_ts: float, forward_iter: int, after_idle_gap: bool = False) -> None:
        """A forward launched at ``launch_ts``: commit the pending decode step, timed if contiguous.

        ``record`` calls this for the next decode step; the plugin's prefill-result hook and the
        simulator call it for any other forward.
        """
        prev = self._pending
        if prev is not None:
            self._pending = None
            pb, pk, pe, pa, pts, pit = prev
            gap = launch_ts - pts
            if not after_idle_gap and forward_iter == pit + 1 and 0.0 <= gap <= MAX_STEP_GAP_S:
                row = self._rows.get((pb, pk))
                if row is None:
                    self._rows[(pb, pk)] = [1, pe, pa, pk * pb, gap]
                else:
                    row[0] += 1
                    row[1] += pe
                    row[2] += pa
                    row[3] += pk * pb
                    row[4] += gap
            else:
                self.untimed_steps += 1

    def rows(self) -> tuple[CounterRow, ...]:
        return tuple(
            CounterRow(b, k, int(r[0]), int(r[1]), int(r[2]), int(r[3]), float(r[4]))
            for (b, k), r in sorted(self._rows.items())
        )


class PluginCore:
    """The table a server decides by, its version, and its telemetry.

    Args:
        arms: the draft-step counts the server built runtime state for.
        started_at: wall-clock start of the server (tells the daemon about restarts).
        table: the initial table; defaults to one row using ``default_arm``.
        default_arm: the arm for the default table; defaults to the largest arm.
        tree: the draft tree of a top-k > 1 server, whose arms are ``0`` and ``tree.steps``.
    """

    def __init__(
        self,
        arms: Iterable[int],
        *,
        started_at: float,
        table: Table | None = None,
        default_arm: int | None = None,
        tree: TreeShape | None = None,
    ) -> None:
        self.arms = tuple(sorted(set(int(a) for a in arms)))
        if not self.arms or self.arms[0] < 0:
            raise ValueError(f"arms must be a non-empty set of ints >= 0, got {self.arms}")
        if tree is not None and not set(self.arms) <= {0, tree.steps}:
            raise ValueError(
                f"a tree server's arms are 0 and its depth {tree.steps}, got {list(self.arms)}"
            )
        self.tree = tree
        # A step's width (draft tokens it verified) -> the arm it ran: a chain verifies k + 1
        # tokens, the tree its configured node count. The telemetry hook looks steps up here.
        self.width_arm: dict[int, int] = {k + 1: k for k in self.arms}
        if tree is not None:
            self.width_arm[tree.draft_tokens] = tree.steps
        if default_arm is None:
            default_arm = self.arms[-1]
        if default_arm not in self.arms:
            raise ValueError(f"default arm {default_arm} is not among arms {self.arms}")
        self.started_at = float(started_at)
        self.version = 0
        self.updates_applied = 0
        self.updates_rejected = 0
        self.last_rejection: str | None = None
        self.telemetry = Telemetry()
        self._set_table(validate_table(table or ((None, default_arm),), self.arms))

    def _set_table(self, table: Table) -> None:
        # One assignment of a fully built index: a reader never sees a half-applied table.
        self.table = table
        self._index = TableIndex(table)

    # --- hot path ---------------------------------------------------------------------------

    def steps_for_batch(self, batch_size: int) -> int:
        return self._index(batch_size)

    def arm_of_width(self, draft_tokens: int) -> int:
        """The arm a step that verified ``draft_tokens`` tokens per request ran."""
        return self.width_arm.get(draft_tokens, draft_tokens - 1)

    def record_decode(
        self,
        b: int,
        k: int,
        emitted: int,
        accepted: int,
        launch_ts: float,
        forward_iter: int,
        after_idle_gap: bool = False,
    ) -> None:
        self.telemetry.record(b, k, emitted, accepted, launch_ts, forward_iter, after_idle_gap)

    def record_forward(
        self, launch_ts: float, forward_iter: int, after_idle_gap: bool = False
    ) -> None:
        """A non-decode forward (prefill, mixed) launched: it ends the pending decode step."""
        self.telemetry.close(launch_ts, forward_iter, after_idle_gap)

    # --- control path -----------------------------------------------------------------------

    def apply_update(self, server_args: Mapping[str, Any]) -> tuple[bool, str | None]:
        """Validate and apply the ``dynspec_*`` keys of an update atomically. Never raises.

        Returns:
            ``(True, None)`` when applied, else ``(False, reason)`` with nothing changed.
        """
        try:
            table, version = self.check_update(server_args)
        except ProtocolError as exc:
            return self.reject(str(exc))
        self.commit_update(table, version)
        return True, None

    def check_update(self, server_args: Mapping[str, Any]) -> tuple[Table, int]:
        """Validate the ``dynspec_*`` keys of an update without applying or counting anything.

        For callers that must validate more than our keys before committing (the SGLang hook
        lets SGLang check its own keys in between). Pair with :meth:`commit_update` or
        :meth:`reject`.

        Raises:
            ProtocolError: naming the rule broken (any other failure is reported as one).
        """
        try:
            return decode_update(server_args, arms=self.arms, current_version=self.version)
        except ProtocolError:
            raise
        except Exception as exc:  # hostile payloads must never escape as anything else
            raise ProtocolError(f"malformed update: {type(exc).__name__}: {exc}") from exc

    def commit_update(self, table: Table, version: int) -> None:
        """Apply a table that :meth:`check_update` returned (no validation repeated)."""
        self._set_table(table)
        self.version = version
        self.updates_applied += 1
        self.last_rejection = None

    def reject(self, reason: str) -> tuple[bool, str]:
        """Count a refused update and remember why; the table is left as it is."""
        self.updates_rejected += 1
        self.last_rejection = reason
        return False, reason

    def install(self, table: Table, version: int) -> None:
        """Install a table at start (from a policy file). Raises ``ProtocolError`` if invalid."""
        table = validate_table(table, self.arms)
        if version < 0:
            raise ProtocolError(f"version must be >= 0, got {version}")
        self._set_table(table)
        self.version = int(version)

    def state(self, *, hooks_live: bool = True, reason: str | None = None) -> DynspecState:
        return DynspecState(
            arms=self.arms,
            policy_version=self.version,
            table=self.table,
            counters=self.telemetry.rows(),
            started_at=self.started_at,
            updates_applied=self.updates_applied,
            updates_rejected=self.updates_rejected,
            hooks_live=hooks_live,
            reason=reason,
            untimed_steps=self.telemetry.untimed_steps,
            last_rejection=self.last_rejection,
            protocol=PROTOCOL_VERSION,
            tree=self.tree,
        )

    def readout(self, *, hooks_live: bool = True, reason: str | None = None) -> dict[str, Any]:
        """The ``"dynspec"`` section, builtins only."""
        return self.state(hooks_live=hooks_live, reason=reason).to_json()

"""The plugin's pure core: table lookup by batch size and acceptance band, and telemetry.

Runs inside SGLang's scheduler processes (wrapped by the hooks) and inside the simulator's
engine, so both execute exactly this code. Builtins only: no sglang, numpy or I/O. Not
thread-safe by itself; SGLang calls it from one scheduler thread, the simulator under a lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tuner.plugin.acceptance import AcceptanceEstimate
from tuner.protocol import (
    COUNTED_MAX_BATCH,
    DEPTH_EVERY,
    N_BANDS,
    PROTOCOL_VERSION,
    UNKNOWN_BAND,
    BandCounter,
    BandIndex,
    BandTable,
    CounterRow,
    DepthCounter,
    DynspecState,
    Probe,
    ProtocolError,
    Table,
    TreeShape,
    as_band_table,
    band_agnostic,
    class_of,
    decode_update_with_probes,
    is_uniform,
)

__all__ = ["MAX_STEP_GAP_S", "PluginCore", "Telemetry"]

# SGLang's own step counters ignore launch-to-launch gaps above 2 s (idle, not busy).
MAX_STEP_GAP_S = 2.0
# A live probe's upper bound where it has none (larger than any batch).
_NO_BOUND = 2**62


class Telemetry:
    """Cumulative counters keyed by ``(b, k)`` and ``(class, band, k)`` (docs/protocol.md).

    A decode step's busy time is the launch-to-launch gap to the next *contiguous* forward
    launch (the very next ``forward_iter``, no idle pass between, gap <= ``MAX_STEP_GAP_S``).
    The next forward may be another decode step or a prefill (``close``): under heavy load a
    prefill follows most decode steps, and timing only decode->decode pairs would leave most
    high-batch steps unmeasured. A step is committed to its rows one step late, when that gap
    is known; a step whose successor is not contiguous has no measurable duration and is
    counted in ``untimed_steps`` instead, so every row's ``emitted / busy_s`` is unbiased.
    One cell per ``(b, band, k)`` holds every timed step; the readout sums it into the
    ``(b, k)`` rows and the ``(class, band, k)`` rows, so both count the same steps and add up.

    Hot path: one integer key into a dict of small lists, no objects per step.
    """

    __slots__ = ("_cells", "_depths", "_pending", "untimed_steps")

    def __init__(self) -> None:
        # (b * N_BANDS + band) * 64 + k -> [decode_steps, accepted, busy_s, first_rejected]
        self._cells: dict[int, list[float]] = {}
        # chain arm k -> requests that accepted exactly a drafts, a = 0..k
        self._depths: dict[int, list[int]] = {}
        self._pending: tuple[int, int, int, float, int, int, int] | None = None
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
        band: int = UNKNOWN_BAND,
        first_rejected: int = 0,
    ) -> None:
        """Record one decode step. ``k`` is the arm it was *launched* with.

        Args:
            b: requests in the step.
            k: draft steps the step was launched with (0 = no drafting; at most 63).
            emitted: tokens the step produced; always ``accepted + b`` for EAGLE, which is
                how the readout derives it (kept in the signature for the callers' sake).
            accepted: accepted draft tokens.
            launch_ts: monotonic launch time of the step, seconds.
            forward_iter: the scheduler's forward counter at launch (contiguity check).
            after_idle_gap: the scheduler idled between the previous launch and this one
                (SGLang's ``batch.after_idle_gap``; an idle pass keeps ``forward_iter``
                contiguous, so the counter alone cannot tell).
            band: the acceptance band the step counts in (``AcceptanceEstimate.observe``).
            first_rejected: requests that accepted no draft (counted up to
                ``COUNTED_MAX_BATCH`` requests, else 0).
        """
        prev = self._pending
        self._pending = (b, k, accepted, launch_ts, forward_iter, band, first_rejected)
        if prev is None:
            return
        # _commit inlined: this runs on every decode step.
        pb, pk, pa, pts, pit, pband, pz = prev
        gap = launch_ts - pts
        if after_idle_gap or forward_iter != pit + 1 or not 0.0 <= gap <= MAX_STEP_GAP_S:
            self.untimed_steps += 1
            return
        key = (pb * N_BANDS + pband) * 64 + pk
        cell = self._cells.get(key)
        if cell is None:
            self._cells[key] = [1, pa, gap, pz]
        else:
            cell[0] += 1
            cell[1] += pa
            cell[2] += gap
            cell[3] += pz

    def close(self, launch_ts: float, forward_iter: int, after_idle_gap: bool = False) -> None:
        """A forward launched at ``launch_ts``: commit the pending decode step, timed if contiguous.

        ``record`` does this for the next decode step; the plugin's prefill-result hook and the
        simulator call it for any other forward.
        """
        prev = self._pending
        if prev is not None:
            self._pending = None
            self._commit(prev, launch_ts, forward_iter, after_idle_gap)

    def _commit(
        self,
        prev: tuple[int, int, int, float, int, int, int],
        launch_ts: float,
        forward_iter: int,
        after_idle_gap: bool,
    ) -> None:
        pb, pk, pa, pts, pit, pband, pz = prev
        gap = launch_ts - pts
        if after_idle_gap or forward_iter != pit + 1 or not 0.0 <= gap <= MAX_STEP_GAP_S:
            self.untimed_steps += 1
            return
        key = (pb * N_BANDS + pband) * 64 + pk
        cell = self._cells.get(key)
        if cell is None:
            self._cells[key] = [1, pa, gap, pz]
        else:
            cell[0] += 1
            cell[1] += pa
            cell[2] += gap
            cell[3] += pz

    def count_depths(self, k: int, accepted_per_req: Iterable[int]) -> None:
        """Count how many drafts each request of a chain step at arm ``k`` accepted."""
        counts = self._depths.get(k)
        if counts is None:
            counts = self._depths[k] = [0] * (k + 1)
        for a in accepted_per_req:
            counts[a] += 1

    def depth_rows(self) -> tuple[DepthCounter, ...]:
        return tuple(DepthCounter(k, tuple(c)) for k, c in sorted(self._depths.items()))

    def rows(self) -> tuple[CounterRow, ...]:
        """Per ``(b, k)``: the cells summed over bands."""
        sums: dict[tuple[int, int], list[float]] = {}
        for key, (n, a, busy, _) in self._cells.items():
            bb, k = divmod(key, 64)
            t = sums.setdefault((bb // N_BANDS, k), [0, 0, 0.0])
            t[0] += n
            t[1] += a
            t[2] += busy
        return tuple(
            CounterRow(b, k, int(n), int(a) + b * int(n), int(a), k * b * int(n), float(busy))
            for (b, k), (n, a, busy) in sorted(sums.items())
        )

    def band_rows(self) -> tuple[BandCounter, ...]:
        """Per ``(batch-size class, band, k)``: the cells summed over the class's sizes."""
        sums: dict[tuple[int, int, int], list[int]] = {}
        for key, (n, a, _, z) in self._cells.items():
            bb, k = divmod(key, 64)
            b, band = divmod(bb, N_BANDS)
            t = sums.setdefault((class_of(b), band, k), [0, 0, 0, 0])
            t[0] += int(n)
            t[1] += b * int(n)
            t[2] += int(a)
            t[3] += int(z)
        return tuple(BandCounter(*key, *v) for key, v in sorted(sums.items()))


class PluginCore:
    """The table a server decides by, its version, its acceptance estimate and its telemetry.

    Args:
        arms: the draft-step counts the server built runtime state for.
        started_at: wall-clock start of the server (tells the daemon about restarts).
        table: the initial table (v1 rows or banded rows); defaults to one row using
            ``default_arm``.
        default_arm: the arm for the default table; defaults to the largest arm.
        tree: the draft tree of a top-k > 1 server, whose arms are ``0`` and ``tree.steps``.
        protocol: the protocol version this core speaks; 1 behaves as a plugin from before
            v2 (v1 readout, v1 updates only), for fleets that upgrade one server at a time.
    """

    def __init__(
        self,
        arms: Iterable[int],
        *,
        started_at: float,
        table: Table | BandTable | None = None,
        default_arm: int | None = None,
        tree: TreeShape | None = None,
        protocol: int = PROTOCOL_VERSION,
    ) -> None:
        self.arms = tuple(sorted(set(int(a) for a in arms)))
        if not self.arms or self.arms[0] < 0:
            raise ValueError(f"arms must be a non-empty set of ints >= 0, got {self.arms}")
        if self.arms[-1] >= 64:
            raise ValueError(f"arms must be < 64, got {list(self.arms)}")
        if tree is not None and not set(self.arms) <= {0, tree.steps}:
            raise ValueError(
                f"a tree server's arms are 0 and its depth {tree.steps}, got {list(self.arms)}"
            )
        if protocol not in (1, PROTOCOL_VERSION):
            raise ValueError(f"protocol must be 1 or {PROTOCOL_VERSION}, got {protocol}")
        self.protocol = protocol
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
        self.acceptance = AcceptanceEstimate()
        # Live probes as [lo, hi, k, steps left] (hi: a large int for "no bound"); an update
        # replaces them all, and a probe whose steps are spent is dropped.
        self.probes: list[list[int]] = []
        self._set_table(self._checked(table or ((None, default_arm),)))

    def _checked(self, table: Table | BandTable) -> BandTable:
        bt = as_band_table(table)
        if bt:
            allowed = set(self.arms)
            bad = sorted({k for _, ks in bt for k in ks} - allowed)
            if bad:
                raise ProtocolError(f"k={bad[0]} is not a built arm {sorted(allowed)}")
        if self.protocol == 1 and not is_uniform(bt):
            raise ProtocolError("a protocol v1 plugin has no acceptance bands")
        return bt

    def _set_table(self, table: BandTable) -> None:
        # One assignment of a fully built index: a reader never sees a half-applied table.
        self.band_table = table
        self.table = band_agnostic(table)
        self._index = BandIndex(table)
        self.ks_for = self._index.ks_for

    # --- hot path ---------------------------------------------------------------------------

    def steps_for_batch(self, batch_size: int) -> int:
        """The arm for a decode launch of ``batch_size`` in the estimate's current band (a
        live probe's arm where one covers it: the launch spends one of its steps)."""
        if self.probes:
            k = self.probe_arm(batch_size)
            if k is not None:
                return k
        return self.ks_for(batch_size)[self.acceptance.band]

    def probe_arm(self, batch_size: int) -> int | None:
        """The arm of the live probe covering ``batch_size``, spending one of its steps; None
        where no probe covers it. Every TP rank launches the same batches in the same order,
        so every rank spends the same steps and runs the same arm (docs/protocol.md)."""
        for p in self.probes:
            if p[0] <= batch_size <= p[1]:
                p[3] -= 1
                if p[3] <= 0:
                    self.probes = [q for q in self.probes if q is not p]
                return p[2]
        return None

    def arm_of_width(self, draft_tokens: int) -> int:
        """The arm a step that verified ``draft_tokens`` tokens per request ran."""
        return self.width_arm.get(draft_tokens, draft_tokens - 1)

    def observe(self, k: int, accepted_per_req: Sequence[int]) -> int:
        """Fold a verify result into the acceptance estimate; returns the step's band."""
        return self.acceptance.observe(k, accepted_per_req)

    def record_decode(
        self,
        b: int,
        k: int,
        emitted: int,
        accepted: int,
        launch_ts: float,
        forward_iter: int,
        after_idle_gap: bool = False,
        band: int | None = None,
        first_rejected: int = 0,
    ) -> None:
        """Count one decode step (``band``: what :meth:`observe` returned for it; default the
        estimate's band now; ``first_rejected``: requests that accepted no draft, counted up
        to ``COUNTED_MAX_BATCH`` requests)."""
        self.telemetry.record(
            b, k, emitted, accepted, launch_ts, forward_iter, after_idle_gap,
            self.acceptance.band if band is None else band, first_rejected,
        )

    def record_depths(self, k: int, accepted_per_req: Sequence[int], forward_iter: int) -> None:
        """Count how many drafts each request accepted, on the decode forwards sampled
        (``DEPTH_EVERY``, chains of ``k >= 2``; of a larger batch, ``COUNTED_MAX_BATCH``
        requests spread evenly over it: a batch is ordered by admission, and acceptance
        drifts as requests age). A tree's paths are not a chain's prefixes, so a tree server
        counts none."""
        if forward_iter % DEPTH_EVERY or k < 2 or self.tree is not None:
            return
        b = len(accepted_per_req)
        if b > COUNTED_MAX_BATCH:
            accepted_per_req = accepted_per_req[::-(-b // COUNTED_MAX_BATCH)]
        self.telemetry.count_depths(k, accepted_per_req)

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
            table, version, probes = self.check_update(server_args)
        except ProtocolError as exc:
            return self.reject(str(exc))
        self.commit_update(table, version, probes)
        return True, None

    def check_update(
        self, server_args: Mapping[str, Any]
    ) -> tuple[BandTable, int, tuple[Probe, ...]]:
        """Validate the ``dynspec_*`` keys of an update without applying or counting anything.

        For callers that must validate more than our keys before committing (the SGLang hook
        lets SGLang check its own keys in between). Pair with :meth:`commit_update` or
        :meth:`reject`. A v2 core applies v1 and v2 updates; a v1 core only v1.

        Raises:
            ProtocolError: naming the rule broken (any other failure is reported as one).
        """
        accept = (1,) if self.protocol == 1 else (1, PROTOCOL_VERSION)
        try:
            return decode_update_with_probes(
                server_args, arms=self.arms, current_version=self.version, accept=accept
            )
        except ProtocolError:
            raise
        except Exception as exc:  # hostile payloads must never escape as anything else
            raise ProtocolError(f"malformed update: {type(exc).__name__}: {exc}") from exc

    def commit_update(
        self, table: Table | BandTable, version: int, probes: Sequence[Probe] = ()
    ) -> None:
        """Apply a table and probes that :meth:`check_update` returned (no validation
        repeated); an update without probes ends the live ones."""
        self._set_table(as_band_table(table))
        self.probes = [[lo, _NO_BOUND if hi is None else hi, k, n] for lo, hi, k, n in probes]
        self.version = version
        self.updates_applied += 1
        self.last_rejection = None

    def reject(self, reason: str) -> tuple[bool, str]:
        """Count a refused update and remember why; the table is left as it is."""
        self.updates_rejected += 1
        self.last_rejection = reason
        return False, reason

    def install(self, table: Table | BandTable, version: int) -> None:
        """Install a table at start (from a policy file). Raises ``ProtocolError`` if invalid."""
        bt = self._checked(table)
        if self.tree is not None and not is_uniform(bt):
            raise ProtocolError("a draft tree's server takes no acceptance bands")
        if version < 0:
            raise ProtocolError(f"version must be >= 0, got {version}")
        self._set_table(bt)
        self.version = int(version)

    def install_file(self, policy: Any) -> None:
        """Install a ``tuner.policyfile.PolicyFile`` at start: its bands where it has them
        and this core decides per band (protocol v2, no draft tree), else its table.
        Raises ``ProtocolError`` if it names an arm this core did not build."""
        if self.protocol >= 2 and self.tree is None:
            self.install(policy.bands_for(self.arms), policy.policy_version)
        else:
            self.install(policy.table_for(self.arms), policy.policy_version)

    def state(self, *, hooks_live: bool = True, reason: str | None = None) -> DynspecState:
        est = self.acceptance
        v2 = self.protocol >= 2
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
            protocol=self.protocol,
            tree=self.tree,
            band_table=None if is_uniform(self.band_table) else self.band_table,
            bands=self.telemetry.band_rows() if v2 else (),
            acceptance=(est.band, est.alpha) if v2 else None,
            probes=tuple((lo, None if hi == _NO_BOUND else hi, k, left)
                         for lo, hi, k, left in self.probes),
            depths=self.telemetry.depth_rows() if v2 else (),
        )

    def readout(self, *, hooks_live: bool = True, reason: str | None = None) -> dict[str, Any]:
        """The ``"dynspec"`` section, builtins only."""
        return self.state(hooks_live=hooks_live, reason=reason).to_json()

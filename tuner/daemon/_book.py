"""The policy book: which policy each server learns with (built, warm-started from the
history, shared by a pool's replicas of one model, dropped when the model changes), and live
pooling from other daemons' servers."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from policies import BandObservation, BandTable, BasePolicy, Buckets, Observation, PolicySnapshot
from storage import BandObservationRecord, DepthCountsRecord, ObservationRecord, Storage
from tuner.config import TunerConfig
from tuner.daemon._records import DEFAULT_POOL_LOOKBACK_IDS, LearningRow, _PoolKey, _Server
from tuner.errors import StorageError
from tuner.protocol import BAND_EDGES, Table

log = logging.getLogger("tuner.daemon")  # one logger name for the whole loop


def _model_of(info: dict[str, Any]) -> str | None:
    """The model a server reports in ``/server_info`` (SGLang's server args), if any."""
    for key in ("served_model_name", "model_path"):
        value = info.get(key)
        if isinstance(value, str) and value:
            return value
    return None


class _PoolPolicy:
    """One policy shared by this daemon's servers of a pool that run one model with one set
    of arms.

    Identical replicas then learn from each other's observations as they arrive, at the cost
    of one policy; each server still draws its own proposal. Thread-safe: the workers of
    several servers use it at once.
    """

    def __init__(self, policy: BasePolicy, from_id: int) -> None:
        self.policy = policy
        self.lock = threading.Lock()
        self.from_id = from_id  # the pool's rows up to this id are in the warm start
        self.pooled = 0  # rows of pool-mates under other daemons fed to it
        self.bands_set = False  # set_bands called (by the first v2 server of the pool)

    def update(self, obs: Observation) -> bool:
        with self.lock:
            return self.policy.update(obs)

    def propose(self) -> Table:
        with self.lock:
            return self.policy.propose()

    def greedy(self) -> Table:
        with self.lock:
            return self.policy.greedy()

    def snapshot(self) -> PolicySnapshot:
        with self.lock:
            return self.policy.snapshot()

    # The band methods of a policy that learns per acceptance band (protocol v2).
    def set_bands(self, edges: Sequence[float]) -> None:
        with self.lock:
            self.policy.set_bands(edges)

    def update_bands(self, obs: BandObservation) -> bool:
        with self.lock:
            return self.policy.update_bands(obs)

    def update_depths(self, k: int, counts: Sequence[int], every: int = 1) -> bool:
        update = getattr(self.policy, "update_depths", None)
        if not callable(update):  # a policy that pools no acceptance
            return False
        with self.lock:
            return bool(update(k, counts, every))

    def propose_bands(self) -> BandTable | None:
        with self.lock:
            return self.policy.propose_bands()

    def greedy_bands(self) -> BandTable | None:
        with self.lock:
            return self.policy.greedy_bands()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


class _PolicyBook:
    """The :class:`~tuner.daemon.Daemon`'s policies: one per server, or one per pool's model
    and arms."""

    config: TunerConfig
    storage: Storage | None
    buckets: Buckets
    clock: Callable[[], float]
    _policy_factory: Callable[[tuple[int, ...], Buckets], BasePolicy]
    _pool_policies: dict[_PoolKey, _PoolPolicy]
    _pool_models: dict[str, str | None]
    _pool_lock: threading.Lock
    _pool_cursor: int | None
    _pool_floor: int
    _pool_seen: set[int]

    def _note_model(self, srv: _Server, model: str | None, now: float) -> None:
        """Keep the model the server reports. Another one than before drops the policy (what
        it learnt is about the old model's acceptance and step times): the next reading
        builds a fresh one, without a warm start. A reading that names none changes nothing."""
        if model is None or model == srv.model:
            return
        was, srv.model = srv.model, model
        if was is None or srv.policy is None:
            return
        self._event(srv.address, now, "model_changed", f"{was} -> {model}")
        log.warning("%s: the server now runs %s (was %s); starting a fresh policy",
                    srv.address, model, was)
        srv.policy = None
        srv.fresh_history = True
        srv.desired, srv.needs_push, srv.rejected_table = None, False, None


    def _build_policy(self, srv: _Server, arms: tuple[int, ...], banded: bool = False) -> None:
        """A fresh policy for ``arms``, warm-started from this server's history (with a pool:
        the pool's shared policy for this model and these arms, built and warm-started once);
        not warm-started right after the server changed model (``fresh_history``). With
        ``banded`` (the server speaks protocol v2, no tree) a policy that learns per band is
        given its bands first, so the warm start replays the stored band evidence too."""
        warm, srv.fresh_history = not srv.fresh_history, False
        srv.arms = arms
        srv.bands_set = False  # a fresh policy of its own learns no bands until told to
        if self.storage is not None:
            try:  # new tables are numbered above every version recorded for this server
                latest = self.storage.latest_policy_version(srv.address)
                if latest is not None:
                    srv.version = max(srv.version, latest.version)
            except StorageError as exc:
                log.warning("%s: the history is unavailable: %s", srv.address, exc)
        if self.config.pool is None:
            srv.bands_set = self._new_policy(srv, arms, warm=warm, banded=banded)
            return
        with self._pool_lock:  # two replicas read for the first time at once build one
            self._check_pool_models(srv)
            key = (srv.model, arms, srv.tree)
            shared = self._pool_policies.get(key)
            if shared is None:
                bands_set = self._new_policy(srv, arms, warm=warm, banded=banded)
                if srv.policy is not None:
                    shared = _PoolPolicy(srv.policy, srv.pool_from_id)
                    shared.bands_set = bands_set
                    self._pool_policies[key] = shared
            srv.policy = shared

    def _history_of_this_model(self, srv: _Server) -> tuple[bool, float | None]:
        """Whether the stored history of ``srv`` is about the model it runs now, and from
        when (None: all of it). Not when it names another model: the server was redeployed
        while this daemon was away, which is then recorded."""
        assert self.storage is not None
        rec = self.storage.server(srv.address)
        if rec is None or rec.model is None or srv.model is None:
            return True, None
        if rec.model == srv.model:
            return True, rec.model_since
        now = self.clock()
        detail = f"{rec.model} -> {srv.model} (while this daemon was not watching)"
        self._event(srv.address, now, "model_changed", detail)
        log.warning("%s: the server now runs %s, the history says %s; starting a fresh "
                    "policy", srv.address, srv.model, rec.model)
        return False, None

    def _check_pool_models(self, srv: _Server) -> None:
        """Warn once per model that joins a pool whose servers run another model."""
        if self._pool_models.get(srv.address, "") == srv.model:
            return
        known = {a: m for a, m in self._pool_models.items() if a != srv.address}
        self._pool_models[srv.address] = srv.model
        if known and srv.model not in known.values():
            log.warning(
                "pool %s: %s runs %s, but %s; servers of different models learn apart "
                "(a pool is for replicas of one model)", self.config.pool, srv.address,
                srv.model or "an unnamed model",
                ", ".join(f"{a} runs {m or 'an unnamed model'}" for a, m in sorted(known.items())),
            )

    def _new_policy(self, srv: _Server, arms: tuple[int, ...], *, warm: bool = True,
                    banded: bool = False) -> bool:
        """Build ``srv``'s policy and warm-start it; True if it was given bands."""
        try:
            policy = self._policy_factory(arms, self.buckets)
            if srv.tree is not None:  # before any update: the tree's arm verifies more tokens
                policy.set_verify_tokens({srv.tree.steps: srv.tree.draft_tokens})
        except ValueError as exc:
            # e.g. a static table naming an arm this server lacks (metrics-only mode knows
            # only the arm the server runs): say so once, keep reading, decide nothing.
            srv.policy = None
            if srv.policy_error != str(exc):
                srv.policy_error = str(exc)
                log.error("%s: policy %s cannot work with arms %s (%s); reading and recording "
                          "only", srv.address, self.config.policy, list(arms), exc)
            return False
        srv.policy_error = None
        bands_set = banded and callable(getattr(policy, "set_bands", None))
        if bands_set:
            policy.set_bands(BAND_EDGES)
        rows: list[LearningRow] = []
        if self.storage is not None and warm:
            try:
                if self.config.pool is not None:
                    srv.pool_from_id = self.storage.last_observation_id()
                warm, since = self._history_of_this_model(srv)
                if warm:
                    rows = self._stored_rows(srv, arms, since)
            except StorageError as exc:
                log.warning("%s: no warm start, the history is unavailable: %s",
                            srv.address, exc)
        pending = self._buffer.pending(srv.address) if warm else []
        counts = _replay(policy, [*rows, *pending], set(arms), bands_set)
        if counts["observations"]:
            pooled = f" (pool {self.config.pool})" if self.config.pool is not None else ""
            extra = "".join(
                f", {counts[key]} {what}"
                for key, what in (("bands", "band rows"), ("depths", "depth counts"))
                if counts[key])
            log.info("%s: warm start from %d stored observations%s (%d decode steps%s)",
                     srv.address, counts["observations"], pooled, counts["steps"], extra)
        srv.policy = policy
        return bands_set

    def _stored_rows(self, srv: _Server, arms: tuple[int, ...],
                     since: float | None) -> list[LearningRow]:
        """The history a fresh policy replays, in the order it was learnt: the latest
        observations, and the band and depth rows over the same span, by time (within a
        tick: observations, bands, depths, as :meth:`_learn` feeds them)."""
        assert self.storage is not None
        pool, model = self.config.pool, srv.model
        obs = self.storage.warm_start(srv.address, arms=arms, since=since, pool=pool,
                                      model=model)
        if not obs:
            return []
        bands, depths = self.storage.warm_start_acceptance(
            srv.address, arms=arms, since=obs[0].ts, pool=pool, model=model)
        return sorted([*obs, *bands, *depths], key=_learnt_order)

    def _read_pool(self) -> None:
        """Live pooling: hand each server what its pool-mates recorded since the last tick."""
        pool = self.config.pool
        if pool is None or self.storage is None:
            return
        try:
            if self._pool_cursor is None:
                self._pool_cursor = self._pool_floor = self.storage.last_observation_id()
                return
            # Ids of the window below the cursor and above it; rows only for the unseen ones
            # (new rows, and now and then a transaction that committed late).
            lookback = max(0, self._pool_cursor - DEFAULT_POOL_LOOKBACK_IDS)
            # Rows of this daemon's own servers reach the shared policy directly.
            ids = self.storage.pool_observation_ids(
                pool, after_id=max(lookback, self._pool_floor), exclude=self.config.servers)
            unseen = [i for i in ids if i not in self._pool_seen]
            fresh = self.storage.pool_observations(pool, ids=unseen) if unseen else []
        except StorageError as exc:
            log.debug("pool %s: not read this tick: %s", pool, exc)
            return
        if not fresh:
            return
        self._pool_seen.update(i for i, _ in fresh)
        self._pool_cursor = max(self._pool_cursor, *(i for i, _ in fresh))
        floor = self._pool_cursor - DEFAULT_POOL_LOOKBACK_IDS
        self._pool_seen = {i for i in self._pool_seen if i > floor}
        with self._pool_lock:
            shared = list(self._pool_policies.items())
        mates: dict[str, str | None] = {}
        if any(key[0] is not None for key, _ in shared):  # a model to tell mates apart by
            try:
                mates = {rec.address: rec.model for rec in self.storage.servers()}
            except StorageError as exc:
                log.debug("pool %s: pool-mates' models not read this tick: %s", pool, exc)
        # The band and depth rows written with those observations (protocol v2 mates).
        try:
            bands, depths = self.storage.acceptance_at({(r.server, r.ts) for _, r in fresh})
        except StorageError as exc:  # the observations still count this tick
            log.debug("pool %s: pool-mates' band rows not read this tick: %s", pool, exc)
            bands, depths = [], []
        evidence: dict[tuple[str, float], list[LearningRow]] = {}
        for row in [*bands, *depths]:
            evidence.setdefault((row.server, row.ts), []).append(row)
        for (model, arms, _tree), policy in shared:
            # A pool-mate known to run another model teaches this policy nothing.
            rows: list[LearningRow] = [
                r for i, r in fresh if i > policy.from_id
                and (model is None or mates.get(r.server) in (None, model))]
            ticks = {(r.server, r.ts) for r in rows}
            rows += [e for t in ticks for e in evidence.get(t, ())]
            rows.sort(key=_learnt_order)
            with policy.lock:  # a worker of a slow server may hold it: fed as one batch
                fed = _replay(policy.policy, rows, set(arms), policy.bands_set)
                policy.pooled += fed["observations"]


_RANK = {ObservationRecord: 0, BandObservationRecord: 1, DepthCountsRecord: 2}


def _learnt_order(row: LearningRow) -> tuple[float, int]:
    """Stored rows in the order the live loop fed them: by tick, and within one the
    observations, then the band rows, then the depth counts (``_Pusher._learn``)."""
    return row.ts, _RANK[type(row)]


def _replay(policy: BasePolicy, rows: Sequence[LearningRow], arms: set[int],
            bands: bool) -> Counter[str]:
    """Feed stored rows of ``arms`` to a fresh policy as the live loop fed them; returns
    how many ``observations``, ``bands`` and ``depths`` it took, and the observations'
    decode ``steps``."""
    took: Counter[str] = Counter()
    update_depths = getattr(policy, "update_depths", None)
    for r in rows:
        if r.k not in arms:
            continue
        if isinstance(r, ObservationRecord):
            if policy.update(Observation(r.b, r.k, r.decode_steps, r.emitted_tokens,
                                         r.accepted_drafts, r.drafted_tokens, r.busy_s)):
                took["observations"] += 1
                took["steps"] += r.decode_steps
        elif isinstance(r, BandObservationRecord):
            took["bands"] += bool(bands and policy.update_bands(  # type: ignore[attr-defined]
                BandObservation(r.band, r.k, r.decode_steps, r.request_steps,
                                r.accepted_drafts, r.first_counted, r.first_rejected)))
        else:
            took["depths"] += bool(callable(update_depths)
                                   and update_depths(r.k, list(r.counts), r.every))
    return took

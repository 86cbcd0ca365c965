"""``dynspec-tuner run --simulate``: the daemon against the built-in simulator, then a verdict.

Starts a :class:`~tuner.sim.server.SimServer` on a free loopback port with built-in load,
runs the real :class:`~tuner.daemon.Daemon` against it over HTTP on the simulator's clock
(intervals and decision periods are simulated seconds; ``speed`` compresses them into wall
time), and compares what was learned with the oracle per bucket.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from policies import BasePolicy
from storage import Storage
from tuner.bench_step import greedy_arms
from tuner.config import SimulateConfig, TunerConfig
from tuner.daemon import Daemon, DaemonStatus
from tuner.daemon._tables import AnyTable, canon, is_banded
from tuner.errors import ConfigError
from tuner.protocol import Table, format_table, is_uniform, lookup
from tuner.sim._step_oracle import StepOracleSums

__all__ = [
    "DEFAULT_MIN_VERDICT_STEPS",
    "DEFAULT_TOLERANCE",
    "BucketVerdict",
    "SimulationSummary",
    "run_simulation",
    "summarize",
]

log = logging.getLogger(__name__)

# A bucket is judged only with this many decode steps behind it (fewer say little).
DEFAULT_MIN_VERDICT_STEPS = 200
# An arm within this fraction of the oracle's goodput counts as right.
DEFAULT_TOLERANCE = 0.02


# How often a wait checks whether the simulator has reached the daemon's next tick.
_POLL_S = 0.0005


class _Lockstep:
    """The simulator's clock, advanced by the daemon's waits (see run_simulation)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass(frozen=True, slots=True)
class BucketVerdict:
    """The learned arm of one bucket against the oracle's, over the bucket's occupancy."""

    label: str
    steps: int
    learned_k: int
    oracle_k: int
    learned_goodput: float  # expected tokens/s of the learned arm over this occupancy
    oracle_goodput: float
    # A banded row (protocol v2): its arm per band, unknown band first (``learned_k``), and
    # ``learned_goodput`` what it yields on the run's steps by the band each was in.
    learned_bands: tuple[int, ...] | None = None

    @property
    def ratio(self) -> float:
        return self.learned_goodput / self.oracle_goodput if self.oracle_goodput > 0 else math.nan

    @property
    def learned(self) -> str:
        """The learned arm, or a banded row's ``k<unknown>/<band 1..>``."""
        if self.learned_bands is None:
            return str(self.learned_k)
        return f"{self.learned_k}/{','.join(map(str, self.learned_bands[1:]))}"

    def ok(self, tolerance: float = DEFAULT_TOLERANCE) -> bool:
        same = self.learned_k == self.oracle_k and self.learned_bands is None
        return same or self.ratio >= 1.0 - tolerance


@dataclass(frozen=True)
class SimulationSummary:
    """What a simulated run learned, measured against the oracle."""

    server: str
    profile: str
    workload: str
    simulated_s: float
    wall_s: float
    pushes: int
    final_version: int
    server_table: AnyTable  # what the simulated server runs at the end (banded: bands differ)
    greedy_table: AnyTable
    buckets: tuple[BucketVerdict, ...]
    measured_goodput: float  # emitted tokens per busy second over the whole run
    oracle_goodput: float  # expected, per-batch-size oracle, same occupancy
    learned_goodput: float  # expected, the greedy table, same occupancy
    default_goodput: float  # expected, the table the server started on (SGLang's step)
    observations: int
    db_url: str
    start_table: Table = ((None, 0),)  # the table the simulated server started on
    # run --holdout: the switchback's measured gain (tuner.switchback.SwitchbackGain) and the
    # true value it estimates, from the oracle (tuner.report_switchback.true_gain)
    switchback: object = None
    switchback_truth: float = math.nan

    def judged(self, min_steps: int = DEFAULT_MIN_VERDICT_STEPS) -> tuple[BucketVerdict, ...]:
        return tuple(v for v in self.buckets if v.steps >= min_steps)

    def all_ok(self, min_steps: int = DEFAULT_MIN_VERDICT_STEPS) -> bool:
        return all(v.ok() for v in self.judged(min_steps))


def summarize(
    *,
    storage: Storage,
    server: str,
    policy: BasePolicy,
    profile: object,
    workload: object,
    graph_bs: tuple[int, ...],
    skip_zero_draft_extend: bool = False,
    start_table: Table | None = None,
    greedy_table: AnyTable | None = None,
    step_sums: Mapping[int, StepOracleSums] | None = None,
    step_arms: tuple[int, ...] = (),
) -> tuple[tuple[BucketVerdict, ...], float, float, float, float, int]:
    """Per-bucket verdicts and run-wide goodputs from the stored history of ``server``.

    Tables are compared over the run's *time* at each batch size (busy seconds, whatever arm
    ran): the load decides how long the server sits at a batch size, and a table decides
    how many tokens it makes there. (Weighting by decode steps instead would favour arms with
    long steps.) Expected goodputs come from the oracle's closed form.

    A banded ``greedy_table`` (its bands differ; the policy's greedy table otherwise) picks
    its arm from the batch's live acceptance, which the closed form cannot price: a banded
    row is valued on the run's own steps instead, as the bench scores one
    (:mod:`tuner.bench_step`). ``step_sums`` (the engine's per-step oracle over the run; arms
    in ``step_arms``' order) say what every arm would have yielded on the steps at each
    batch size, by the acceptance band each was looked up in; the row's goodput at ``b`` is
    the closed form's for the reference arm times the ratio of its band arms' tokens to the
    reference arm's on those steps.

    ``default`` is the table the server started on (``start_table``; the largest arm
    everywhere when None).

    Returns:
        ``(verdicts, measured, oracle, learned, default, observations)``.
    """
    from tuner.sim import oracle

    occupancy: dict[int, float] = {}  # busy seconds per batch size
    steps: dict[int, int] = {}
    emitted = busy = 0.0
    rows = 0
    for a in storage.aggregate(server=server):
        occupancy[a.b] = occupancy.get(a.b, 0.0) + a.busy_s
        steps[a.b] = steps.get(a.b, 0) + a.decode_steps
        emitted += a.emitted_tokens
        busy += a.busy_s
        rows += a.rows
    arms = policy.arms
    kw = {"graph_bs": graph_bs, "skip_zero_draft_extend": skip_zero_draft_extend}
    g = {
        (b, k): oracle.expected_goodput(profile, workload, b, k, **kw)  # type: ignore[arg-type]
        for b in occupancy
        for k in arms
    }

    def mean(occ: dict[int, float], arm_of: Callable[[int], int]) -> float:
        total = sum(occ.values())
        return sum(t * g[(b, arm_of(b))] for b, t in occ.items()) / total if total else math.nan

    buckets = policy.buckets
    greedy = policy.greedy()
    banded = (greedy_table is not None and is_banded(greedy_table)
              and not is_uniform(greedy_table) and step_sums is not None)  # type: ignore[arg-type]
    index = {k: i for i, k in enumerate(step_arms)}

    def band_value(b: int, ref: int) -> float:
        """The banded table's expected goodput at ``b``, by the run's steps (see above)."""
        sums = step_sums.get(b) if step_sums is not None else None
        ks = greedy_arms(greedy_table, b)  # type: ignore[arg-type]
        if sums is None or not sums.band_tokens:
            return g[(b, ks[0])]
        num = sum(t[index[ks[band]]] for band, t in sums.band_tokens.items())
        den = sum(t[index[ref]] for t in sums.band_tokens.values())
        return g[(b, ref)] * num / den if den > 0 else g[(b, ks[0])]

    def weighted(occ: dict[int, float], value: Callable[[int], float]) -> float:
        total = sum(occ.values())
        return sum(t * value(b) for b, t in occ.items()) / total if total else math.nan

    verdicts = []
    for i in range(len(buckets)):
        low, high = buckets.bounds(i)
        occ = {b: t for b, t in occupancy.items() if b >= low and (high is None or b <= high)}
        if not occ:
            continue
        by_arm = {k: mean(occ, lambda b, k=k: k) for k in arms}
        best = max(arms, key=lambda k: (by_arm[k], -k))
        top = high if high is not None else low
        learned = lookup(greedy, top)
        bands = greedy_arms(greedy_table, top) if banded else None  # type: ignore[arg-type]
        verdicts.append(
            BucketVerdict(
                label=buckets.label(i),
                steps=sum(steps[b] for b in occ),
                learned_k=learned if bands is None else bands[0],
                oracle_k=best,
                learned_goodput=(by_arm[learned] if bands is None
                                 else weighted(occ, lambda b, r=best: band_value(b, r))),
                oracle_goodput=by_arm[best],
                learned_bands=bands,
            )
        )

    def oracle_arm(b: int) -> int:
        return max(arms, key=lambda k: (g[(b, k)], -k))

    oracle_g = mean(occupancy, oracle_arm)
    if banded:
        learned_g = weighted(occupancy, lambda b: band_value(b, oracle_arm(b)))
    else:
        learned_g = mean(occupancy, lambda b: lookup(greedy, b))
    default_g = mean(occupancy, (lambda b: max(arms)) if start_table is None
                     else (lambda b: lookup(start_table, b)))
    measured = emitted / busy if busy > 0 else math.nan
    return tuple(verdicts), measured, oracle_g, learned_g, default_g, rows


def _switchback(storage: Storage, address: str, daemon: Daemon, engine: object):
    """The switchback's estimate from the history, and the oracle's value of what it
    estimates (NaN without a pair)."""
    from functools import cache

    from tuner.daemon._holdout import stratum
    from tuner.report_switchback import read_pairs, server_switchback, true_gain
    from tuner.sim import oracle

    pairs = read_pairs(storage, address)
    if not pairs:
        return None, math.nan

    @cache
    def expected(b: int, k: int) -> float:
        return oracle.expected_goodput(engine.profile, engine.workload, b, k,
                                       graph_bs=tuple(engine.graph_bs),
                                       skip_zero_draft_extend=engine.skip_zero_draft_extend)

    truth = true_gain(storage, address, pairs, expected, lambda b: stratum(daemon.buckets, b))
    return server_switchback(storage, address), truth


def run_simulation(
    config: TunerConfig,
    sim: SimulateConfig,
    *,
    stop_event: threading.Event | None = None,
    on_tick: Callable[[DaemonStatus], None] | None = None,
    metrics: object = None,
) -> SimulationSummary:
    """Start the simulator, tune it for ``sim.duration_s`` simulated seconds (or until
    ``stop_event``), and judge the result.

    ``config.servers`` is ignored (the simulator's address is used); ``config.duration_s``
    is replaced by ``sim.duration_s``.

    Raises:
        ConfigError: an unknown profile, workload or load schedule.
        StorageError: the database cannot be opened.
    """
    from tuner.sim.server import SimServer

    stop = stop_event if stop_event is not None else threading.Event()
    pace = _Lockstep()
    try:
        # The simulator's clock is ``pace``: virtual time moves only when the daemon waits,
        # so every reading sees exactly one interval of simulated traffic however long the
        # daemon's own work takes; ``sim.speed`` caps how fast that runs in wall time.
        def make(port: int) -> SimServer:
            return SimServer(profile=sim.profile, workload=sim.workload, load=sim.load,
                             max_running=sim.max_running, seed=sim.seed, speed=1.0,
                             clock=pace, port=port)

        server = make(sim.port)
    except ValueError as exc:  # e.g. a profile that cannot cost the running-request cap
        raise ConfigError(f"simulator: {exc}") from exc
    start_table = server.core.table  # before the daemon's first push
    storage = Storage(config.db_url)
    wall0 = time.monotonic()
    try:
        try:
            server.start()
        except OSError as exc:  # the fixed port is taken (another run?): any free one
            log.warning("simulator: port %d is busy (%s); on a free port instead, so this "
                        "run starts without the history of earlier runs", sim.port,
                        exc.strerror or exc)
            server = make(0)
            server.start()
        address = f"127.0.0.1:{server.port}"
        cfg = config.with_(servers=(address,), duration_s=sim.duration_s)
        engine_t0 = server.engine.now
        epoch0 = time.time()
        paced_until = time.monotonic()

        def clock() -> float:
            return epoch0 + pace.t

        def wait(seconds: float) -> bool:
            nonlocal paced_until
            target = pace.t + seconds
            pace.t = target
            engine = server.engine
            while engine.now < target - 1e-9:  # the driver catches up within milliseconds
                if stop.wait(_POLL_S):
                    return True
            paced_until = max(paced_until + seconds / sim.speed, time.monotonic() - 1.0)
            ahead = paced_until - time.monotonic()
            return stop.wait(ahead) if ahead > 0 else stop.is_set()

        daemon = Daemon(cfg, storage=storage, clock=clock, wait=wait, on_tick=on_tick,
                        stop_event=stop, metrics=metrics)
        log.info("simulating %s / %s under load %s at x%g for %g simulated s; the server "
                 "starts on %s", sim.profile, sim.workload, sim.load, sim.speed,
                 sim.duration_s, format_table(start_table))
        daemon.run()
        simulated = server.engine.now - engine_t0
        with server.lock:
            core = server.core
            # As the daemon keeps it: banded where the bands differ.
            server_table, version = canon(core.band_table), core.version
        policy = daemon.policy_of(address)
        greedy = daemon.greedy_table(address)
        with server.lock:  # what every arm would have yielded on the run's steps, by band
            step_arms, step_sums = server.engine.step_oracle.arms, server.engine.step_oracle.take()
        status = daemon.status()
        pushes = status.servers[0].pushes if status is not None else 0
        if policy is None:
            raise ConfigError("the simulator never answered; nothing was learned")
        verdicts, measured, oracle_g, learned_g, default_g, rows = summarize(
            storage=storage,
            server=address,
            policy=policy,
            profile=server.engine.profile,
            workload=server.engine.workload,
            graph_bs=tuple(server.engine.graph_bs),
            skip_zero_draft_extend=server.engine.skip_zero_draft_extend,
            start_table=start_table,
            greedy_table=greedy,
            step_sums=step_sums,
            step_arms=step_arms,
        )
        switchback, truth = _switchback(storage, address, daemon, server.engine)
        return SimulationSummary(
            switchback=switchback,
            switchback_truth=truth,
            server=address,
            profile=sim.profile,
            workload=sim.workload,
            simulated_s=simulated,
            wall_s=time.monotonic() - wall0,
            pushes=pushes,
            final_version=version,
            server_table=server_table,
            greedy_table=greedy,
            buckets=verdicts,
            measured_goodput=measured,
            oracle_goodput=oracle_g,
            learned_goodput=learned_g,
            default_goodput=default_g,
            start_table=start_table,
            observations=rows,
            db_url=storage.url,
        )
    finally:
        server.stop()
        storage.close()

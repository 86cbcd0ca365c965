"""Policies side by side against the oracle, in simulated time.

Each run drives one policy exactly as the daemon does — read the server's cumulative
counters every ``interval_s``, turn the deltas into observations, ``update``, and every
``decision_period_s`` ``propose`` and push the table if it changed — but against the
simulator's engine on a virtual clock, through the plugin's own core.

Scoring uses expectations, not the noisy realised tokens, so a figure is reproducible and
never exceeds the oracle: for every ``(b, k)`` the policy ran, its decode busy time counts
at the *expected* goodput of ``k`` at ``b`` (:func:`tuner.sim.oracle.expected_goodput`), and
the oracle's at the best arm's. "% of oracle" of a load phase is the ratio of the two sums
over the phase, with and without its first ``warmup_s`` seconds.

Beside that per-bucket oracle stands the per-step oracle (:mod:`tuner.sim._step_oracle`),
which picks each step's arm for the very requests in it, knowing each one's acceptance; a
banded table (arms per acceptance band) is likewise scored on its steps, and may beat the
per-bucket oracle (:mod:`tuner.bench_step` says how the batches' luck cancels).

Per run and load phase the bench reports: % of oracle (after warm-up and including it),
tokens lost to exploration (time spent off the greedy arm, at the greedy arm's goodput minus
the explored arm's), table switches, and p50/p99 time per output token of the requests that
finished in the phase. Per bucket: the traffic seconds and decode steps until the greedy
decision stayed within 2 % of the oracle — or, where the bucket's two best arms are within 3 %
of each other, ran only those (counted again after each change of the workload's mix;
:mod:`tuner.bench_converge`).

Generated worlds (:mod:`tuner.sim.worlds`) run through :func:`run_one`'s ``world`` argument;
:mod:`tuner.bench_worlds` runs a range of them.

The module is split along its seams — :mod:`tuner.bench_config` (defaults, policy specs,
:class:`BenchConfig`), :mod:`tuner.bench_results` (the result records),
:mod:`tuner.bench_converge` (the convergence measure), :mod:`tuner.bench_step` (step-level
scoring) and :mod:`tuner.bench_targets` (the targets) — and re-exports their public names.

Every run of a bench uses the same seed, so all policies see the same requests. Runs are
independent and spread over ``jobs`` processes; the results do not depend on ``jobs``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from policies import BasePolicy, Buckets, Observation, split_probes
from tuner.bench_config import (
    DEFAULT_ARMS,
    DEFAULT_BENCH_DECISION_PERIOD_S,
    DEFAULT_BENCH_INTERVAL_S,
    DEFAULT_BENCH_LOAD,
    DEFAULT_BENCH_POLICIES,
    DEFAULT_BENCH_PROFILES,
    DEFAULT_BENCH_WORKLOADS,
    DEFAULT_OPEN_LOOP_S,
    DEFAULT_WARMUP_S,
    SGLANG_REAL,
    TREE_SKIPS,
    BenchConfig,
    build_policy,
    parse_policy_spec,
)
from tuner.bench_converge import CONVERGE_TIE, CONVERGE_TOLERANCE, BucketTrack
from tuner.bench_results import BenchResult, BucketConvergence, PhaseResult, RunResult
from tuner.bench_step import BandFeed, StepScore, greedy_arms, single_arm_view
from tuner.bench_targets import TARGETS, TargetCheck, check_targets, summarize_policies
from tuner.plugin.core import PluginCore
from tuner.protocol import (
    CounterRow,
    Table,
    TreeShape,
    counter_deltas,
    encode_update,
    is_uniform,
)
from tuner.sim._step_cost import MachineDrift
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop, parse_load
from tuner.sim.oracle import expected_goodput
from tuner.sim.profiles import CostProfile, load_profile
from tuner.sim.tree import TreeArm, tree_goodput
from tuner.sim.workloads import Workload, get_workload
from tuner.sim.worlds import World

__all__ = [
    "CONVERGE_TIE",
    "CONVERGE_TOLERANCE",
    "DEFAULT_ARMS",
    "DEFAULT_BENCH_LOAD",
    "DEFAULT_BENCH_POLICIES",
    "DEFAULT_BENCH_PROFILES",
    "DEFAULT_BENCH_WORKLOADS",
    "DEFAULT_WARMUP_S",
    "SGLANG_REAL",
    "TARGETS",
    "BenchConfig",
    "BenchResult",
    "BucketConvergence",
    "PhaseResult",
    "RunResult",
    "TargetCheck",
    "check_targets",
    "parse_policy_spec",
    "run_bench",
    "run_one",
    "sglang_available",
    "summarize_policies",
]

log = logging.getLogger(__name__)


# --- one run ------------------------------------------------------------------------------


def sglang_available() -> bool:
    """Whether SGLang's real AdaptiveSpeculativeParams can be imported here."""
    try:
        from sglang.srt.speculative.adaptive_spec_params import (  # noqa: F401
            AdaptiveSpeculativeParams,
        )
    except Exception:  # any failure means: not in this environment
        return False
    return True


class _SGLangCore(PluginCore):
    """A plugin core whose decisions come from SGLang's own AdaptiveSpeculativeParams.

    The engine asks ``steps_for_batch`` before each decode launch and reports each step
    through ``record_decode``; here the step's accepted drafts go to the real class's
    ``on_verify_complete`` (its EMA uses the batch mean, so spreading the total evenly over
    the requests feeds it exactly what a real batch would).
    """

    def __init__(self, arms: Iterable[int], *, started_at: float, graph_bs: Sequence[int]):
        super().__init__(arms, started_at=started_at)
        from tuner.plugin._sglang import stock_adaptive_params

        # SGLang's own class even where our plugin has replaced it (load_plugins() ran).
        self._params = stock_adaptive_params()(initial_steps=3, cfg_path=None)
        self._params.set_cuda_graph_bs(list(graph_bs))
        self._graph_bs = sorted(set(graph_bs))

    def decision_table(self) -> Table:
        """What the real class would run now, per graph batch size: its 'greedy' table (it
        has no exploration, so scoring it against its initial table would count every
        decision it made as exploration)."""
        rows: list[tuple[int | None, int]] = [(b, self.steps_for_batch(b)) for b in self._graph_bs]
        rows[-1] = (None, rows[-1][1])
        return tuple(rows)

    def steps_for_batch(self, batch_size: int) -> int:
        k = int(self._params.get_steps_for_batch(batch_size))
        return k if k in self.arms else max(a for a in self.arms if a <= k)

    def record_decode(self, b: int, k: int, emitted: int, accepted: int, launch_ts: float,
                      forward_iter: int, after_idle_gap: bool = False,
                      band: int | None = None, first_rejected: int = 0) -> None:
        per, extra = divmod(int(accepted), max(b, 1))
        self._params.on_verify_complete([per + (1 if i < extra else 0) for i in range(b)], b)
        super().record_decode(b, k, emitted, accepted, launch_ts, forward_iter, after_idle_gap,
                              band, first_rejected)


@dataclass
class _PhaseAcc:
    start: float
    end: float
    concurrency: int | None
    busy: float = 0.0
    got: float = 0.0
    best: float = 0.0
    busy_w: float = 0.0
    got_w: float = 0.0
    best_w: float = 0.0
    step: float = 0.0  # the per-step oracle's expected tokens
    step_w: float = 0.0
    banded: bool = False  # a banded table was in force in some reading
    emitted: int = 0
    explore_lost: float = 0.0
    switches: int = 0


def _load_phases(
    load: str, duration: float | None, seed: int
) -> list[tuple[float, float, int | None]]:
    spec = parse_load(load, seed=seed)
    if isinstance(spec, ClosedLoop):
        out, t = [], 0.0
        phases = list(spec.phases)
        if phases[-1][0] >= 1e17:  # "hold forever": run it for duration (or one minute)
            phases[-1] = (duration or 60.0, phases[-1][1])
        for d, c in phases:
            out.append((t, t + d, c))
            t += d
        if duration is not None and duration < t:
            out = [(s, min(e, duration), c) for s, e, c in out if s < duration]
        return out
    return [(0.0, duration or DEFAULT_OPEN_LOOP_S, None)]


def _workload_for(name: str, total_s: float) -> Workload:
    if name == "shift":
        third = total_s / 3
        return get_workload(f"chat:{third:g},code:{third:g},hard:{third:g}")
    return get_workload(name)


def run_one(
    *,
    profile: str,
    workload: str,
    load: str,
    policy: str,
    seed: int = 0,
    policy_seed: int | None = None,
    arms: Sequence[int] = DEFAULT_ARMS,
    interval_s: float = DEFAULT_BENCH_INTERVAL_S,
    decision_period_s: float = DEFAULT_BENCH_DECISION_PERIOD_S,
    warmup_s: float = DEFAULT_WARMUP_S,
    duration_s: float | None = None,
    max_running: int | None = None,
    skip_zero_draft_extend: bool = False,
    world: World | None = None,
    tree: TreeShape | None = None,
    machine_drift: MachineDrift | None = None,
) -> RunResult:
    """Run one policy through one scenario; see the module docstring for the scoring.

    With ``world``, the world's cost profile, traffic and step-time noise replace
    ``profile`` and ``workload`` (which then only label the run). With ``tree``, the server
    drafts that tree at its arm ``tree.steps`` (arms 0 and the tree), in the engine and the
    scoring alike. With ``machine_drift`` the engine's steps run on a machine whose speed
    wanders (every arm alike, so the scoring, by expectation, is unchanged). ``policy_seed``
    seeds the policy's own random choices instead of ``seed`` (the traffic stays ``seed``'s).
    """
    wall0 = time.perf_counter()
    phases = _load_phases(load, duration_s, seed)
    total = phases[-1][1]
    if world is not None:
        prof: CostProfile = world.profile()
        wl = world.workload(total)
    else:
        prof = load_profile(profile)
        wl = _workload_for(workload, total)
    peak = max((c for _, _, c in phases if c is not None), default=256)
    cap = max_running or prof.max_running or max(peak, 1)
    if prof.max_batch is not None:
        cap = min(cap, prof.max_batch)
    arms = tuple(sorted(set(arms)))
    buckets = Buckets()
    real = policy == SGLANG_REAL
    core: PluginCore
    pol: BasePolicy | None = None
    if real:
        from tuner.sim.graphs import cuda_graph_bs

        core = _SGLangCore(arms, started_at=0.0, graph_bs=cuda_graph_bs(cap))
    else:
        core = PluginCore(arms, started_at=0.0, tree=tree)
        pol = build_policy(policy, arms, seed if policy_seed is None else policy_seed, prof,
                           wl, tree)
    tree_arm = TreeArm(tree) if tree is not None else None
    engine = Engine(profile=prof, workload=wl, core=core, max_running=cap, seed=seed,
                    load=parse_load(load, seed=seed),
                    skip_zero_draft_extend=skip_zero_draft_extend,
                    step_noise=world.noise if world is not None else 0.0,
                    machine_drift=machine_drift)

    mixes = list(wl.phases)
    gcache: dict[tuple[int, int, int], float] = {}

    def mix_at(t: float) -> int:
        return 0 if wl.stationary else mixes.index(wl.phase_at(t))

    def good(b: int, k: int, mix: int, t: float) -> float:
        key = (b, k, mix)
        g = gcache.get(key)
        if g is None and tree_arm is not None and k == tree_arm.steps:
            g = gcache[key] = tree_goodput(prof, wl, tree_arm, b, t=t, graph_bs=engine.graph_bs)
        if g is None:
            g = gcache[key] = expected_goodput(
                prof, wl, b, k, t=t, skip_zero_draft_extend=skip_zero_draft_extend,
                graph_bs=engine.graph_bs,
            )
        return g

    def best(b: int, mix: int, t: float) -> float:
        return max(good(b, k, mix, t) for k in arms)

    step_score = StepScore(engine.step_oracle.arms)

    accs = [_PhaseAcc(s, e, c) for s, e, c in phases]
    tracks = [BucketTrack() for _ in range(len(buckets))]
    version = 0
    switches = 0
    probing = False  # the last push sent probes

    def push(table: Table) -> bool:
        """Push a proposal if the server does not run it; True when its table changed. A
        banding server takes an exploring row as a probe, and a proposal that no longer
        explores ends the probes sent before (as the daemon does)."""
        nonlocal version, probing
        probes: tuple = ()
        if feed.on:
            table, probes = split_probes(table, feed.greedy())
        changed = table != core.table and table != core.band_table
        if not changed and not probes and not probing:
            return False
        version += 1
        ok, why = core.apply_update(encode_update(table, version, probes=probes))
        if not ok:  # a policy bug; the bench must say so rather than score a stale table
            raise RuntimeError(f"policy {policy!r} proposed a table the plugin refused: {why}")
        probing = bool(probes)
        return changed

    def observed_table() -> Table:
        return core.decision_table() if isinstance(core, _SGLangCore) else core.table

    greedy_table: Table = observed_table()
    feed = BandFeed(pol, tree is not None)
    if pol is not None:
        push(feed.propose())
        greedy_table = feed.greedy()
    prev: tuple[CounterRow, ...] = ()
    t = 0.0
    next_decision = decision_period_s
    tick = 0
    total_tokens = 0.0
    while t < total - 1e-9:
        t_next = min(t + interval_s, total)
        engine.run_until(t_next)
        tick += 1
        mid = (t + t_next) / 2
        mix = mix_at(mid)
        acc = next((a for a in accs if a.start <= mid < a.end), accs[-1])
        after_warmup = mid >= acc.start + warmup_s
        sums = engine.step_oracle.take()
        step_score.read(sums, lambda b, k: good(b, k, mix, mid))
        # A banded table's arm depends on the batch: scored on its steps (tuner.bench_step).
        banded = not is_uniform(core.band_table)
        acc.banded |= banded
        state = core.state()
        rows = state.counters
        feed.read(state.bands, state.depths)
        obs: list[Observation] = []
        per_bucket: dict[int, list[tuple[int, float]]] = {}
        # The engine never restarts, so its counters never go backwards.
        for row in counter_deltas(prev, rows) or ():
            steps, busy, emitted = row.decode_steps, row.busy_s, row.emitted_tokens
            obs.append(Observation(row.b, row.k, steps, emitted, row.accepted_drafts,
                                   row.drafted_tokens, busy))
            g_arm, g_best = good(row.b, row.k, mix, mid), best(row.b, mix, mid)
            g_run = step_score.banded(row.b, g_best, g_arm) if banded else g_arm
            acc.busy += busy
            acc.got += busy * g_run
            acc.best += busy * g_best
            g_step = step_score.step_oracle(row.b, g_best)
            acc.step += busy * g_step
            acc.emitted += emitted
            total_tokens += busy * g_run
            if after_warmup:
                acc.busy_w += busy
                acc.got_w += busy * g_run
                acc.best_w += busy * g_best
                acc.step_w += busy * g_step
            k_greedy = greedy_arms(greedy_table, engine.padded(row.b))
            if row.k not in k_greedy:
                acc.explore_lost += busy * (good(row.b, k_greedy[0], mix, mid) - g_arm)
            per_bucket.setdefault(buckets.index(row.b), []).append((row.b, busy))
            track = tracks[buckets.index(row.b)]
            track.steps += steps
        prev = rows
        if pol is not None:
            for o in obs:
                pol.update(o)
            # A banded policy is judged on its banded decision (tuner.bench_converge).
            current = feed.greedy() if feed.on else single_arm_view(pol.greedy())
        else:
            current = observed_table()
        for j, seen in per_bucket.items():
            tracks[j].tick(mix, seen, current, engine.padded, good, best, mid, arms,
                           {b: sums[b].band_tokens for b, _ in seen if b in sums})
        if pol is not None and t_next >= next_decision - 1e-9:
            next_decision += decision_period_s
            if push(feed.propose()):
                switches += 1
                acc.switches += 1
            greedy_table = feed.greedy()
        elif pol is None:
            greedy_table = current
        t = t_next

    conv = [c for j, track in enumerate(tracks)
            if (c := track.result(buckets.label(j), interval_s)) is not None]

    results = []
    for i, a in enumerate(accs):
        stats = engine.request_stats(a.start, a.end)
        results.append(PhaseResult(
            index=i, start_s=a.start, end_s=a.end, concurrency=a.concurrency,
            pct_oracle=_pct(a.got_w, a.best_w, a.banded),
            pct_oracle_all=_pct(a.got, a.best, a.banded),
            goodput=a.got / a.busy if a.busy else math.nan,
            goodput_after=a.got_w / a.busy_w if a.busy_w else math.nan,
            oracle_goodput=a.best / a.busy if a.busy else math.nan,
            measured_goodput=a.emitted / a.busy if a.busy else math.nan,
            decode_busy_s=a.busy, explore_tokens_lost=a.explore_lost, switches=a.switches,
            tpot_p50_ms=stats.tpot_p50_s * 1e3, tpot_p99_ms=stats.tpot_p99_s * 1e3,
            pct_step_oracle=_pct(a.got_w, a.step_w), pct_step_oracle_all=_pct(a.got, a.step),
            step_oracle_goodput=a.step / a.busy if a.busy else math.nan,
        ))
    lost = sum(a.explore_lost for a in accs)
    banded_run = any(a.banded for a in accs)
    return RunResult(
        profile=prof.name, workload=workload, load=load, policy=policy, seed=seed,
        phases=tuple(results), convergence=tuple(conv),
        pct_oracle=_pct(sum(a.got_w for a in accs), sum(a.best_w for a in accs), banded_run),
        pct_oracle_all=_pct(sum(a.got for a in accs), sum(a.best for a in accs), banded_run),
        explore_tokens_lost=lost,
        explore_pct=100.0 * lost / total_tokens if total_tokens > 0 else 0.0,
        switches=switches,
        final_table=pol.greedy() if pol is not None else observed_table(),
        notes=pol.snapshot().notes if pol is not None else (),
        wall_s=time.perf_counter() - wall0,
        pct_step_oracle=_pct(sum(a.got_w for a in accs), sum(a.step_w for a in accs)),
        pct_step_oracle_all=_pct(sum(a.got for a in accs), sum(a.step for a in accs)),
    )


def _pct(got: float, best: float, banded: bool = False) -> float:
    if best <= 0:
        return math.nan
    # A table by batch size alone scores each (b, k) at most at the best arm's (the min is
    # for float rounding only); a banded table may beat the per-bucket oracle on its steps.
    return 100.0 * got / best if banded else min(100.0, 100.0 * got / best)


# --- the whole bench ------------------------------------------------------------------------


def _run_kwargs(config: BenchConfig) -> dict[str, Any]:
    return dict(
        load=config.load, seed=config.seed, policy_seed=config.policy_seed, arms=config.arms,
        interval_s=config.interval_s, decision_period_s=config.decision_period_s,
        warmup_s=config.warmup_s,
        duration_s=config.duration_s, max_running=config.max_running,
        skip_zero_draft_extend=config.skip_zero_draft_extend, tree=config.tree,
        machine_drift=config.machine_drift,
    )


def _run_star(kw: dict[str, Any]) -> RunResult:
    return run_one(**kw)


def _run_jobs(
    jobs: list[dict[str, Any]],
    workers: int | None,
    progress: Callable[[RunResult], None] | None,
) -> list[RunResult]:
    """:func:`run_one` of every job, in the jobs' order: here, one at a time, when one worker
    (of ``workers``, default the CPU count) is enough, else in a pool of processes.
    ``progress`` sees each result as it comes."""
    n_jobs = min(workers or os.cpu_count() or 1, len(jobs))
    runs: list[RunResult] = []
    if n_jobs <= 1:
        for kw in jobs:
            r = run_one(**kw)
            runs.append(r)
            if progress:
                progress(r)
    else:
        with ProcessPoolExecutor(max_workers=n_jobs) as pool:
            for r in pool.map(_run_star, jobs):
                runs.append(r)
                if progress:
                    progress(r)
    return runs


def run_bench(
    config: BenchConfig, *, progress: Callable[[RunResult], None] | None = None
) -> BenchResult:
    """Run every (profile, workload, policy) of ``config``; results in a fixed order.

    Raises:
        ConfigError: a profile or workload that does not load (named).
    """
    for p in config.profiles:
        load_profile(p)
    for w in config.workloads:
        if w != "shift":
            get_workload(w)
    skipped = []
    policies = list(config.policies)
    if config.tree is not None:
        for spec in list(policies):
            why = TREE_SKIPS.get(parse_policy_spec(spec)[0])
            if why is not None:
                policies.remove(spec)
                skipped.append(f"{spec}: {why}")
    if SGLANG_REAL in policies and not sglang_available():
        policies.remove(SGLANG_REAL)
        skipped.append(f"{SGLANG_REAL}: sglang is not importable here")
    base = _run_kwargs(config)
    jobs = [
        dict(base, profile=p, workload=w, policy=pol)
        for p in config.profiles for w in config.workloads for pol in policies
    ]
    t0 = time.perf_counter()
    runs = _run_jobs(jobs, config.jobs, progress)
    result = BenchResult(config=config, runs=tuple(runs), skipped=tuple(skipped),
                         wall_s=time.perf_counter() - t0)
    return BenchResult(config=config, runs=result.runs, skipped=result.skipped,
                       wall_s=result.wall_s, checks=tuple(check_targets(result)))

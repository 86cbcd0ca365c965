"""The simulator's engine: an SGLang-like scheduler on a virtual clock.

What one iteration does, as SGLang 0.5.23's scheduler does it:

- **Prefill first.** If requests wait and fewer than ``max_running`` run, admit waiting requests
  (FIFO, up to a prefill token budget) into one prefill forward; each gets its first token.
- **Otherwise one decode step** over every running request (continuous batching). The batch
  size is padded up to the next captured CUDA-graph size; the arm ``k`` comes from
  ``core.steps_for_batch(padded)`` — the plugin's own lookup — and the step costs
  ``profile.step_s(padded, k)``.
- **Chain acceptance.** Each request has its own α (drawn from a Beta around the workload
  class mean) and accepts draft position ``i`` with probability ``α·δ^(i−1)`` given the earlier
  ones; it emits ``1 + accepted`` tokens. Drawn with one uniform per request per step from
  precomputed survival rows, vectorised with numpy.
- **Other shapes and drift.** A request class may carry an acceptance shape (non-chain
  position profiles, acceptance drifting over the request's output; :mod:`tuner.sim.acceptance`):
  its requests' survival rows come from the shape, and drifting ones are recomputed before
  each drafting step from their progress.
- **Trees.** When the core carries a tree (top-k > 1; arms 0 and its depth ``S``), arm ``S``
  costs and accepts as :mod:`tuner.sim.tree` models it.
- **Step-time noise.** With ``step_noise`` σ > 0 each decode step's time is multiplied by a
  mean-one lognormal factor ``exp(σ·Z − σ²/2)`` (its own random stream), so expectations —
  and the oracle — are unchanged while the telemetry is noisy. With ``machine_drift`` the
  factor also carries the machine's speed, which wanders over minutes of busy time
  (correlated from step to step, alike for every arm): arms measured at different times meet
  different machines, as on a loaded CPU server.
- **k = 0.** By default SGLang still runs the draft extend (a cost, acceptance unharmed).
  With ``skip_zero_draft_extend`` (``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``) the extend is
  skipped and every request that decoded at ``k = 0`` drafts from stale state afterwards: its
  α is multiplied by ``cold_factor`` until it finishes (anchors §3.5 (c)).
- **Per-step oracle.** Each decode step also tells :attr:`Engine.step_oracle` (a
  :class:`~tuner.sim._step_oracle.StepOracle`) its batch, arm and time; it keeps what every arm,
  and each step's best arm for the very requests running, would have yielded in expectation.
- **Telemetry** goes through ``core.record_decode`` exactly as the plugin's hook does: with the
  overlap scheduler, step N's result is processed after step N+1 launched, and it is recorded
  with the arm N was *launched* with, its launch time and its forward counter. Processing it
  also feeds the core's acceptance estimate (:mod:`tuner.plugin.acceptance`) as the plugin's
  hook does, so a banded table switches on the same signal here as on a server, and the
  step counts in the band the estimate returns.

Time is virtual (seconds from 0). Nothing here reads a clock or sleeps; the HTTP server maps
it to real time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tuner.plugin._sglang import FULL_SAMPLE
from tuner.plugin.core import PluginCore
from tuner.sim._counters import EngineCounters
from tuner.sim._requests import Request, RequestLog, RequestStats
from tuner.sim._running import RunningRows
from tuner.sim._step_cost import MachineDrift, StepCosts
from tuner.sim._step_oracle import StepOracle
from tuner.sim.graphs import cuda_graph_bs
from tuner.sim.load import Load, NoLoad
from tuner.sim.profiles import CostProfile, load_profile
from tuner.sim.tree import TreeArm
from tuner.sim.workloads import CLASSES, RequestClass, Workload, get_workload

__all__ = [
    "DEFAULT_ARMS",
    "DEFAULT_COLD_FACTOR",
    "DEFAULT_DECODE_LOG_INTERVAL",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_PREFILL_TOKEN_BUDGET",
    "Engine",
    "EngineCounters",
    "Request",
    "RequestStats",
]

DEFAULT_ARMS = (0, 1, 3, 5)
# SGLang's max_running_requests default under EAGLE.
DEFAULT_MAX_RUNNING = 48
# SGLang's chunked prefill size on large GPUs; one prefill forward takes at most this many
# prompt tokens (a longer prompt still goes in one forward here, costed by its length).
DEFAULT_PREFILL_TOKEN_BUDGET = 8192
# α multiplier for requests drafting from stale state after skipped draft extends (ρ in
# anchors §3.5 (c), range 0.1-0.3).
DEFAULT_COLD_FACTOR = 0.2
# SGLang refreshes its Prometheus gauges every --decode-log-interval decode batches.
DEFAULT_DECODE_LOG_INTERVAL = 40


class Engine:
    """A continuous-batching SGLang server with speculative decoding, on a virtual clock.

    Args:
        profile: a :class:`CostProfile` or a name/path for :func:`load_profile`.
        workload: a :class:`Workload` or a name for :func:`get_workload`.
        arms: the arms the server built (ignored when ``core`` is given; then ``core.arms``).
        core: the plugin core deciding and recording; a fresh one (default table: the largest
            arm everywhere) when None.
        max_running: running-request cap; default the profile's, else 48 (SGLang under EAGLE).
        skip_zero_draft_extend: SGLang's ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``.
        seed: seeds request attributes and acceptance draws (separate streams, so a policy
            change does not change which requests arrive).
        load: built-in traffic; see :mod:`tuner.sim.load`.
        cold_factor: α multiplier after skipped draft extends.
        prefill_token_budget: prompt tokens per prefill forward.
        graph_max_bs: largest captured CUDA-graph batch size (default ``max_running``).
        started_at: the core's wall-clock start stamp (default: now).
        decode_log_interval: decode steps between gauge refreshes.
        step_noise: σ of the mean-one lognormal factor on each decode step's time (0: none).
        machine_drift: the machine's speed wandering over busy seconds (None: steady); see
            :class:`~tuner.sim._step_cost.MachineDrift`.

    Raises:
        ProfileRangeError: the profile cannot cost a batch the engine may run.
    """

    # The running requests' rows; benchmarks/sim_speed.py swaps in a per-request baseline.
    _rows_class: type[RunningRows] = RunningRows

    def __init__(
        self,
        *,
        profile: CostProfile | str,
        workload: Workload | str,
        arms: Iterable[int] = DEFAULT_ARMS,
        core: PluginCore | None = None,
        max_running: int | None = None,
        skip_zero_draft_extend: bool = False,
        seed: int = 0,
        load: Load | None = None,
        cold_factor: float = DEFAULT_COLD_FACTOR,
        prefill_token_budget: int = DEFAULT_PREFILL_TOKEN_BUDGET,
        graph_max_bs: int | None = None,
        started_at: float | None = None,
        decode_log_interval: int = DEFAULT_DECODE_LOG_INTERVAL,
        step_noise: float = 0.0,
        machine_drift: MachineDrift | None = None,
    ) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.workload = get_workload(workload) if isinstance(workload, str) else workload
        if core is None:
            core = PluginCore(arms, started_at=time.time() if started_at is None else started_at)
        self.core = core
        self.arms = core.arms
        cap = (
            max_running
            if max_running is not None
            else (self.profile.max_running or DEFAULT_MAX_RUNNING)
        )
        if cap < 1:
            raise ValueError(f"max_running must be >= 1, got {cap}")
        if not 0.0 <= cold_factor <= 1.0:
            raise ValueError(f"cold_factor must be in [0, 1], got {cold_factor}")
        if not (math.isfinite(step_noise) and 0.0 <= step_noise <= 1.0):
            raise ValueError(f"step_noise must be in [0, 1], got {step_noise}")
        if prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {prefill_token_budget}")
        self.max_running = int(cap)
        self.skip_zero_draft_extend = bool(skip_zero_draft_extend)
        self.cold_factor = float(cold_factor)
        self.prefill_token_budget = int(prefill_token_budget)
        self.decode_log_interval = int(decode_log_interval)
        self.graph_bs = cuda_graph_bs(
            graph_max_bs if graph_max_bs is not None else self.max_running
        )
        # A tree server's non-zero arm is its tree (tuner.sim.tree): its own cost, and its
        # acceptance lifted from the chain rows.
        tree = TreeArm(core.tree) if core.tree is not None else None

        ss = np.random.SeedSequence(seed)
        # A third stream for noise, a fourth for the machine's drift: the first ones stay
        # what they were without them.
        req_ss, acc_ss, noise_ss, drift_ss = ss.spawn(4)
        self._req_rng = np.random.default_rng(req_ss)
        self.step_noise = float(step_noise)
        self._costs = StepCosts(
            self.profile,
            self.arms,
            max_running=self.max_running,
            graph_bs=self.graph_bs,
            skip_zero_draft_extend=self.skip_zero_draft_extend,
            tree=tree,
            step_noise=self.step_noise,
            noise_rng=np.random.default_rng(noise_ss),
            machine_drift=machine_drift,
            drift_rng=np.random.default_rng(drift_ss),
        )
        self._pad = self._costs.pad
        kmax = max(max(self.arms), 1)
        self._rows = self._rows_class(
            self.max_running, kmax, self.cold_factor, tree, np.random.default_rng(acc_ss)
        )
        # Each step's best arm for its own requests, beside the per-bucket oracle (the bench
        # takes its sums; it draws nothing, so it changes no run).
        self.step_oracle = StepOracle(self.arms, self._costs.expected_s)

        self.now = 0.0
        self.counters = EngineCounters()
        self._forward_iter = 0
        self._idled = False
        self._next_rid = 0
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # aligned with self._rows
        self._pending: (tuple[int, int, int, int, float, int, bool, float | None, int]
                        | None) = None
        self._log = RequestLog()
        self._load: Load = NoLoad()
        self._load_next = math.inf
        self.attach_load(load if load is not None else NoLoad())

    # --- inputs -----------------------------------------------------------------------------

    def attach_load(self, load: Load) -> None:
        """Replace the built-in traffic; the new load starts at ``now``.

        Requests of the previous load still run to completion but start no successors.
        """
        self._load = load
        load.start(self)
        self._load_next = load.next_time()

    def submit(
        self,
        *,
        prompt_tokens: int | None = None,
        output_tokens: int | None = None,
        cls: str | RequestClass | None = None,
        arrival: float | None = None,
        on_finish: Callable[[Request], None] | None = None,
        load: Load | None = None,
    ) -> Request:
        """Queue a request; lengths and class not given are drawn from the workload.

        ``on_finish`` is called (inside :meth:`run_until`) when its last token is emitted.
        """
        t = self.now if arrival is None else arrival
        rng = self._req_rng
        if cls is None:
            rc = self.workload.sample_class(rng, t)
        elif isinstance(cls, str):
            if cls not in CLASSES:
                raise ValueError(f"unknown request class {cls!r} (known: {', '.join(CLASSES)})")
            rc = CLASSES[cls]
        else:
            rc = cls
        mean, delta = rc.alpha_delta(self.profile.acceptance)
        a, b = self.workload.beta_params(mean)
        alpha = float(rng.beta(a, b))
        # Draw lengths even when given, so the stream stays aligned across callers.
        p = rc.prompt.sample(rng)
        o = rc.output.sample(rng)
        req = Request(
            self._next_rid,
            rc.name,
            alpha,
            delta,
            int(prompt_tokens) if prompt_tokens is not None else int(p),
            max(int(output_tokens) if output_tokens is not None else int(o), 1),
            t,
            load,
            on_finish,
        )
        req.shape = rc.shape
        self._next_rid += 1
        self.counters.requests_submitted += 1
        self._waiting.append(req)
        return req

    # --- state ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def padded(self, b: int) -> int:
        """The CUDA-graph batch size a decode of ``b`` requests runs at."""
        return self._costs.padded(b)

    def request_stats(self, since: float = 0.0, until: float | None = None) -> RequestStats:
        """Stats of requests that finished in ``[since, until)`` (virtual seconds)."""
        return self._log.stats(since, self.now if until is None else until)

    # --- the loop ---------------------------------------------------------------------------

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + seconds)

    def run_until(self, t: float) -> None:
        """Run every forward that launches before virtual time ``t``.

        The last forward may end after ``t`` (``now`` then lies past ``t`` by less than one
        step); when idle, ``now`` becomes ``t``.
        """
        load = self._load
        running = self._running
        waiting = self._waiting
        cap = self.max_running
        while True:
            if self._load_next <= self.now:
                load.fire(self)
                self._load_next = load.next_time()
                continue
            if self.now >= t:
                return
            if waiting and len(running) < cap:
                self._prefill()
            elif running:
                self._decode()
            else:
                self._flush()
                # SGLang marks the next launch after an idle pass (batch.after_idle_gap): the
                # pending step's launch-to-launch gap would include the idle time.
                self._idled = True
                # Idle until the next arrival (or t).
                self.now = max(self.now, min(self._load_next, t))

    def _flush(self) -> None:
        # The overlap scheduler processes step N after launching N+1, or in the next loop
        # iteration when nothing else launches.
        p = self._pending
        if p is not None:
            self._pending = None
            n, k, emitted, accepted, launch, fi, idled, full, rejected = p
            # As the plugin's decode hook: the verify result feeds the batch's acceptance
            # estimate, and the step counts in the band that returns.
            band = self.core.acceptance.observe_totals(k, n, accepted, full)
            self.core.record_decode(n, k, emitted, accepted, launch, fi, idled, band=band,
                                    first_rejected=rejected if band else 0)

    def _prefill(self) -> None:
        running, waiting = self._running, self._waiting
        room = self.max_running - len(running)
        admit: list[Request] = []
        tokens = 0
        while waiting and len(admit) < room:
            r = waiting[0]
            if admit and tokens + r.prompt_tokens > self.prefill_token_budget:
                break
            waiting.popleft()
            admit.append(r)
            tokens += r.prompt_tokens
        launch = self.now
        fi = self._forward_iter
        self._forward_iter = fi + 1
        self._flush()
        # The prefill's launch ends the last decode step (its duration is known now).
        self.core.record_forward(launch, fi, self._idled)
        self._idled = False
        self.now = launch + self.profile.prefill_s(tokens, len(admit))
        c = self.counters
        c.prefill_steps += 1
        c.prefill_tokens += tokens
        n0 = len(running)
        some_done = self._rows.admit(n0, admit)
        for r in admit:
            r.admitted_at = launch
            r.first_token_at = self.now
        running.extend(admit)
        c.generation_tokens += len(admit)
        if some_done:
            self._finish(self._rows.done(len(running)))

    def _decode(self) -> None:
        n = len(self._running)
        pb = self._pad[n]
        k = self.core.steps_for_batch(pb)
        band = self.core.acceptance.band  # the band the arm was looked up in
        dt = self._costs.step_s(n, pb, k)
        launch = self.now
        fi = self._forward_iter
        self._forward_iter = fi + 1
        self._flush()
        rows = self._rows
        self.step_oracle.step(rows, n, pb, k, dt, band)
        full: float | None = 0
        rejected = 0
        if k > 0:
            # Per-request accepted drafts as plain ints (cheaper than numpy calls at the
            # usual batch sizes), as the plugin's hook gets SGLang's list.
            acc = rows.draft_step(n, k).tolist()
            accepted = sum(acc)
            # Requests that accepted every draft, as the plugin's decode hook counts them
            # (tuner.plugin._sglang.decode_step_fn): exactly up to FULL_SAMPLE requests,
            # above that left to the estimate (None).
            full = acc.count(k) if n <= FULL_SAMPLE else None
            # ... and those that accepted none, where the band counters keep them (k >= 2; the
            # band is known when the step is folded in).
            rejected = acc.count(0) if n <= FULL_SAMPLE and k > 1 else 0
            # ... and, on the forwards the hook samples, how many drafts each accepted.
            self.core.record_depths(k, acc, fi)
        else:
            accepted = 0
            rows.plain_step(n, self.skip_zero_draft_extend)
        emitted = accepted + n
        self.now = launch + dt
        self._pending = (n, k, emitted, accepted, launch, fi, self._idled, full, rejected)
        self._idled = False
        c = self.counters
        window = c.count_decode(n, launch, fi, emitted, accepted, pb <= self._costs.graph_max)
        if window >= self.decode_log_interval:
            # SGLang's accept rate divides by the static draft width (the largest arm).
            c.refresh_gauges(self.now, n, k, len(self._waiting), max(self.arms))
        done = rows.done(n)
        if done.size:
            self._finish(done)

    def _finish(self, idx: np.ndarray) -> None:
        running = self._running
        n = len(running)
        keep = np.ones(n, dtype=bool)
        keep[idx] = False
        done = [running[i] for i in idx.tolist()]
        running[:] = [r for r, kp in zip(running, keep.tolist(), strict=True) if kp]
        self._rows.compact(keep, n)
        self.counters.requests_finished += len(done)
        self._log.finished(done, self.now)
        for r in done:
            if r.on_finish is not None:
                r.on_finish(r)
            # A load that was replaced stops: its requests finish without follow-ups.
            if r.load is not None and r.load is self._load:
                r.load.on_finish(self, r)
        # A load may have submitted on finish; its next action time may have moved.
        self._load_next = self._load.next_time()

    # --- readouts ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Scalars for status lines and the HTTP server."""
        c = self.counters
        return {
            "now": self.now,
            "num_running_reqs": self.num_running,
            "num_waiting_reqs": self.num_waiting,
            "decode_steps": c.decode_steps,
            "decode_tokens": c.decode_tokens,
            "requests_finished": c.requests_finished,
            "avg_spec_accept_length": c.avg_spec_accept_length,
        }

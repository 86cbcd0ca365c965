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
  and the oracle — are unchanged while the telemetry is noisy.
- **k = 0.** By default SGLang still runs the draft extend (a cost, acceptance unharmed).
  With ``skip_zero_draft_extend`` (``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``) the extend is
  skipped and every request that decoded at ``k = 0`` drafts from stale state afterwards: its
  α is multiplied by ``cold_factor`` until it finishes (anchors §3.5 (c)).
- **Telemetry** goes through ``core.record_decode`` exactly as the plugin's hook does: with the
  overlap scheduler, step N's result is processed after step N+1 launched, and it is recorded
  with the arm N was *launched* with, its launch time and its forward counter.

Time is virtual (seconds from 0). Nothing here reads a clock or sleeps; the HTTP server maps
it to real time.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tuner.plugin.core import PluginCore
from tuner.sim.acceptance import AcceptanceShape, ShapedRows
from tuner.sim.graphs import cuda_graph_bs, pad_batch_size
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


class Request:
    """One request's life. ``on_finish(request)`` is called when its last token is out."""

    __slots__ = (
        "rid",
        "cls",
        "alpha",
        "prompt_tokens",
        "output_tokens",
        "arrival",
        "admitted_at",
        "first_token_at",
        "finished_at",
        "load",
        "on_finish",
        "delta",
        "shape",
    )

    def __init__(
        self,
        rid: int,
        cls: str,
        alpha: float,
        delta: float,
        prompt_tokens: int,
        output_tokens: int,
        arrival: float,
        load: Load | None,
        on_finish: Callable[[Request], None] | None,
    ) -> None:
        self.rid = rid
        self.cls = cls
        self.alpha = alpha
        self.delta = delta
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.arrival = arrival
        self.admitted_at = math.nan
        self.first_token_at = math.nan
        self.finished_at = math.nan
        self.load = load
        self.on_finish = on_finish
        self.shape: AcceptanceShape | None = None

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (NaN for single-token requests)."""
        if self.output_tokens <= 1:
            return math.nan
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)

    def __repr__(self) -> str:
        return f"<Request {self.rid} {self.cls} out={self.output_tokens}>"


@dataclass(frozen=True)
class RequestStats:
    """Summary of the requests that finished in a time window (seconds are virtual)."""

    finished: int
    output_tokens: int
    window_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    tpot_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float

    @property
    def output_throughput(self) -> float:
        """Output tokens per second over the window."""
        return self.output_tokens / self.window_s if self.window_s > 0 else 0.0


class EngineCounters:
    """Cumulative server-level counters (what SGLang's ``/metrics`` and ``/v1/loads`` show)."""

    __slots__ = (
        "decode_steps",
        "decode_tokens",
        "prefill_steps",
        "prefill_tokens",
        "accepted_drafts",
        "request_steps",
        "requests_submitted",
        "requests_finished",
        "generation_tokens",
        "graph_passes",
        "eager_passes",
        "moments",
        "gauges",
        "_win_steps",
        "_win_tokens",
        "_win_start",
        "_win_req_steps",
        "_win_accepted",
    )

    def __init__(self) -> None:
        self.decode_steps = 0
        self.decode_tokens = 0
        self.prefill_steps = 0
        self.prefill_tokens = 0
        self.accepted_drafts = 0
        self.request_steps = 0  # sum of batch sizes over decode steps (SGLang's verify count)
        self.requests_submitted = 0
        self.requests_finished = 0
        self.generation_tokens = 0
        self.graph_passes = 0
        self.eager_passes = 0
        # /v1/loads decode_moments over contiguous decode launches:
        # [n, Σbs, Σstep_us, Σbs², Σbs·step_us, Σgenerated]
        self.moments = [0, 0, 0.0, 0, 0.0, 0]
        # Gauges refreshed every decode-log interval, as SGLang's metrics collector does.
        self.gauges: dict[str, float] = {
            "gen_throughput": 0.0,
            "num_running_reqs": 0.0,
            "num_queue_reqs": 0.0,
            "spec_accept_length": 0.0,
            "spec_accept_rate": 0.0,
            "spec_num_steps": 0.0,
        }
        self._win_steps = 0
        self._win_tokens = 0
        self._win_start = 0.0
        self._win_req_steps = 0
        self._win_accepted = 0

    @property
    def avg_spec_accept_length(self) -> float:
        """Lifetime tokens per request-verify, bonus included (SGLang's readout)."""
        return self.decode_tokens / self.request_steps if self.request_steps else 0.0


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

    Raises:
        ProfileRangeError: the profile cannot cost a batch the engine may run.
    """

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
        self._graph_max = self.graph_bs[-1] if self.graph_bs else 0
        # Padded size and step cost for every batch size and arm, computed once: this both
        # speeds the hot loop and refuses, up front, a profile that cannot cost the cap.
        self._pad = [0] + [
            pad_batch_size(b, self.graph_bs) for b in range(1, self.max_running + 1)
        ]
        self._cost: dict[tuple[int, int], float] = {}
        for pb in set(self._pad[1:]):
            for k in self.arms:
                self._cost[(pb, k)] = self.profile.step_s(
                    pb, k, skip_zero_draft_extend=self.skip_zero_draft_extend
                )
        # A tree server's non-zero arm is its tree (tuner.sim.tree): its own cost, and its
        # acceptance lifted from the chain rows in _accept.
        self._tree = TreeArm(core.tree) if core.tree is not None else None
        if self._tree is not None:
            for pb in set(self._pad[1:]):
                self._cost[(pb, self._tree.steps)] = self._tree.step_s(self.profile, pb)
        self._kmax = max(max(self.arms), 1)
        self._delta_pow: dict[str, np.ndarray] = {}

        ss = np.random.SeedSequence(seed)
        # A third stream for noise: the first two stay what they were without it.
        req_ss, acc_ss, noise_ss = ss.spawn(3)
        self._req_rng = np.random.default_rng(req_ss)
        self._acc_rng = np.random.default_rng(acc_ss)
        self.step_noise = float(step_noise)
        self._noise_rng = np.random.default_rng(noise_ss)

        self.now = 0.0
        self.counters = EngineCounters()
        self._forward_iter = 0
        self._idled = False
        self._next_rid = 0
        self._waiting: deque[Request] = deque()
        # Running requests: a Python list aligned with fixed-capacity numpy columns.
        cap_n = self.max_running
        self._running: list[Request] = []
        self._rem = np.zeros(cap_n, dtype=np.int64)  # tokens still to emit
        self._surv = np.zeros((cap_n, self._kmax), dtype=np.float64)  # P(A >= i) per request
        self._cold = np.zeros((cap_n, self._kmax), dtype=np.float64)  # same, stale draft state
        self._stale = np.zeros(cap_n, dtype=bool)
        self._shaped = ShapedRows(cap_n, self._kmax, self.cold_factor)
        self._pending: tuple[int, int, int, int, float, int, bool] | None = None
        self._last_decode: tuple[int, float, int, int] | None = None  # (b, launch, iter, gen)
        self._log: dict[str, list[float]] = {
            "finished_at": [],
            "tpot": [],
            "ttft": [],
            "e2e": [],
            "tokens": [],
        }
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
        return self._pad[b] if b < len(self._pad) else pad_batch_size(b, self.graph_bs)

    def request_stats(self, since: float = 0.0, until: float | None = None) -> RequestStats:
        """Stats of requests that finished in ``[since, until)`` (virtual seconds)."""
        until = self.now if until is None else until
        fin = np.asarray(self._log["finished_at"])
        sel = (fin >= since) & (fin < until) if fin.size else np.zeros(0, dtype=bool)
        tpot = np.asarray(self._log["tpot"])[sel] if fin.size else np.zeros(0)
        tpot = tpot[np.isfinite(tpot)]
        ttft = np.asarray(self._log["ttft"])[sel] if fin.size else np.zeros(0)
        e2e = np.asarray(self._log["e2e"])[sel] if fin.size else np.zeros(0)
        toks = int(np.asarray(self._log["tokens"])[sel].sum()) if fin.size else 0

        def pct(x: np.ndarray, q: float) -> float:
            return float(np.percentile(x, q)) if x.size else math.nan

        return RequestStats(
            finished=int(sel.sum()),
            output_tokens=toks,
            window_s=max(until - since, 0.0),
            tpot_p50_s=pct(tpot, 50),
            tpot_p99_s=pct(tpot, 99),
            tpot_mean_s=float(tpot.mean()) if tpot.size else math.nan,
            ttft_p50_s=pct(ttft, 50),
            ttft_p99_s=pct(ttft, 99),
            e2e_p50_s=pct(e2e, 50),
        )

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
            self.core.record_decode(*p)

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
        alphas = np.array([r.alpha for r in admit])
        deltas = np.array([r.delta for r in admit])
        i = np.arange(1, self._kmax + 1, dtype=np.float64)
        dpow = deltas[:, None] ** (i * (i - 1) / 2)[None, :]
        m = len(admit)
        self._surv[n0 : n0 + m] = alphas[:, None] ** i[None, :] * dpow
        self._cold[n0 : n0 + m] = (alphas[:, None] * self.cold_factor) ** i[None, :] * dpow
        self._stale[n0 : n0 + m] = False
        self._shaped.admit(n0, admit, self._surv, self._cold)
        self._rem[n0 : n0 + m] = [r.output_tokens - 1 for r in admit]
        for r in admit:
            r.admitted_at = launch
            r.first_token_at = self.now
        running.extend(admit)
        c.generation_tokens += m
        if (self._rem[n0 : n0 + m] <= 0).any():
            self._finish(np.flatnonzero(self._rem[: len(running)] <= 0))

    def _decode(self) -> None:
        running = self._running
        n = len(running)
        pb = self._pad[n]
        k = self.core.steps_for_batch(pb)
        dt = self._cost.get((pb, k))
        if dt is None:  # an arm outside the built set cannot come from a validated table
            raise RuntimeError(
                f"table gave arm {k} not among built arms {self.arms} (b={n}, padded {pb})"
            )
        launch = self.now
        fi = self._forward_iter
        self._forward_iter = fi + 1
        c = self.counters
        prev = self._last_decode
        if prev is not None and prev[2] + 1 == fi:
            gap_us = (launch - prev[1]) * 1e6
            mo = c.moments
            pbn = prev[0]
            mo[0] += 1
            mo[1] += pbn
            mo[2] += gap_us
            mo[3] += pbn * pbn
            mo[4] += pbn * gap_us
            mo[5] += prev[3]
        if self.step_noise:
            z = self._noise_rng.standard_normal()
            dt *= math.exp(self.step_noise * z - self.step_noise**2 / 2)
        self._flush()
        rem = self._rem[:n]
        if k > 0:
            if self._shaped.drifting:
                self._shaped.refresh(n, self._rem, self._surv, self._cold, self._stale)
            acc = self._accept(n, k)
            accepted = int(acc.sum())
            emitted = accepted + n
            rem -= acc
            rem -= 1
        else:
            accepted = 0
            emitted = n
            rem -= 1
            if self.skip_zero_draft_extend:
                stale = self._stale[:n]
                if not stale.all():
                    fresh = ~stale
                    self._surv[:n][fresh] = self._cold[:n][fresh]
                    stale[:] = True
        self.now = launch + dt
        self._pending = (n, k, emitted, accepted, launch, fi, self._idled)
        self._idled = False
        self._last_decode = (n, launch, fi, emitted)
        c.decode_steps += 1
        c.decode_tokens += emitted
        c.accepted_drafts += accepted
        c.request_steps += n
        c.generation_tokens += emitted
        if pb <= self._graph_max:
            c.graph_passes += 1
        else:
            c.eager_passes += 1
        c._win_steps += 1
        c._win_tokens += emitted
        c._win_req_steps += n
        c._win_accepted += accepted
        if c._win_steps >= self.decode_log_interval:
            self._log_tick(n, k)
        done = rem <= 0
        if done.any():
            self._finish(np.flatnonzero(done))

    def _accept(self, n: int, k: int) -> np.ndarray:
        """Accepted drafts of each running request in one step at arm ``k``.

        One uniform per request against its survival row ``P(A >= i)``: the count of
        positions it clears is a draw of the chain's accepted length.
        """
        u = self._acc_rng.random(n)
        surv = self._surv[:n, :k]
        if self._tree is not None and k == self._tree.steps:
            surv = self._tree.lift_survival(surv)
        return (u[:, None] < surv).sum(axis=1)

    def _log_tick(self, n: int, k: int) -> None:
        c = self.counters
        span = self.now - c._win_start
        g = c.gauges
        g["gen_throughput"] = c._win_tokens / span if span > 0 else 0.0
        g["num_running_reqs"] = float(n)
        g["num_queue_reqs"] = float(len(self._waiting))
        g["spec_accept_length"] = c._win_tokens / c._win_req_steps if c._win_req_steps else 0.0
        # SGLang divides by the static draft width, which is wrong under adaptive; mirror it.
        static = max(self.arms)
        g["spec_accept_rate"] = (
            c._win_accepted / (c._win_req_steps * static) if c._win_req_steps and static else 0.0
        )
        g["spec_num_steps"] = float(k)
        c._win_steps = c._win_tokens = c._win_req_steps = c._win_accepted = 0
        c._win_start = self.now

    def _finish(self, idx: np.ndarray) -> None:
        running = self._running
        n = len(running)
        keep = np.ones(n, dtype=bool)
        keep[idx] = False
        m = int(keep.sum())
        done = [running[i] for i in idx.tolist()]
        running[:] = [r for r, kp in zip(running, keep.tolist(), strict=True) if kp]
        self._rem[:m] = self._rem[:n][keep]
        self._surv[:m] = self._surv[:n][keep]
        self._cold[:m] = self._cold[:n][keep]
        self._stale[:m] = self._stale[:n][keep]
        self._shaped.compact(keep, n)
        c = self.counters
        log = self._log
        now = self.now
        for r in done:
            r.finished_at = now
            c.requests_finished += 1
            log["finished_at"].append(now)
            log["tpot"].append(r.tpot_s)
            log["ttft"].append(r.first_token_at - r.arrival)
            log["e2e"].append(now - r.arrival)
            log["tokens"].append(r.output_tokens)
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

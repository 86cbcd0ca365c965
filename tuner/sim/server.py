"""The simulator's HTTP server: the endpoints the daemon and load tools use, shaped as
SGLang 0.5.23 shapes them (``shared/sglang-integration.md`` §4-6).

- ``GET /health`` — 200 with an empty body.
- ``GET /server_info`` (alias ``/get_server_info``) — flat server args as SGLang names them
  plus ``internal_states``: one dict per DP replica holding ``"dynspec": core.readout()``.
- ``POST|PUT /set_internal_state`` — ``{"server_args": {key: number}}``; a nested object, a
  non-numeric value or a body that is not JSON answers 400 with SGLang's error object (its
  request validation); otherwise the reply is a JSON
  list with one boolean per DP replica, from ``core.apply_update`` (atomic, never raises).
- ``GET /metrics`` — Prometheus text with SGLang's metric names.
- ``GET /v1/loads`` — per-replica load snapshot.
- ``POST /generate`` and ``POST /v1/completions`` — synthetic tokens; the reply arrives when
  the engine has emitted the last token, in (scaled) real time.

A driver thread maps real time to virtual time (``speed`` virtual seconds per real second) and
advances the engine; handlers touch the engine under one lock. Every request goes through
:meth:`SimServer.dispatch`, and ``interceptors`` (``fn(request, call_next) -> HttpResponse``)
wrap it; the first is :attr:`SimServer.faults` (``tuner/sim/faults.py``: refuse, stall, 5xx,
malformed bodies, rejected updates, restarts; admin endpoint ``/_sim/faults``).

This module holds the server's state and lifecycle (engine, lock, virtual clock, routing);
the handlers live in private modules beside it: ``_sglang_api`` (info, admin, metrics and
loads), ``_generation`` (generate and completions), ``_prometheus`` (the metrics text) and
``_http`` (request and response values, the socket handler).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from tuner.plugin.core import PluginCore
from tuner.sim._generation import DEFAULT_MAX_NEW_TOKENS, GenerationEndpoints
from tuner.sim._http import HttpRequest, HttpResponse, Interceptor, Listener, make_handler
from tuner.sim._sglang_api import (
    SGLANG_SETTABLE,
    SGLANG_VERSION,
    SGLangEndpoints,
    sglang_start_arm,
)
from tuner.sim.engine import DEFAULT_ARMS, Engine
from tuner.sim.load import Load, NoLoad, parse_load
from tuner.sim.profiles import CostProfile, load_profile
from tuner.sim.workloads import Workload, get_workload

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_PORT",
    "DEFAULT_SIM_LOAD",
    "SGLANG_VERSION",
    "HttpRequest",
    "HttpResponse",
    "SimServer",
    "sglang_start_arm",
]

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000  # SGLang's default port
# The CLI's built-in traffic: a minute at each concurrency, round and round, so every batch
# size bucket sees steps.
DEFAULT_SIM_LOAD = "loop:60:1,60:4,60:16,60:64,60:256"
# Longest stretch of virtual time advanced under the lock at once, and the driver's longest
# sleep; both bound how late a reply or a table update can be.
_MAX_CHUNK_REAL_S = 0.02
_MAX_SLEEP_S = 0.05
_MIN_SLEEP_S = 0.001


class SimServer(SGLangEndpoints, GenerationEndpoints):
    """An in-process simulated SGLang server on loopback.

    Either pass a ready ``engine`` or the pieces to build one. Use as a context manager or call
    :meth:`start` / :meth:`stop`.

    Args:
        engine: an :class:`Engine` to serve (its load keeps running).
        profile, workload, arms, max_running, skip_zero_draft_extend, seed: build an engine.
        load: built-in traffic: a :class:`Load` or schedule text (``"60:4,60:64"``...).
        speed: virtual seconds per real second (1 = real time).
        host, port: where to listen (port 0 = a free port).
        dp_size: replicas reported in ``internal_states`` (all share one engine).
        model_name: reported as ``model_path`` / ``served_model_name``.
        admin_api_key: as SGLang's ``--admin-api-key``: table updates need it (401 otherwise).
        clock: monotonic clock (injected for tests), wall: wall clock for ``started_at``.
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        profile: CostProfile | str = "h200-llama8b",
        workload: Workload | str = "chat",
        load: Load | str | None = None,
        arms: Iterable[int] = DEFAULT_ARMS,
        max_running: int | None = None,
        skip_zero_draft_extend: bool = False,
        seed: int = 0,
        speed: float = 1.0,
        host: str = DEFAULT_HOST,
        port: int = 0,
        dp_size: int = 1,
        model_name: str = "sim/llama-3.1-8b-instruct",
        admin_api_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not (speed > 0 and math.isfinite(speed)):
            raise ValueError(f"speed must be a positive number, got {speed}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self._clock = clock
        self._wall = wall
        self.speed = float(speed)
        self.host = host
        self._req_port = port
        self.dp_size = dp_size
        self.model_name = model_name
        self.admin_api_key = admin_api_key
        if isinstance(load, str):
            load = parse_load(load, seed=seed)
        self._engine_kw: dict[str, Any] = dict(
            profile=load_profile(profile) if isinstance(profile, str) else profile,
            workload=get_workload(workload) if isinstance(workload, str) else workload,
            arms=tuple(arms),
            max_running=max_running,
            skip_zero_draft_extend=skip_zero_draft_extend,
            seed=seed,
        )
        if engine is None:
            engine = self._new_engine(load)
        elif load is not None:
            engine.attach_load(load)
        self.engine = engine
        self.lock = threading.RLock()
        from tuner.sim.faults import FaultInjector  # lazy: faults.py imports this module

        # Fault injection for tests and drills (simulator only): first in line, and its admin
        # endpoint /_sim/faults is answered there.
        self.faults = FaultInjector(self)
        self.interceptors: list[Interceptor] = [self.faults.intercept]
        # Values of SGLang's own settable keys, as reported in /server_info.
        self.settable: dict[str, Any] = dict(SGLANG_SETTABLE)
        self._routes: dict[tuple[str, str], Callable[[HttpRequest], HttpResponse]] = {
            ("GET", "/health"): self._health,
            ("GET", "/health_generate"): self._health,
            ("GET", "/ready"): self._health,
            ("GET", "/server_info"): self._server_info,
            ("GET", "/get_server_info"): self._server_info,
            ("GET", "/model_info"): self._model_info,
            ("GET", "/get_model_info"): self._model_info,
            ("POST", "/set_internal_state"): self._set_internal_state,
            ("PUT", "/set_internal_state"): self._set_internal_state,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/loads"): self._loads,
            ("POST", "/generate"): self._generate,
            ("POST", "/v1/completions"): self._completions,
        }
        self._httpd: Listener | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._anchor_real = 0.0
        self._anchor_virtual = 0.0

    def _new_engine(self, load: Load | None) -> Engine:
        kw = self._engine_kw
        # A real server's plugin starts on SGLang's startup step (the speculative_num_steps
        # /server_info advertises), so installing it changes nothing until a table arrives.
        core = PluginCore(kw["arms"], started_at=self._wall(),
                          default_arm=sglang_start_arm(kw["arms"]))
        return Engine(
            profile=kw["profile"],
            workload=kw["workload"],
            core=core,
            max_running=kw["max_running"],
            skip_zero_draft_extend=kw["skip_zero_draft_extend"],
            seed=kw["seed"],
            load=load,
        )

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server not started")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def core(self) -> PluginCore:
        return self.engine.core

    def start(self) -> SimServer:
        """Bind, then serve and drive the engine on background threads."""
        if self._httpd is not None:
            return self
        handler = make_handler(self)
        self._httpd = Listener((self.host, self._req_port), handler)
        self._httpd.daemon_threads = True
        self._stop.clear()
        self._anchor_real = self._clock()
        self._anchor_virtual = self.engine.now
        t_http = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="sim-http",
            daemon=True,
        )
        t_drive = threading.Thread(target=self._drive, name="sim-engine", daemon=True)
        self._threads = [t_http, t_drive]
        for t in self._threads:
            t.start()
        if self._clock is time.monotonic:
            log.info("simulated SGLang server on %s (speed x%g)", self.url, self.speed)
        else:  # run --simulate: the tuner's waits move this clock, which paces the speed
            log.info("simulated SGLang server on %s (on the caller's clock)", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and driving; waiting /generate calls get 503."""
        self._stop.set()
        self.faults.release_stalled()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        self._httpd = None

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart(self) -> None:
        """Replace the engine by a fresh one (new ``started_at``, counters from zero, default
        table), as a server restart does. The built-in load starts over."""
        with self.lock:
            old = self.engine
            load = old._load  # the same schedule object restarts on attach
            self.engine = self._new_engine(None if isinstance(load, NoLoad) else load)
            self._anchor_real = self._clock()
            self._anchor_virtual = 0.0

    def virtual_now(self) -> float:
        """Virtual time that corresponds to the real clock now."""
        return self._anchor_virtual + (self._clock() - self._anchor_real) * self.speed

    def _drive(self) -> None:
        chunk = _MAX_CHUNK_REAL_S * self.speed
        while not self._stop.is_set():
            with self.lock:
                eng = self.engine
                target = self.virtual_now()
                eng.run_until(min(target, eng.now + chunk))
                ahead = eng.now - self.virtual_now()
            if ahead > 0:
                self._stop.wait(min(ahead / self.speed, _MAX_SLEEP_S))
            elif eng.now < target - chunk:
                continue  # behind real time: catch up without sleeping
            else:
                self._stop.wait(_MIN_SLEEP_S)

    # --- dispatch (one place, so faults can be injected around it) -------------------------

    def dispatch(self, req: HttpRequest) -> HttpResponse:
        """Answer one HTTP request, through the interceptors."""

        def call(i: int, r: HttpRequest) -> HttpResponse:
            if i < len(self.interceptors):
                return self.interceptors[i](r, lambda rr: call(i + 1, rr))
            return self._route(r)

        return call(0, req)

    def _route(self, req: HttpRequest) -> HttpResponse:
        handler = self._routes.get((req.method, req.path))
        if handler is None:
            if any(p == req.path for _, p in self._routes):
                return HttpResponse.json({"detail": "Method Not Allowed"}, 405)
            return HttpResponse.json({"detail": "Not Found"}, 404)
        try:
            return handler(req)
        except Exception as exc:  # a handler bug must not take the server thread down
            log.exception("sim server: %s %s failed", req.method, req.path)
            return HttpResponse.error(500, f"internal error: {type(exc).__name__}: {exc}")

    # --- server state SGLang reports (the handlers live in the mixins) ---------------------

    def server_args(self) -> dict[str, Any]:
        """The flat server args, named as SGLang names them."""
        eng = self.engine
        steps = sglang_start_arm(eng.arms)
        return {
            "model_path": self.model_name,
            "served_model_name": self.model_name,
            "tokenizer_path": self.model_name,
            "host": self.host,
            "port": self.port if self._httpd is not None else self._req_port,
            "tp_size": 1,
            "dp_size": self.dp_size,
            "pp_size": 1,
            "max_running_requests": eng.max_running,
            "chunked_prefill_size": eng.prefill_token_budget,
            "cuda_graph_max_bs_decode": eng.graph_bs[-1] if eng.graph_bs else None,
            "cuda_graph_bs_decode": list(eng.graph_bs),
            "disable_overlap_schedule": False,
            "enable_metrics": True,
            "decode_log_interval": eng.decode_log_interval,
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": self.model_name + "-eagle3",
            "speculative_num_steps": steps,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": steps + 1,
            "speculative_adaptive": True,
            "speculative_adaptive_config": None,
            **self.settable,
            "sim_profile": eng.profile.name,
            "sim_workload": eng.workload.name,
            "sim_speed": self.speed,
            "sim_skip_zero_draft_extend": eng.skip_zero_draft_extend,
        }

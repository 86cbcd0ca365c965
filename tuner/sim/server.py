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
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tuner import __version__
from tuner.plugin.core import PluginCore
from tuner.sim.engine import DEFAULT_ARMS, Engine, Request
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
SGLANG_VERSION = "0.5.23"
# SGLang's default max_new_tokens when a request does not say.
DEFAULT_MAX_NEW_TOKENS = 128
# Longest stretch of virtual time advanced under the lock at once, and the driver's longest
# sleep; both bound how late a reply or a table update can be.
_MAX_CHUNK_REAL_S = 0.02
_MAX_SLEEP_S = 0.05
_MIN_SLEEP_S = 0.001
_GENERATE_TIMEOUT_S = 3600.0
# Limits that keep a hostile or mistaken request from tying the server up.
MAX_NEW_TOKENS = 131072
MAX_BATCH_PROMPTS = 1024
MAX_BODY_BYTES = 16 * 2**20


@dataclass
class HttpRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes


@dataclass
class HttpResponse:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> HttpResponse:
        return cls(status, json.dumps(obj).encode())

    @classmethod
    def error(cls, status: int, message: str) -> HttpResponse:
        return cls.json({"object": "error", "message": message, "code": status}, status)


Interceptor = Callable[[HttpRequest, Callable[[HttpRequest], HttpResponse]], HttpResponse]


class SimServer:
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
        self._httpd: ThreadingHTTPServer | None = None
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
        handler = _make_handler(self)
        self._httpd = _Listener((self.host, self._req_port), handler)
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

    # --- endpoints --------------------------------------------------------------------------

    def _health(self, req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"", "text/plain")

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

    def _internal_state(self) -> dict[str, Any]:
        eng = self.engine
        c = eng.counters
        state = {
            # SGLang 0.5.23: the start-up phases' durations in seconds, not a timestamp.
            "startup_time": {"load_weight": 0.0, "kv_cache_allocation": 0.0,
                             "scheduler_e2e": 0.0, "cuda_graph": {}},
            "effective_max_running_requests_per_dp": eng.max_running,
            "last_gen_throughput": c.gauges["gen_throughput"],
            "memory_usage": {"weight": 0.0, "kvcache": 0.0, "graph": 0.0},
            "dynspec": eng.core.readout(),
        }
        if c.request_steps:  # SGLang leaves it out until its accept counters have a value
            state["avg_spec_accept_length"] = c.avg_spec_accept_length
        return state

    def _server_info(self, req: HttpRequest) -> HttpResponse:
        with self.lock:
            out = self.server_args()
            out["launch_command"] = "dynspec-tuner sim"
            out["version"] = SGLANG_VERSION
            out["internal_states"] = [self._internal_state() for _ in range(self.dp_size)]
        return HttpResponse.json(out)

    def _model_info(self, req: HttpRequest) -> HttpResponse:
        return HttpResponse.json(
            {
                "model_path": self.model_name,
                "tokenizer_path": self.model_name,
                "is_generation": True,
                "served_model_name": self.model_name,
                "architectures": ["LlamaForCausalLM"],
            }
        )

    def _set_internal_state(self, req: HttpRequest) -> HttpResponse:
        # SGLang's ADMIN_OPTIONAL auth: with an admin key set, only that key may update.
        if self.admin_api_key is not None and not hmac.compare_digest(
            req.headers.get("authorization", "").encode(), f"Bearer {self.admin_api_key}".encode()
        ):
            return HttpResponse.json({"error": "Unauthorized"}, 401)
        body = _json_body(req, sglang_400=True)
        if isinstance(body, HttpResponse):
            return body
        problem = _validate_set_internal_state(body)
        if problem is not None:
            return _bad_request(f"1 validation error: {problem}")
        args = body["server_args"]
        # Coerce as pydantic does (true -> 1, "3" -> 3) before the scheduler sees it.
        coerced = {k: _coerce_number(v) for k, v in args.items()}
        ours = {k: v for k, v in coerced.items() if k.startswith("dynspec_")}
        theirs = {k: v for k, v in coerced.items() if not k.startswith("dynspec_")}
        unknown = sorted(set(theirs) - set(SGLANG_SETTABLE))
        with self.lock:
            if unknown:
                # SGLang answers "Updating X is not supported." and applies nothing.
                ok = False
                log.info("set_internal_state: unsupported keys %s", ", ".join(unknown[:5]))
            else:
                ok = True
                if ours:
                    # The plugin's hook validates its keys first, atomically; on refusal the
                    # other keys are not applied either.
                    ok, reason = self.engine.core.apply_update(ours)
                    if not ok:
                        log.info("set_internal_state rejected: %s", reason)
                if ok:
                    self.settable.update(theirs)
        return HttpResponse.json([ok] * self.dp_size)

    def _metrics(self, req: HttpRequest) -> HttpResponse:
        with self.lock:
            text = _prometheus(self)
        return HttpResponse(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _loads(self, req: HttpRequest) -> HttpResponse:
        include = req.query.get("include", [None])[0]
        sections = {s.strip() for s in include.split(",")} if include else None
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if sections is not None and not sections <= valid:
            return HttpResponse.json(
                {
                    "detail": f"Invalid include sections: {sections - valid}. "
                    f"Valid options: {sorted(valid)}"
                },
                400,
            )
        with self.lock:
            eng = self.engine
            c = eng.counters
            loads = []
            for rank in range(self.dp_size):
                d: dict[str, Any] = {
                    "dp_rank": rank,
                    "num_running_reqs": eng.num_running,
                    "num_waiting_reqs": eng.num_waiting,
                    "num_used_tokens": 0,
                    "num_total_tokens": 0,
                    "max_total_num_tokens": 0,
                    "max_running_requests": eng.max_running,
                    "token_usage": 0.0,
                    "gen_throughput": c.gauges["gen_throughput"],
                    "cache_hit_rate": 0.0,
                    "utilization": eng.num_running / eng.max_running,
                    "decode_moments": list(c.moments),
                }
                if sections is None or "all" in sections or "spec" in sections:
                    d["speculative"] = {
                        "accept_length": c.avg_spec_accept_length,
                        "accept_rate": c.gauges["spec_accept_rate"],
                    }
                if sections is None or "all" in sections or "queues" in sections:
                    d["queues"] = {
                        "waiting": eng.num_waiting,
                        "grammar": 0,
                        "paused": 0,
                        "retracted": 0,
                    }
                loads.append(d)
        return HttpResponse.json(
            {
                "timestamp": datetime.now(timezone.utc).isoformat(),
                "version": SGLANG_VERSION,
                "accelerator": f"simulated ({self.engine.profile.name})",
                "num_accelerators": 1,
                "loads": loads,
            }
        )

    # --- generation -------------------------------------------------------------------------

    def submit_and_wait(
        self,
        *,
        prompt_tokens: Sequence[int],
        max_new_tokens: int,
        timeout_s: float = _GENERATE_TIMEOUT_S,
    ) -> list[Request] | None:
        """Queue requests together (one per prompt length) and block until the engine
        finished all of them; None when the server stops or ``timeout_s`` (real) passes."""
        pending = len(prompt_tokens)
        done = threading.Event()
        count = threading.Lock()

        def finished(_r: Request) -> None:
            nonlocal pending
            with count:
                pending -= 1
                if pending == 0:
                    done.set()

        with self.lock:
            reqs = [
                self.engine.submit(
                    prompt_tokens=max(p, 1),
                    output_tokens=max(max_new_tokens, 1),
                    on_finish=finished,
                )
                for p in prompt_tokens
            ]
        deadline = time.monotonic() + timeout_s
        while not done.wait(0.05):
            if self._stop.is_set() or time.monotonic() > deadline:
                return None
        return reqs

    def _max_new(self, value: Any, name: str) -> int | HttpResponse:
        try:
            n = int(value)
        except (TypeError, ValueError):
            return HttpResponse.json({"detail": f"{name} must be an integer"}, 422)
        if not 1 <= n <= MAX_NEW_TOKENS:
            return HttpResponse.error(400, f"{name} must be in 1..{MAX_NEW_TOKENS}, got {n}")
        return n

    def _generate(self, req: HttpRequest) -> HttpResponse:
        body = _json_body(req)
        if isinstance(body, HttpResponse):
            return body
        if not isinstance(body, dict):
            return HttpResponse.json({"detail": "body must be a JSON object"}, 422)
        prompts = body.get("text", body.get("input_ids"))
        # A list of prompts (strings, or lists of token ids) is a batch; one reply per prompt.
        batch = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], (str, list))
        items = prompts if batch else [prompts]
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            return HttpResponse.json({"detail": "sampling_params must be an object"}, 422)
        max_new = self._max_new(sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), "max_new_tokens")
        if isinstance(max_new, HttpResponse):
            return max_new
        if not items or len(items) > MAX_BATCH_PROMPTS:
            return HttpResponse.error(400, f"a batch holds 1..{MAX_BATCH_PROMPTS} prompts")
        reqs = self.submit_and_wait(
            prompt_tokens=[_prompt_tokens(item) for item in items], max_new_tokens=max_new
        )
        if reqs is None:
            return HttpResponse.error(503, "server is shutting down")
        outs = [
            {
                "text": _synthetic_text(r.output_tokens),
                "output_ids": [0] * r.output_tokens,
                "meta_info": _meta_info(r),
            }
            for r in reqs
        ]
        payload: Any = outs if batch else outs[0]
        if body.get("stream"):
            chunks = "".join(f"data: {json.dumps(o)}\n\n" for o in outs) + "data: [DONE]\n\n"
            return HttpResponse(200, chunks.encode(), "text/event-stream")
        return HttpResponse.json(payload)

    def _completions(self, req: HttpRequest) -> HttpResponse:
        body = _json_body(req)
        if isinstance(body, HttpResponse):
            return body
        if not isinstance(body, dict) or "prompt" not in body:
            return HttpResponse.json({"detail": "body must be an object with 'prompt'"}, 422)
        prompt = body["prompt"]
        max_new = self._max_new(body.get("max_tokens") or 16, "max_tokens")
        if isinstance(max_new, HttpResponse):
            return max_new
        reqs = self.submit_and_wait(prompt_tokens=[_prompt_tokens(prompt)], max_new_tokens=max_new)
        if reqs is None:
            return HttpResponse.error(503, "server is shutting down")
        (r,) = reqs
        return HttpResponse.json(
            {
                "id": f"cmpl-{r.rid}",
                "object": "text_completion",
                "created": int(self._wall()),
                "model": body.get("model") or self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": _synthetic_text(r.output_tokens),
                        "logprobs": None,
                        "finish_reason": "length",
                        "matched_stop": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.output_tokens,
                    "total_tokens": r.prompt_tokens + r.output_tokens,
                },
            }
        )


# Built-in keys SGLang 0.5.23's set_internal_state accepts (sglang-integration.md §4).
SGLANG_SETTABLE = {
    "pp_max_micro_batch_size": None,
    "speculative_accept_threshold_single": 1.0,
    "speculative_accept_threshold_acc": 1.0,
}


# --- helpers --------------------------------------------------------------------------------


def sglang_start_arm(arms: Iterable[int]) -> int:
    """The step SGLang starts on without --speculative-num-steps: the middle of the sorted
    candidate steps (``union[len // 2]``; sglang-integration.md, "Resolution")."""
    ordered = sorted(set(arms))
    return ordered[len(ordered) // 2]


def _bad_request(message: str) -> HttpResponse:
    """SGLang 0.5.23's answer to a body its request validation refuses."""
    return HttpResponse.json({"object": "error", "message": message, "type": "Bad Request",
                              "param": None, "code": 400}, 400)  # fmt: skip


def _json_body(req: HttpRequest, *, sglang_400: bool = False) -> Any:
    try:
        return json.loads(req.body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        if sglang_400:  # checked against SGLang 0.5.23 for /set_internal_state only
            return _bad_request(f"JSON decode error: {exc}")
        return HttpResponse.json(
            {
                "detail": [
                    {
                        "type": "json_invalid",
                        "loc": ["body", 0],
                        "msg": f"JSON decode error: {exc}",
                    }
                ]
            },
            422,
        )


def _coerce_number(v: Any) -> int | float:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    f = float(v)
    return int(f) if f.is_integer() and "." not in str(v) else f


def _validate_set_internal_state(body: Any) -> dict[str, Any] | None:
    """Pydantic's verdict on ``SetInternalStateReq(server_args: Dict[str, Union[int, float]])``,
    as an error item, or None when valid."""
    if not isinstance(body, dict):
        return {
            "type": "model_attributes_type",
            "loc": ["body"],
            "msg": "Input should be a valid dictionary",
        }
    if "server_args" not in body:
        return {"type": "missing", "loc": ["body", "server_args"], "msg": "Field required"}
    args = body["server_args"]
    if not isinstance(args, dict):
        return {
            "type": "dict_type",
            "loc": ["body", "server_args"],
            "msg": "Input should be a valid dictionary",
        }
    for k, v in args.items():
        loc = ["body", "server_args", k]
        if isinstance(v, bool) or (isinstance(v, (int, float)) and math.isfinite(v)):
            continue
        if isinstance(v, str):
            try:
                f = float(v)
                if math.isfinite(f):
                    continue
            except ValueError:
                pass
        return {
            "type": "float_type",
            "loc": [*loc, "float"],
            "msg": "Input should be a valid number",
            "input": v,
        }
    return None


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, list):
        return max(len(prompt), 1)
    if isinstance(prompt, str):
        # No tokenizer: about four characters per token, as for English BPE.
        return max(len(prompt) // 4, 1)
    return 1


def _synthetic_text(n: int) -> str:
    return " tok" * n


def _meta_info(r: Request) -> dict[str, Any]:
    return {
        "id": f"sim-{r.rid}",
        "finish_reason": {"type": "length", "length": r.output_tokens},
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.output_tokens,
        "cached_tokens": 0,
        "e2e_latency": r.finished_at - r.arrival,
        "request_class": r.cls,
    }


def _prometheus(server: SimServer) -> str:
    eng = server.engine
    c = eng.counters
    labels = (
        f'model_name="{server.model_name}",engine_type="unified",tp_rank="0",pp_rank="0",'
        'moe_ep_rank="0"'
    )
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for extra, value in samples:
            lab = labels + ("," + extra if extra else "")
            lines.append(f"{name}{{{lab}}} {float(value)!r}")

    g = c.gauges
    metric(
        "sglang:num_running_reqs",
        "gauge",
        "The number of running requests.",
        [("", g["num_running_reqs"])],
    )
    metric(
        "sglang:num_queue_reqs",
        "gauge",
        "The number of requests in the waiting queue.",
        [("", g["num_queue_reqs"])],
    )
    metric(
        "sglang:gen_throughput",
        "gauge",
        "The generation throughput (token/s).",
        [("", g["gen_throughput"])],
    )
    metric(
        "sglang:spec_accept_length",
        "gauge",
        "The average acceptance length of speculative decoding.",
        [("", g["spec_accept_length"])],
    )
    metric(
        "sglang:spec_accept_rate",
        "gauge",
        "The average acceptance rate of speculative decoding.",
        [("", g["spec_accept_rate"])],
    )
    metric(
        "sglang:spec_num_steps",
        "gauge",
        "The number of speculative steps.",
        [("", g["spec_num_steps"])],
    )
    metric(
        "sglang:spec_num_draft_tokens",
        "gauge",
        "The number of speculative draft tokens.",
        [("", g["spec_num_steps"] + 1)],
    )
    metric("sglang:token_usage", "gauge", "The token usage.", [("", 0.0)])
    metric(
        "sglang:realtime_tokens_total",
        "counter",
        "Total tokens processed, updated every scheduler iteration.",
        [('mode="prefill_compute"', c.prefill_tokens), ('mode="decode"', c.decode_tokens)],
    )
    metric(
        "sglang:cuda_graph_passes_total",
        "counter",
        "Forward passes by CUDA graph usage.",
        [('mode="decode_cuda_graph"', c.graph_passes), ('mode="decode_none"', c.eager_passes)],
    )
    metric(
        "sglang:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        [("", c.generation_tokens)],
    )
    metric(
        "sglang:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        [("", c.prefill_tokens)],
    )
    metric(
        "sglang:num_requests_total",
        "counter",
        "Number of requests processed.",
        [("", c.requests_finished)],
    )
    metric(
        "sglang:spec_verify_calls_total",
        "counter",
        "Number of speculative verify calls.",
        [("", c.request_steps)],
    )
    return "\n".join(lines) + "\n"


class _Listener(ThreadingHTTPServer):
    # The default backlog of 5 resets connections when a load generator opens a hundred at
    # once, as a real server's accept queue would not.
    request_queue_size = 2048


def _make_handler(server: SimServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes; with Nagle and delayed ACKs that costs
        # ~40 ms per request on loopback.
        disable_nagle_algorithm = True
        server_version = "sglang-sim/" + __version__

        def _handle(self) -> None:
            parts = urlsplit(self.path)
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self.send_error(413 if length > MAX_BODY_BYTES else 400, "bad Content-Length")
                return
            body = self.rfile.read(length) if length > 0 else b""
            req = HttpRequest(
                method=self.command,
                path=parts.path.rstrip("/") or "/",
                query=parse_qs(parts.query),
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
            )
            resp = server.dispatch(req)
            if resp is None:  # an interceptor dropped the connection
                self.close_connection = True
                return
            try:
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.content_type)
                self.send_header("Content-Length", str(len(resp.body)))
                for k, v in resp.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(resp.body)
            except (BrokenPipeError, ConnectionResetError):
                # The client gave up first (its timeout beat a slow or stalled reply).
                self.close_connection = True

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("sim http: " + format, *args)

    return Handler

"""The simulator's SGLang endpoints other than generation: health, ``/server_info``,
``/model_info``, ``/set_internal_state``, ``/metrics`` and ``/v1/loads``, shaped as SGLang
0.5.23 shapes them (``shared/sglang-integration.md`` §4-6).

:class:`SGLangEndpoints` is a mixin of :class:`~tuner.sim.server.SimServer`: its handlers read
the server's state (engine, lock, settings) and never change it except through
``/set_internal_state``.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from tuner.protocol import sglang_start_arm
from tuner.sim._http import HttpRequest, HttpResponse, bad_request, json_body
from tuner.sim._prometheus import prometheus_text
from tuner.sim.engine import Engine

__all__ = ["SGLANG_SETTABLE", "SGLANG_VERSION", "SGLangEndpoints", "sglang_start_arm"]

log = logging.getLogger("tuner.sim.server")

SGLANG_VERSION = "0.5.23"

# Built-in keys SGLang 0.5.23's set_internal_state accepts (sglang-integration.md §4).
SGLANG_SETTABLE = {
    "pp_max_micro_batch_size": None,
    "speculative_accept_threshold_single": 1.0,
    "speculative_accept_threshold_acc": 1.0,
}

class SGLangEndpoints:
    """Handlers for SGLang's informational and admin endpoints (a :class:`SimServer` mixin)."""

    # Provided by SimServer.
    engine: Engine
    lock: threading.RLock
    dp_size: int
    model_name: str
    admin_api_key: str | None
    settable: dict[str, Any]
    server_args: Callable[[], dict[str, Any]]

    def _health(self, req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, b"", "text/plain")

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
        }  # fmt: skip
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
        body = json_body(req, sglang_400=True)
        if isinstance(body, HttpResponse):
            return body
        problem = _validate_set_internal_state(body)
        if problem is not None:
            return bad_request(f"1 validation error: {problem}")
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
            text = prometheus_text(self.engine, self.model_name)
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

"""The simulator's generation endpoints, ``POST /generate`` and ``POST /v1/completions``:
synthetic tokens whose reply arrives when the engine has emitted the last one, in (scaled)
real time.

:class:`GenerationEndpoints` is a mixin of :class:`~tuner.sim.server.SimServer`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tuner.sim._http import HttpRequest, HttpResponse, json_body
from tuner.sim.engine import Engine, Request

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_BATCH_PROMPTS",
    "MAX_NEW_TOKENS",
    "GenerationEndpoints",
]

# SGLang's default max_new_tokens when a request does not say.
DEFAULT_MAX_NEW_TOKENS = 128
_GENERATE_TIMEOUT_S = 3600.0
# Limits that keep a hostile or mistaken request from tying the server up.
MAX_NEW_TOKENS = 131072
MAX_BATCH_PROMPTS = 1024


class GenerationEndpoints:
    """Handlers that queue requests on the engine and wait for them (a :class:`SimServer`
    mixin)."""

    # Provided by SimServer.
    engine: Engine
    lock: threading.RLock
    model_name: str
    _stop: threading.Event
    _wall: Callable[[], float]

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

    def _generate(self, req: HttpRequest) -> HttpResponse:
        body = json_body(req)
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
        max_new = _max_new(sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), "max_new_tokens")
        if isinstance(max_new, HttpResponse):
            return max_new
        if not items or len(items) > MAX_BATCH_PROMPTS:
            return HttpResponse.error(400, f"a batch holds 1..{MAX_BATCH_PROMPTS} prompts")
        reqs = self.submit_and_wait(
            prompt_tokens=[_prompt_tokens(item) for item in items], max_new_tokens=max_new
        )
        if reqs is None:
            return _shutting_down()
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
        body = json_body(req)
        if isinstance(body, HttpResponse):
            return body
        if not isinstance(body, dict) or "prompt" not in body:
            return HttpResponse.json({"detail": "body must be an object with 'prompt'"}, 422)
        prompt = body["prompt"]
        max_new = _max_new(body.get("max_tokens") or 16, "max_tokens")
        if isinstance(max_new, HttpResponse):
            return max_new
        reqs = self.submit_and_wait(prompt_tokens=[_prompt_tokens(prompt)], max_new_tokens=max_new)
        if reqs is None:
            return _shutting_down()
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


def _shutting_down() -> HttpResponse:
    return HttpResponse.error(503, "server is shutting down")


def _max_new(value: Any, name: str) -> int | HttpResponse:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return HttpResponse.json({"detail": f"{name} must be an integer"}, 422)
    if not 1 <= n <= MAX_NEW_TOKENS:
        return HttpResponse.error(400, f"{name} must be in 1..{MAX_NEW_TOKENS}, got {n}")
    return n


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

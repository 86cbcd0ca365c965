"""The simulator's HTTP plumbing: request and response values, the listener, the handler
that turns a socket request into an :class:`HttpRequest` for :meth:`SimServer.dispatch
<tuner.sim.server.SimServer.dispatch>`, and the error bodies SGLang's request validation
answers with."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from tuner import __version__

__all__ = [
    "MAX_BODY_BYTES",
    "HttpRequest",
    "HttpResponse",
    "Interceptor",
    "Listener",
    "bad_request",
    "json_body",
    "make_handler",
]

log = logging.getLogger("tuner.sim.server")

# Largest request body read; a longer Content-Length answers 413.
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


def bad_request(message: str) -> HttpResponse:
    """SGLang 0.5.23's answer to a body its request validation refuses."""
    return HttpResponse.json({"object": "error", "message": message, "type": "Bad Request",
                              "param": None, "code": 400}, 400)  # fmt: skip


def json_body(req: HttpRequest, *, sglang_400: bool = False) -> Any:
    """The request's JSON body, or the :class:`HttpResponse` that refuses it (FastAPI's 422
    by default; SGLang's 400 with ``sglang_400``)."""
    try:
        return json.loads(req.body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        if sglang_400:  # checked against SGLang 0.5.23 for /set_internal_state only
            return bad_request(f"JSON decode error: {exc}")
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


class Listener(ThreadingHTTPServer):
    # The default backlog of 5 resets connections when a load generator opens a hundred at
    # once, as a real server's accept queue would not.
    request_queue_size = 2048


class _Dispatcher(Protocol):
    def dispatch(self, req: HttpRequest) -> HttpResponse: ...


def make_handler(server: _Dispatcher) -> type[BaseHTTPRequestHandler]:
    """A handler class whose every method goes through ``server.dispatch``."""

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

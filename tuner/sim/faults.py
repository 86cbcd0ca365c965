"""Fault injection for the simulator's HTTP server (never part of a real server).

A :class:`FaultInjector` sits first among :attr:`SimServer.interceptors
<tuner.sim.server.SimServer.interceptors>` and applies the active :class:`Fault` s to every
request whose path they name. Kinds:

- ``refuse``    drop the connection without an answer (the client sees a reset);
- ``stall``     hold the request ``stall_s`` seconds (or until the faults are cleared) before
                answering normally: a client with a shorter timeout gives up first;
- ``status``    answer HTTP ``status`` (5xx by default 503, or a 4xx) with SGLang's error body;
- ``malformed`` answer 200 with a broken body: JSON cut in the middle, or Prometheus text
                whose samples are not numbers;
- ``reject``    ``/set_internal_state`` answers ``updated=false`` for every replica and the
                plugin counts the refusal (``updates_rejected``), as a refused table does;
- ``restart``   restart the server (fresh engine, counters from zero, new start time), then
                answer the request normally;
- ``protocol``  readouts claim plugin protocol ``version`` (a daemon/plugin mismatch);
- ``stock``     readouts lack the ``dynspec`` section, as stock SGLang's do (no plugin).

Faults come from code (:meth:`FaultInjector.add`), from ``dynspec-tuner sim --fault SPEC``
(:meth:`Fault.parse`), or over HTTP on the simulator only:

- ``POST /_sim/faults`` ``{"kind": "stall", "paths": ["/server_info"], "count": 3}`` adds one
  and answers its id; ``GET /_sim/faults`` lists them; ``DELETE /_sim/faults`` clears them
  (and releases stalled requests);
- ``POST /_sim/restart`` restarts the server now.

Admin paths (``/_sim/...``) are never subject to faults.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # server.py imports this module lazily: no import cycle at runtime
    from tuner.sim.server import HttpRequest, HttpResponse, SimServer

__all__ = [
    "ADMIN_PREFIX",
    "DEFAULT_STALL_S",
    "FAULT_KINDS",
    "Fault",
    "FaultInjector",
]

log = logging.getLogger(__name__)

FAULT_KINDS = ("refuse", "stall", "status", "malformed", "reject", "restart", "protocol", "stock")
ADMIN_PREFIX = "/_sim/"
# Long enough to outlast any sane client timeout; clearing the faults releases it earlier.
DEFAULT_STALL_S = 60.0
DEFAULT_FAULT_STATUS = 503
_SET_STATE = "/set_internal_state"


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault.

    Attributes:
        kind: one of :data:`FAULT_KINDS`.
        paths: request paths it applies to; empty = every path (admin paths excepted).
            ``reject`` always means ``/set_internal_state``.
        count: requests it applies to before it expires; None = until cleared.
        status: the HTTP status of a ``status`` fault (400..599).
        stall_s: how long a ``stall`` holds a request.
        version: the protocol version a ``protocol`` fault reports.
    """

    kind: str
    paths: tuple[str, ...] = ()
    count: int | None = None
    status: int = DEFAULT_FAULT_STATUS
    stall_s: float = DEFAULT_STALL_S
    version: int = 2

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(
                f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}"
            )
        paths = tuple(self.paths)
        if any(not isinstance(p, str) or not p.startswith("/") for p in paths):
            raise ValueError(f"fault paths must start with '/', got {list(paths)!r}")
        object.__setattr__(self, "paths", tuple(p.rstrip("/") or "/" for p in paths))
        if self.count is not None and (isinstance(self.count, bool) or self.count < 1):
            raise ValueError(f"fault count must be >= 1, got {self.count!r}")
        if not 400 <= self.status <= 599:
            raise ValueError(f"fault status must be 400..599, got {self.status!r}")
        if not (math.isfinite(self.stall_s) and self.stall_s >= 0):
            raise ValueError(f"fault stall_s must be >= 0, got {self.stall_s!r}")
        if self.version == 1 and self.kind == "protocol":
            raise ValueError("a protocol fault needs a version other than 1")

    def applies_to(self, path: str) -> bool:
        if self.kind == "reject":
            return path == _SET_STATE
        return not self.paths or path in self.paths

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``KIND[:PATH[,PATH...]][:COUNT]`` as ``dynspec-tuner sim --fault`` takes it.

        KIND is ``refuse``, ``stall`` or ``stallSECONDS``, an HTTP status (``503``, ``422``),
        ``malformed``, ``reject``, ``restart``, ``protocolN`` or ``stock``. Examples:
        ``503:/server_info:5`` (five 503s), ``stall2:/server_info``, ``reject``,
        ``malformed:/metrics``.

        Raises:
            ValueError: naming what is wrong.
        """
        parts = text.strip().split(":")
        head, rest = parts[0].strip().lower(), parts[1:]
        if len(rest) > 2:
            raise ValueError(f"fault {text!r}: expected KIND[:PATH[,PATH...]][:COUNT]")
        kw: dict[str, Any] = {}
        if head.isdigit():
            kw.update(kind="status", status=int(head))
        elif head.startswith("stall") and head != "stall":
            kw.update(kind="stall", stall_s=_number(head[5:], text, float))
        elif head.startswith("protocol") and head != "protocol":
            kw.update(kind="protocol", version=_number(head[8:], text, int))
        else:
            kw["kind"] = head
        for part in rest:
            part = part.strip()
            if part.isdigit():
                kw["count"] = int(part)
            elif part:
                kw["paths"] = tuple(p.strip() for p in part.split(",") if p.strip())
        try:
            return cls(**kw)
        except ValueError as exc:
            raise ValueError(f"fault {text!r}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["paths"] = list(self.paths)
        return out


def _number(raw: str, text: str, kind: Callable[[str], Any]) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"fault {text!r}: {raw!r} is not a number") from None


@dataclass
class _Active:
    id: int
    fault: Fault
    left: int | None
    hits: int = 0


@dataclass
class FaultInjector:
    """The simulator's fault switchboard. :class:`~tuner.sim.server.SimServer` makes one
    (``server.faults``) and puts :meth:`intercept` first among its interceptors.

    Thread-safe: requests are answered on many threads while tests add and clear faults.
    ``hits`` counts requests each fault kind was applied to (tests assert on it).
    """

    server: SimServer
    hits: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[_Active] = []
        self._next_id = 1
        self._release = threading.Event()
        # Requests currently held by a stall: lets tests see there is no pile-up.
        self.stalled_now = 0
        self.stalled_max = 0

    # --- control ----------------------------------------------------------------------------

    def add(self, fault: Fault | str) -> int:
        """Activate a fault (a :class:`Fault` or its ``--fault`` text); returns its id."""
        if isinstance(fault, str):
            fault = Fault.parse(fault)
        with self._lock:
            fid = self._next_id
            self._next_id += 1
            self._faults.append(_Active(fid, fault, fault.count))
        log.info("sim fault %d on: %s", fid, fault)
        return fid

    def remove(self, fid: int) -> bool:
        with self._lock:
            before = len(self._faults)
            self._faults = [a for a in self._faults if a.id != fid]
            removed = len(self._faults) < before
        self._wake()
        return removed

    def clear(self) -> None:
        """Remove every fault and release stalled requests."""
        with self._lock:
            self._faults = []
        self._wake()

    def active(self) -> list[Fault]:
        with self._lock:
            return [a.fault for a in self._faults]

    def release_stalled(self) -> None:
        """Let every stalled request go on (the server is stopping)."""
        self._wake()

    def _wake(self) -> None:
        old, self._release = self._release, threading.Event()
        old.set()

    # --- the interceptor --------------------------------------------------------------------

    def _take(self, path: str) -> Fault | None:
        """The first active fault for ``path``, consuming one of its count."""
        with self._lock:
            for a in self._faults:
                if a.fault.applies_to(path):
                    a.hits += 1
                    if a.left is not None:
                        a.left -= 1
                        if a.left <= 0:
                            self._faults.remove(a)
                    self.hits[a.fault.kind] = self.hits.get(a.fault.kind, 0) + 1
                    return a.fault
        return None

    def intercept(
        self, req: HttpRequest, call_next: Callable[[HttpRequest], HttpResponse]
    ) -> HttpResponse | None:
        if req.path.startswith(ADMIN_PREFIX):
            return self._admin(req)
        fault = self._take(req.path)
        if fault is None:
            return call_next(req)
        from tuner.sim.server import HttpResponse

        kind = fault.kind
        if kind == "refuse":
            return None  # the handler closes the connection without a reply
        if kind == "stall":
            release = self._release
            with self._lock:
                self.stalled_now += 1
                self.stalled_max = max(self.stalled_max, self.stalled_now)
            try:
                release.wait(fault.stall_s)
            finally:
                with self._lock:
                    self.stalled_now -= 1
            return call_next(req)
        if kind == "status":
            return HttpResponse.error(fault.status, f"injected fault: HTTP {fault.status}")
        if kind == "malformed":
            return _malformed(call_next(req))
        if kind == "reject":
            return self._reject(req, call_next)
        if kind == "restart":
            self.server.restart()
            log.info("sim fault: server restarted")
            return call_next(req)
        if kind == "protocol":
            return _with_protocol(call_next(req), fault.version)
        if kind == "stock":
            return _with_protocol(call_next(req), None)
        raise AssertionError(kind)  # pragma: no cover - Fault validates kinds

    def _reject(
        self, req: HttpRequest, call_next: Callable[[HttpRequest], HttpResponse]
    ) -> HttpResponse:
        from tuner.sim.server import HttpResponse

        if req.method not in ("POST", "PUT"):
            return call_next(req)
        srv = self.server
        with srv.lock:
            # Counted where the plugin counts its own refusals, so the daemon sees it too.
            srv.core.reject("injected fault: updates refused")
            n = srv.dp_size
        return HttpResponse.json([False] * n)

    # --- admin endpoint ---------------------------------------------------------------------

    def _admin(self, req: HttpRequest) -> HttpResponse:
        from tuner.sim.server import HttpResponse

        path = req.path
        if path == "/_sim/faults":
            if req.method == "GET":
                with self._lock:
                    items = [
                        {"id": a.id, "left": a.left, "hits": a.hits, **a.fault.to_json()}
                        for a in self._faults
                    ]
                return HttpResponse.json({"faults": items, "hits": dict(self.hits)})
            if req.method == "DELETE":
                self.clear()
                return HttpResponse.json({"cleared": True})
            if req.method == "POST":
                try:
                    body = json.loads(req.body or b"null")
                    if isinstance(body, str):
                        fault = Fault.parse(body)
                    elif isinstance(body, dict):
                        if "paths" in body and isinstance(body["paths"], list):
                            body = {**body, "paths": tuple(body["paths"])}
                        fault = Fault(**body)
                    else:
                        raise TypeError("body must be a fault object or its --fault text")
                except (ValueError, TypeError, UnicodeDecodeError) as exc:
                    return HttpResponse.json({"detail": f"bad fault: {exc}"}, 422)
                return HttpResponse.json({"id": self.add(fault), **fault.to_json()})
        elif path == "/_sim/restart" and req.method == "POST":
            self.server.restart()
            with self.server.lock:
                started = self.server.core.started_at
            return HttpResponse.json({"restarted": True, "started_at": started})
        elif path == "/_sim/faults" or path == "/_sim/restart":
            return HttpResponse.json({"detail": "Method Not Allowed"}, 405)
        return HttpResponse.json({"detail": "Not Found"}, 404)


def _malformed(resp: HttpResponse) -> HttpResponse:
    """A 200 whose body does not parse: Prometheus samples that are not numbers, or JSON cut
    in the middle."""
    from tuner.sim.server import HttpResponse

    if resp.content_type.startswith("text/plain"):
        lines = []
        for line in resp.body.decode().splitlines():
            if line and not line.startswith("#"):
                line = line.rsplit(" ", 1)[0] + " not-a-number"
            lines.append(line)
        return HttpResponse(200, ("\n".join(lines) + "\n").encode(), resp.content_type)
    body = resp.body or b'{"internal_states": []}'
    return HttpResponse(200, body[: max(1, len(body) // 2)], "application/json")


def _with_protocol(resp: HttpResponse, version: int | None) -> HttpResponse:
    """The reply with every ``dynspec`` readout claiming another protocol version, or without
    the readouts (``version`` None: stock SGLang)."""
    try:
        info = json.loads(resp.body)
    except ValueError:
        return resp
    states = info.get("internal_states") if isinstance(info, dict) else None
    if not isinstance(states, list):
        return resp
    for entry in states:
        if isinstance(entry, dict) and isinstance(entry.get("dynspec"), dict):
            if version is None:
                del entry["dynspec"]
            else:
                entry["dynspec"]["protocol"] = version
    out = type(resp)(resp.status, json.dumps(info).encode(), resp.content_type, resp.headers)
    return out

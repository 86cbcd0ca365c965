"""One SGLang server over HTTP: read the plugin's state, push policy tables.

Every failure leaves this module as one of :mod:`tuner.errors`' ``ServerError`` subclasses,
naming the server; parsing and encoding go through :mod:`tuner.protocol` only.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import httpx

from tuner import __version__
from tuner.config import DEFAULT_TIMEOUT_S, normalize_server
from tuner.errors import (
    MalformedReplyError,
    PluginMissingError,
    ServerError,
    ServerUnavailableError,
    UpdateRejectedError,
)
from tuner.protocol import BandTable, DynspecState, Probe, ProtocolError, Table, encode_update

__all__ = [
    "DEFAULT_TIMEOUT",
    "LOADS_PATH",
    "METRICS_PATH",
    "SERVER_INFO_PATH",
    "SET_STATE_PATH",
    "SGLangClient",
]

_log = logging.getLogger(__name__)

SERVER_INFO_PATH = "/server_info"
SET_STATE_PATH = "/set_internal_state"
METRICS_PATH = "/metrics"
LOADS_PATH = "/v1/loads"

# Connecting should be instant on a LAN; a slow reply means a busy tokenizer manager.
DEFAULT_TIMEOUT = httpx.Timeout(DEFAULT_TIMEOUT_S, connect=min(2.0, DEFAULT_TIMEOUT_S))


class SGLangClient:
    """A long-lived HTTP client for one SGLang server (plain or with the dynspec plugin).

    Args:
        address: ``host:port`` (``https://host:port`` for TLS); also the name used in
            errors and history.
        api_key: SGLang's admin API key, sent as ``Authorization: Bearer <key>``
            (``/set_internal_state`` requires the admin key when one is set).
        timeout: per request; a number of seconds or an ``httpx.Timeout``.
        transport: an httpx transport (tests pass ``httpx.MockTransport``).
    """

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.address = normalize_server(address)
        base = self.address if "://" in self.address else f"http://{self.address}"
        headers = {"User-Agent": f"dynspec-tuner/{__version__}", "Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self._http = httpx.Client(
            base_url=base, headers=headers, timeout=self._timeout, transport=transport
        )
        # The protocol the server's plugin spoke at the last read (every replica's lowest):
        # updates are written in it. None until a read: v1, which every plugin applies.
        self.protocol: int | None = None

    def __repr__(self) -> str:
        return f"SGLangClient({self.address!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- HTTP plumbing ----------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise ServerUnavailableError(
                self.address, f"{path} timed out ({type(exc).__name__})"
            ) from exc
        except httpx.TransportError as exc:
            raise ServerUnavailableError(
                self.address, f"{path}: cannot reach the server ({type(exc).__name__}: {exc})"
            ) from exc
        except httpx.HTTPError as exc:  # e.g. an invalid URL built from a bad address
            raise ServerUnavailableError(self.address, f"{path}: {exc}") from exc
        status = response.status_code
        if status >= 500:
            raise ServerUnavailableError(
                self.address, f"{path} answered HTTP {status}{_excerpt(response)}"
            )
        if status in (401, 403):
            raise ServerError(
                self.address,
                f"{path} answered HTTP {status}: the API key is missing or refused "
                "(set --api-key-file or DYNSPEC_API_KEY to SGLang's admin key)",
            )
        return response

    def _get_ok(self, path: str, hint: str, *, excerpt: bool = True) -> httpx.Response:
        """``GET path`` answered 200, else MalformedReplyError with the status and ``hint``
        (what another answer most likely means)."""
        response = self._request("GET", path)
        if response.status_code != 200:
            body = _excerpt(response) if excerpt else ""
            raise MalformedReplyError(
                self.address, f"{path} answered HTTP {response.status_code}{body} ({hint})"
            )
        return response

    def _json(self, response: httpx.Response, path: str) -> Any:
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MalformedReplyError(
                self.address, f"{path} did not answer JSON{_excerpt(response)}"
            ) from exc

    # --- reading ----------------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        """The raw ``GET /server_info`` object (server args, ``internal_states`` ...).

        Raises:
            ServerUnavailableError: unreachable, timed out or HTTP 5xx.
            MalformedReplyError: not a JSON object, or another HTTP error.
        """
        path = SERVER_INFO_PATH
        response = self._get_ok(path, "is this an SGLang server?")
        info = self._json(response, path)
        if not isinstance(info, dict):
            raise MalformedReplyError(
                self.address, f"{path} answered a JSON {type(info).__name__}, not an object"
            )
        return info

    def read_state(self) -> list[DynspecState]:
        """The plugin's state, one :class:`DynspecState` per DP replica.

        Raises:
            ServerUnavailableError: unreachable, timed out or HTTP 5xx.
            PluginMissingError: SGLang answered but without a ``"dynspec"`` section.
            MalformedReplyError: anything else that is not what the plugin sends.
        """
        return self.parse_state(self.server_info())

    def parse_state(self, info: dict[str, Any]) -> list[DynspecState]:
        """Extract the per-replica states from a ``/server_info`` object (see read_state)."""
        states = info.get("internal_states")
        if not isinstance(states, list) or not states:
            raise MalformedReplyError(
                self.address,
                f"{SERVER_INFO_PATH} has no internal_states list (an SGLang older than 0.5?)",
            )
        out: list[DynspecState] = []
        for i, entry in enumerate(states):
            if not isinstance(entry, dict) or "dynspec" not in entry:
                raise PluginMissingError(
                    self.address,
                    f"internal_states[{i}] has no \"dynspec\" section: the plugin is not "
                    "loaded (stock SGLang?)",
                )
            try:
                out.append(DynspecState.from_json(entry["dynspec"]))
            except ProtocolError as exc:
                raise MalformedReplyError(
                    self.address, f"internal_states[{i}].dynspec: {exc}"
                ) from exc
        self.protocol = min(s.protocol for s in out)
        return out

    def metrics_text(self) -> str:
        """``GET /metrics`` as text (SGLang's Prometheus exposition; needs --enable-metrics).

        Raises:
            ServerUnavailableError: unreachable, timed out or HTTP 5xx.
            MalformedReplyError: any other non-200 answer.
        """
        return self._get_ok(METRICS_PATH, "is the server started with --enable-metrics?",
                            excerpt=False).text

    def loads(self, path: str = LOADS_PATH) -> Any | None:
        """``GET /v1/loads`` parsed, or None when the server does not serve it.

        Raises:
            ServerUnavailableError: unreachable, timed out or HTTP 5xx.
            MalformedReplyError: a 200 answer that is not JSON.
        """
        response = self._request("GET", path)
        if response.status_code != 200:
            return None
        return self._json(response, path)

    # --- writing ----------------------------------------------------------------------------

    def push(
        self, table: Table | BandTable, version: int, probes: Sequence[Probe] = ()
    ) -> list[bool]:
        """Send a table (and probes) as flat keys, in the protocol the server spoke at the last
        read (v1 before any read); returns SGLang's reply, one boolean per DP replica
        (``False``: that replica refused the update and changed nothing).

        Raises:
            ProtocolError: the table, a probe or the version is invalid, or banded or with
                probes for a v1 server (nothing was sent).
            ServerUnavailableError: unreachable, timed out or HTTP 5xx (the update may or
                may not have been applied: read the state again).
            UpdateRejectedError: SGLang's request validation refused the body (HTTP 4xx).
            MalformedReplyError: a reply that is not a list of booleans.
        """
        body = {"server_args": encode_update(table, version, protocol=self.protocol or 1,
                                             probes=probes)}
        path = SET_STATE_PATH
        response = self._request("POST", path, json=body)
        if response.status_code != 200:
            raise UpdateRejectedError(
                self.address,
                f"{path} answered HTTP {response.status_code}{_excerpt(response)}",
            )
        reply = self._json(response, path)
        if not isinstance(reply, list) or not reply or not all(isinstance(x, bool) for x in reply):
            raise MalformedReplyError(
                self.address, f"{path} answered {_short(reply)}, not a list of booleans"
            )
        return list(reply)


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)


def _excerpt(response: httpx.Response, limit: int = 160) -> str:
    try:
        text = response.text.strip().replace("\n", " ")
    except Exception:
        return ""
    if not text:
        return ""
    kind = response.headers.get("content-type", "")
    if "html" in kind or text[:1] == "<":  # a web page, not an API: name it, do not paste it
        title = _TITLE.search(text)
        name = " ".join(title.group(1).split())[:80] if title else ""
        return f": an HTML page{f' titled {name!r}' if name else ''}, not SGLang's API"
    return ": " + (text if len(text) <= limit else text[: limit - 3] + "...")

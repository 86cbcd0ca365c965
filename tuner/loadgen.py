"""Closed-loop load for one SGLang server: ``c`` requests always in flight, no more.

The sweep drives it the way an operator drives ``bench_serving --max-concurrency``: each of
``c`` workers sends a request, waits for the reply and sends the next. The concurrency can be
changed while it runs (:meth:`ClosedLoop.set_concurrency`); every change opens a new *epoch*,
and :meth:`ClosedLoop.settle` waits until every request launched before it has finished, so a
measurement window that starts after ``settle`` only sees requests that ran entirely under
the new conditions (the warm-up the sweep excludes).

Throughput of a window comes from Little's law rather than from counting tokens that happen
to finish inside it: ``tokens/s = mean in-flight × Σ output tokens / Σ request lifetimes`` over
the requests completed in the window. In a closed loop that is the long-run token rate, and
unlike "tokens completed / window" it does not jump by a whole request each time one finishes
(at concurrency 1 with 10 requests per window that alone is a ±10 % error).

Requests go to ``/v1/completions`` (OpenAI-compatible) or ``/generate`` (SGLang native) with
``temperature 0`` and ``ignore_eos`` so every request produces exactly ``max_tokens`` tokens,
as ``bench_serving`` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx

from tuner.config import normalize_server
from tuner.errors import ConfigError, MalformedReplyError, ServerError, ServerUnavailableError

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MAX_CONSECUTIVE_ERRORS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "ENDPOINTS",
    "ClosedLoop",
    "LoadConfig",
    "LoadMark",
    "RequestRecord",
    "WindowStats",
    "base_url",
    "load_prompts",
    "synthetic_prompts",
    "window_stats",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# A request at concurrency 128 behind a 48-request running cap queues for minutes on a slow
# box; the read timeout only catches a server that stopped answering.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# Transient failures (5xx, read timeouts, dropped connections) in a row, per worker and with
# doubling back-off, before the load gives up on the server; a refused connection or a 4xx
# stops it at once.
DEFAULT_MAX_CONSECUTIVE_ERRORS = 10
DEFAULT_MODEL = "default"
_RETRY_BASE_S = 0.05
_RETRY_MAX_S = 2.0
DEFAULT_SYNTHETIC_PROMPTS = 64

ENDPOINTS = {"completions": "/v1/completions", "generate": "/generate"}


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """What each request asks for, and how long to wait for it.

    Args:
        endpoint: ``"completions"`` (``/v1/completions``) or ``"generate"`` (``/generate``).
        max_tokens: output tokens per request (``ignore_eos`` makes it exact).
        model: the ``model`` field of ``/v1/completions`` (SGLang serves one model).
        connect_timeout_s: to open a connection.
        request_timeout_s: to wait for one reply (queueing included).
        max_consecutive_errors: transient failures in a row before giving up.
        seed: shuffles the prompt order reproducibly.
    """

    endpoint: str = "completions"
    max_tokens: int = DEFAULT_MAX_TOKENS
    model: str = DEFAULT_MODEL
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_consecutive_errors: int = DEFAULT_MAX_CONSECUTIVE_ERRORS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}"
            )
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.connect_timeout_s > 0 or not self.request_timeout_s > 0:
            raise ConfigError("timeouts must be > 0 seconds")
        if self.max_consecutive_errors < 1:
            raise ConfigError(
                f"max_consecutive_errors must be >= 1, got {self.max_consecutive_errors}"
            )

    @property
    def path(self) -> str:
        return ENDPOINTS[self.endpoint]


def base_url(address: str) -> str:
    """``HOST:PORT`` (or ``http(s)://HOST:PORT``) -> the URL requests go to.

    Raises:
        ConfigError: naming what is wrong with the address.
    """
    name = normalize_server(address)
    return name if "://" in name else f"http://{name}"


# --- prompts --------------------------------------------------------------------------------


def load_prompts(path: str | Path) -> tuple[str, ...]:
    """Read a JSON-lines prompt file: one ``{"prompt": "..."}`` object per line.

    Blank lines are skipped; other keys on a line are ignored.

    Raises:
        ConfigError: naming the file and line of the first bad line, or an unreadable or
            empty file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"prompts file {path}: cannot read it: {exc}") from exc
    prompts: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"prompts file {path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from exc
        if not isinstance(obj, dict):
            raise ConfigError(
                f'{where}: expected an object like {{"prompt": "..."}}, got {type(obj).__name__}'
            )
        if "prompt" not in obj:
            keys = ", ".join(sorted(obj)) or "none"
            raise ConfigError(f'{where}: no "prompt" key (keys: {keys})')
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f'{where}: "prompt" must be a non-empty string, got {prompt!r:.60}')
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"prompts file {path}: holds no prompts")
    return tuple(prompts)


_TOPICS = (
    "how a hash map handles collisions",
    "the causes of the French Revolution",
    "why the sky is blue",
    "how to write a binary search in Python",
    "the difference between TCP and UDP",
    "how vaccines train the immune system",
    "what a mortgage amortization schedule is",
    "how photosynthesis stores energy",
    "the rules of chess for a beginner",
    "how a compiler turns source code into machine code",
    "the water cycle",
    "how to plan a week of healthy meals",
    "what inflation is and how central banks fight it",
    "how transformers use attention",
    "the history of the printing press",
    "how to debug a memory leak",
)
_TASKS = (
    "Explain {t} in detail, step by step.",
    "Write a short essay about {t}.",
    "Give a beginner-friendly tutorial on {t}, with examples.",
    "Summarise what an expert would say about {t}, then list common misconceptions.",
)


def synthetic_prompts(n: int = DEFAULT_SYNTHETIC_PROMPTS, *, seed: int = 0) -> tuple[str, ...]:
    """Chat-like prompts for when the user has none (deterministic for a seed).

    Speculation's acceptance depends on the text, so real prompts from the workload give
    truer numbers; these stand in for a generic chat mix.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    pairs = [(t, task) for t in _TOPICS for task in _TASKS]
    rng.shuffle(pairs)
    return tuple(task.format(t=t) for t, task in (pairs[i % len(pairs)] for i in range(n)))


# --- measurement ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One completed request: launch and reply times (load clock), tokens it produced."""

    start: float
    end: float
    output_tokens: int
    epoch: int

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class LoadMark:
    """Where the load stood at one instant; :meth:`ClosedLoop.stats_since` measures from it."""

    t: float
    in_flight_integral: float
    records: int
    errors: int


@dataclass(frozen=True)
class WindowStats:
    """What the client saw over one window.

    ``tok_s`` is the Little's-law token rate (module docstring); ``tok_s_se`` its standard
    error from batch means over groups of completions (NaN when there are too few groups to
    say); ``tok_s_completed`` the naive tokens-finished-in-window / window for comparison.
    TPOT is each request's latency / output tokens (queueing and prefill included: the
    client does not stream).
    """

    start: float
    end: float
    requests: int
    output_tokens: int
    avg_in_flight: float
    tok_s: float
    tok_s_se: float
    tok_s_completed: float
    tpot_p50_s: float
    tpot_p99_s: float
    errors: int

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def rel_se(self) -> float:
        return self.tok_s_se / self.tok_s if self.tok_s > 0 else math.nan


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# Batch means need a few groups before their spread says anything.
_MIN_GROUPS = 3


def window_stats(
    records: Sequence[RequestRecord],
    *,
    start: float,
    end: float,
    avg_in_flight: float,
    errors: int = 0,
) -> WindowStats:
    """Summarise the requests that completed in ``[start, end]`` (pure).

    Args:
        records: completed requests, in completion order (others are ignored).
        start, end: the window, on the load's clock.
        avg_in_flight: time-averaged requests in flight over the window.
        errors: failed requests in the window.
    """
    done = [r for r in records if start <= r.end <= end and r.output_tokens > 0]
    duration = end - start
    tokens = sum(r.output_tokens for r in done)
    life = sum(r.latency for r in done)
    tok_s = avg_in_flight * tokens / life if life > 0 else math.nan
    # Requests running side by side share every decode step, so neighbours are strongly
    # correlated; groups of about half the concurrency keep batch means roughly independent.
    group = max(1, math.ceil(avg_in_flight / 2))
    means = []
    for i in range(0, len(done) - group + 1, group):
        chunk = done[i : i + group]
        chunk_life = sum(r.latency for r in chunk)
        if chunk_life > 0:
            means.append(avg_in_flight * sum(r.output_tokens for r in chunk) / chunk_life)
    if len(means) >= _MIN_GROUPS:
        mean = sum(means) / len(means)
        var = sum((m - mean) ** 2 for m in means) / (len(means) - 1)
        se = math.sqrt(var / len(means))
    else:
        se = math.nan
    tpots = sorted(r.latency / r.output_tokens for r in done)
    return WindowStats(
        start=start,
        end=end,
        requests=len(done),
        output_tokens=tokens,
        avg_in_flight=avg_in_flight,
        tok_s=tok_s,
        tok_s_se=se,
        tok_s_completed=tokens / duration if duration > 0 else math.nan,
        tpot_p50_s=_percentile(tpots, 0.50),
        tpot_p99_s=_percentile(tpots, 0.99),
        errors=errors,
    )


# --- the load -------------------------------------------------------------------------------


class _Transient(Exception):
    """A failure worth retrying (5xx, timeout, dropped connection)."""


class ClosedLoop:
    """``c`` workers, each with one request in flight at a time, against one server.

    Use as ``async with ClosedLoop(...) as load:``; leaving the block cancels every request.
    Any fatal problem (server unreachable, a 4xx, a reply without a token count, too many
    transient errors in a row) stops the load and is raised from the next ``settle``/``run_for``
    /``wait_completed`` call as a :class:`~tuner.errors.ServerError` naming the server.

    Args:
        address: ``HOST:PORT`` or URL of the server.
        prompts: the prompts to cycle through (shuffled once by ``config.seed``).
        config: what each request asks for.
        api_key: sent as ``Authorization: Bearer``.
        clock: monotonic seconds; the same clock the caller measures windows with.
        transport: an httpx async transport (tests); default a real connection pool.
    """

    def __init__(
        self,
        address: str,
        prompts: Sequence[str],
        *,
        config: LoadConfig | None = None,
        api_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not prompts:
            raise ConfigError("no prompts to send")
        self.config = config or LoadConfig()
        self.server = normalize_server(address)
        self.url = base_url(address)
        self._prompts = list(prompts)
        random.Random(self.config.seed).shuffle(self._prompts)
        self._next_prompt = 0
        self._api_key = api_key
        self._clock = clock
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._target = 0
        self._epoch = 0
        self._workers: dict[int, asyncio.Task[None]] = {}
        self._inflight_epochs: Counter[int] = Counter()
        self._completed_by_epoch: Counter[int] = Counter()
        self._changed: asyncio.Condition | None = None
        self._fatal: ServerError | None = None
        self.records: list[RequestRecord] = []
        self.errors = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._integral = 0.0
        self._integral_t = clock()

    # -- lifecycle --

    async def __aenter__(self) -> Self:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        cfg = self.config
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(
                cfg.request_timeout_s, connect=cfg.connect_timeout_s, pool=None
            ),
            # The workers bound the concurrency; httpx's default pool of 100 connections would
            # otherwise cap it silently (level 128 would run at 100).
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            transport=self._transport,
        )
        self._changed = asyncio.Condition()
        self._integral_t = self._clock()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop every worker (in-flight requests are cancelled) and close the connections."""
        self._target = 0
        tasks = list(self._workers.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._workers.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- control --

    @property
    def concurrency(self) -> int:
        return self._target

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_concurrency(self, c: int) -> int:
        """Run ``c`` workers from now on and open a new epoch; returns the epoch.

        Raising it starts workers at once; lowering it lets the surplus workers finish their
        current request and stop. Call it again with the same ``c`` to open a new epoch
        after changing something on the server (the arm), so ``settle`` waits out requests
        that started before the change.
        """
        if self._client is None:
            raise RuntimeError("ClosedLoop is not running (use 'async with')")
        self._raise_fatal()
        if c < 0:
            raise ValueError(f"concurrency must be >= 0, got {c}")
        self._epoch += 1
        self._target = c
        for slot in range(c):
            task = self._workers.get(slot)
            if task is None or task.done():
                self._workers[slot] = asyncio.create_task(
                    self._worker(slot), name=f"loadgen-worker-{slot}"
                )
        return self._epoch

    async def settle(self, epoch: int | None = None) -> None:
        """Wait until every request launched before ``epoch`` (default: now) has finished."""
        epoch = self._epoch if epoch is None else epoch
        await self._wait(lambda: not any(e < epoch for e in self._inflight_epochs))

    async def wait_completed(self, n: int, *, epoch: int | None = None) -> None:
        """Wait until at least ``n`` requests have completed in total, or, with ``epoch``,
        ``n`` requests launched in that epoch or later."""
        if epoch is None:
            await self._wait(lambda: len(self.records) >= n)
        else:
            await self._wait(
                lambda: sum(v for e, v in self._completed_by_epoch.items() if e >= epoch) >= n
            )

    async def run_for(self, seconds: float) -> None:
        """Let the load run for ``seconds`` (returns early only to raise a fatal error)."""
        if seconds <= 0:
            self._raise_fatal()
            return
        try:
            await asyncio.wait_for(self._wait(lambda: False), timeout=seconds)
        except TimeoutError:
            pass
        self._raise_fatal()

    def mark(self) -> LoadMark:
        """The load's state now; pass it to :meth:`stats_since`."""
        now = self._clock()
        self._accumulate(now)
        return LoadMark(now, self._integral, len(self.records), self.errors)

    def stats_since(self, mark: LoadMark) -> WindowStats:
        """Client-side figures for the window from ``mark`` to now."""
        now = self.mark()
        span = now.t - mark.t
        avg = (now.in_flight_integral - mark.in_flight_integral) / span if span > 0 else 0.0
        return window_stats(
            self.records[mark.records :],
            start=mark.t,
            end=now.t,
            avg_in_flight=avg,
            errors=now.errors - mark.errors,
        )

    # -- internals --

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        if self._changed is None:
            raise RuntimeError("ClosedLoop is not running (use 'async with')")
        async with self._changed:
            await self._changed.wait_for(lambda: self._fatal is not None or predicate())
        self._raise_fatal()

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    def _accumulate(self, now: float) -> None:
        self._integral += self.in_flight * (now - self._integral_t)
        self._integral_t = now

    def _take_prompt(self) -> str:
        prompt = self._prompts[self._next_prompt % len(self._prompts)]
        self._next_prompt += 1
        return prompt

    async def _worker(self, slot: int) -> None:
        failures = 0  # this worker's transient failures in a row
        while slot < self._target and self._fatal is None:
            prompt = self._take_prompt()
            epoch = self._epoch
            start = self._clock()
            self._accumulate(start)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self._inflight_epochs[epoch] += 1
            tokens: int | None = None
            try:
                tokens = await self._send(prompt)
                failures = 0
            except _Transient as exc:
                self.errors += 1
                failures += 1
                # Counted per window (WindowStats.errors); a burst at a switch is normal.
                log.debug("%s: request failed: %s", self.server, exc)
                if failures >= self.config.max_consecutive_errors:
                    self._fatal = ServerUnavailableError(
                        self.server, f"{failures} requests in a row failed; last: {exc}"
                    )
            except ServerError as exc:
                self.errors += 1
                self._fatal = exc
            finally:
                end = self._clock()
                self._accumulate(end)
                self.in_flight -= 1
                self._inflight_epochs[epoch] -= 1
                if not self._inflight_epochs[epoch]:
                    del self._inflight_epochs[epoch]
            if tokens is not None:
                self.records.append(RequestRecord(start, end, tokens, epoch))
                self._completed_by_epoch[epoch] += 1
            await self._notify()
            if failures and self._fatal is None:
                # Back off before retrying so a burst of resets (a full listen backlog when
                # 128 workers connect at once, a restarting server) is ridden out, not hammered.
                await asyncio.sleep(min(_RETRY_BASE_S * 2 ** (failures - 1), _RETRY_MAX_S))

    def _body(self, prompt: str) -> dict[str, object]:
        cfg = self.config
        if cfg.endpoint == "generate":
            return {
                "text": prompt,
                "sampling_params": {
                    "max_new_tokens": cfg.max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            }
        return {
            "model": cfg.model,
            "prompt": prompt,
            "max_tokens": cfg.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }

    async def _send(self, prompt: str) -> int:
        assert self._client is not None
        path = self.config.path
        try:
            resp = await self._client.post(path, json=self._body(prompt))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ServerUnavailableError(
                self.server, f"cannot connect: {exc or type(exc).__name__}"
            ) from exc
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise _Transient(f"POST {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise _Transient(f"POST {path}: HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code in (401, 403):
            raise ServerError(
                self.server,
                f"POST {path}: HTTP {resp.status_code} (the server wants an API key: "
                "--api-key-file)",
            )
        if resp.status_code >= 400:
            raise ServerError(
                self.server, f"POST {path}: HTTP {resp.status_code}: {resp.text[:200]}"
            )
        return self._tokens(resp)

    def _tokens(self, resp: httpx.Response) -> int:
        path = self.config.path
        try:
            body = resp.json()
        except ValueError as exc:
            raise MalformedReplyError(self.server, f"POST {path}: reply is not JSON") from exc
        try:
            if self.config.endpoint == "generate":
                # /generate answers a list when given a batch; we send one prompt.
                item = body[0] if isinstance(body, list) else body
                n = item["meta_info"]["completion_tokens"]
            else:
                n = body["usage"]["completion_tokens"]
        except (KeyError, IndexError, TypeError) as exc:
            where = "meta_info.completion_tokens" if self.config.endpoint == "generate" else (
                "usage.completion_tokens"
            )
            raise MalformedReplyError(self.server, f"POST {path}: reply has no {where}") from exc
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise MalformedReplyError(self.server, f"POST {path}: bad completion_tokens {n!r}")
        return n

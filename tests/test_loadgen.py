"""The closed-loop load generator against real HTTP servers on loopback: the simulator, and a
small counting server that proves how many requests are in flight at once."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

import pytest

from tuner.errors import ConfigError, MalformedReplyError, ServerError, ServerUnavailableError
from tuner.loadgen import (
    ClosedLoop,
    LoadConfig,
    RequestRecord,
    base_url,
    load_prompts,
    synthetic_prompts,
    window_stats,
)
from tuner.sim.server import SimServer

PROMPTS = ("hello there", "explain speculative decoding")


class _Server(ThreadingHTTPServer):
    # The default listen backlog (5) drops connections when 128 clients connect at once;
    # uvicorn, which SGLang runs, uses 2048.
    request_queue_size = 2048


class CountingServer:
    """Answers /v1/completions; counts requests in flight server-side.

    With ``barrier=c`` every request waits until ``c`` requests are in the handler at once
    (or fails after ``barrier_timeout_s``), so a load that keeps fewer than ``c`` in flight
    cannot pass and one that keeps more shows up in ``max_in_flight``.
    """

    def __init__(self, *, barrier: int | None = None, barrier_timeout_s: float = 20.0,
                 reply: Callable[[int], tuple[int, dict]] | None = None) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0
        self.bodies: list[dict] = []
        self.barrier = threading.Barrier(barrier) if barrier else None
        self.barrier_timeout_s = barrier_timeout_s
        self.broken = False
        self.closing = False
        self.reply = reply or (lambda n: (200, {"usage": {"completion_tokens": 7}}))
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                    outer.requests += 1
                    n = outer.requests
                    outer.bodies.append(body)
                status, payload = 200, {}
                try:
                    if outer.barrier is not None:
                        try:
                            outer.barrier.wait(timeout=outer.barrier_timeout_s)
                        except threading.BrokenBarrierError:
                            outer.broken = outer.broken or not outer.closing
                            status, payload = 500, {"detail": "barrier broken"}
                    if status == 200:
                        status, payload = outer.reply(n)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> Self:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing = True
        if self.barrier is not None:
            self.barrier.abort()
        self.httpd.shutdown()
        self.httpd.server_close()


def run(coro):
    return asyncio.run(coro)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def sim(**kw) -> Iterator[SimServer]:
    kw.setdefault("speed", 200.0)
    with SimServer(**kw) as srv:
        yield srv


# --- against the simulator ----------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "generate"])
def test_completes_requests_and_counts_tokens_against_the_simulator(endpoint):
    with sim() as srv:

        async def go():
            cfg = LoadConfig(endpoint=endpoint, max_tokens=24)
            async with ClosedLoop(f"127.0.0.1:{srv.port}", PROMPTS, config=cfg) as load:
                mark = load.mark()
                load.set_concurrency(4)
                await load.wait_completed(20)
                return load, load.stats_since(mark)

        load, stats = run(go())
    assert len(load.records) >= 20
    assert all(r.output_tokens == 24 for r in load.records)
    assert stats.output_tokens == 24 * stats.requests
    assert load.max_in_flight == 4
    assert load.errors == 0
    assert stats.tok_s > 0 and stats.tpot_p50_s > 0
    # Little's law and the naive count agree to within the granularity of a short window.
    assert stats.tok_s == pytest.approx(stats.tok_s_completed, rel=0.5)


def test_lowering_concurrency_waits_out_the_surplus_then_runs_at_the_new_level():
    with sim() as srv:

        async def go():
            cfg = LoadConfig(max_tokens=16)
            async with ClosedLoop(f"127.0.0.1:{srv.port}", PROMPTS, config=cfg) as load:
                load.set_concurrency(8)
                await load.wait_completed(16)
                epoch = load.set_concurrency(2)
                await load.settle(epoch)
                assert load.in_flight <= 2
                n = len(load.records)
                await load.wait_completed(n + 10)
                return load, epoch

        load, epoch = run(go())
    assert load.max_in_flight == 8
    late = [r for r in load.records if r.epoch >= epoch]
    # At no instant were more than 2 of the new epoch's requests in flight.
    events = sorted([(r.start, 1) for r in late] + [(r.end, -1) for r in late])
    depth = peak = 0
    for _, d in events:
        depth += d
        peak = max(peak, depth)
    assert peak <= 2


# --- exact concurrency, seen from the server ----------------------------------------------


@pytest.mark.parametrize("c", [1, 3, 16])
def test_exactly_c_requests_are_in_flight_at_once(c):
    with CountingServer(barrier=c) as srv:

        async def go():
            async with ClosedLoop(srv.address, PROMPTS) as load:
                load.set_concurrency(c)
                await load.wait_completed(3 * c)
                return load

        load = run(go())
    assert not srv.broken  # every round gathered c requests at once
    assert srv.max_in_flight == c  # and never more
    assert load.max_in_flight == c


def test_level_128_is_not_capped_by_the_connection_pool():
    with CountingServer(barrier=128) as srv:

        async def go():
            async with ClosedLoop(srv.address, PROMPTS) as load:
                load.set_concurrency(128)
                await load.wait_completed(128)

        run(go())
    assert not srv.broken and srv.max_in_flight == 128


def test_request_bodies_follow_the_config():
    with CountingServer() as srv:

        async def go():
            cfg = LoadConfig(max_tokens=33, model="m1")
            async with ClosedLoop(srv.address, ["p"], config=cfg, api_key="k") as load:
                load.set_concurrency(1)
                await load.wait_completed(1)

        run(go())
    body = srv.bodies[0]
    assert body == {"model": "m1", "prompt": "p", "max_tokens": 33, "temperature": 0.0,
                    "ignore_eos": True}


# --- errors -------------------------------------------------------------------------------


def test_an_unreachable_server_is_a_clear_error():
    port = free_port()

    async def go():
        async with ClosedLoop(f"127.0.0.1:{port}", PROMPTS) as load:
            load.set_concurrency(2)
            await load.wait_completed(1)

    with pytest.raises(ServerUnavailableError, match=rf"127.0.0.1:{port}: cannot connect"):
        run(go())


@pytest.mark.parametrize(
    "reply, error, message",
    [
        # A reply without a token count is a clear error.
        ((200, {"choices": []}), MalformedReplyError, "no usage.completion_tokens"),
        # A refused API key stops the load and says which flag.
        ((401, {"detail": "no"}), ServerError, "HTTP 401.*--api-key-file"),
    ],
    ids=["no-token-count", "refused-api-key"],
)
def test_a_reply_the_load_cannot_use_stops_it_with_a_clear_error(reply, error, message):
    with CountingServer(reply=lambda n: reply) as srv:

        async def go():
            async with ClosedLoop(srv.address, PROMPTS) as load:
                load.set_concurrency(1)
                await load.wait_completed(1)

        with pytest.raises(error, match=message):
            run(go())


def test_transient_5xx_are_counted_and_survived_but_not_forever():
    ok = (200, {"usage": {"completion_tokens": 5}})
    flaky = CountingServer(reply=lambda n: (503, {}) if n % 2 else ok)
    with flaky as srv:

        async def go():
            async with ClosedLoop(srv.address, PROMPTS) as load:
                load.set_concurrency(1)
                await load.wait_completed(5)
                return load

        load = run(go())
    assert load.errors >= 4 and len(load.records) >= 5
    with CountingServer(reply=lambda n: (500, {})) as srv:

        async def go2():
            cfg = LoadConfig(max_consecutive_errors=3)
            async with ClosedLoop(srv.address, PROMPTS, config=cfg) as load:
                load.set_concurrency(1)
                await load.wait_completed(1)

        with pytest.raises(ServerUnavailableError, match="3 requests in a row failed"):
            run(go2())


# --- prompts ------------------------------------------------------------------------------


def test_prompt_file_reads_prompts_and_skips_blank_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": 3}\n', encoding="utf-8")
    assert load_prompts(f) == ("a", "b")


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"prompt": "a"}\n{"prompt": "b"\n', r"line 2: not valid JSON"),
        ('{"prompt": "a"}\n["b"]\n', r"line 2: expected an object"),
        ('{"text": "a"}\n', r'line 1: no "prompt" key \(keys: text\)'),
        ('{"prompt": ""}\n', r'line 1: "prompt" must be a non-empty string'),
        ('{"prompt": 3}\n', r'line 1: "prompt" must be a non-empty string'),
        ("\n\n", r"holds no prompts"),
    ],
)
def test_bad_prompt_files_name_the_file_and_line(tmp_path, text, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=match) as info:
        load_prompts(f)
    assert str(f) in str(info.value)


def test_a_missing_prompt_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"prompts file .*nope.jsonl: cannot read it"):
        load_prompts(tmp_path / "nope.jsonl")


def test_synthetic_prompts_are_deterministic_and_varied():
    a = synthetic_prompts(40, seed=1)
    assert a == synthetic_prompts(40, seed=1) and len(a) == 40
    assert len(set(a)) == 40
    assert a != synthetic_prompts(40, seed=2)


# --- pure pieces --------------------------------------------------------------------------


def test_window_stats_use_littles_law_over_completed_requests():
    # Two requests always in flight, each 10 tokens in 2 s: 10 tokens/s.
    recs = [RequestRecord(start=2.0 * i, end=2.0 * i + 2.0, output_tokens=10, epoch=1)
            for i in range(10) for _ in range(2)]
    s = window_stats(recs, start=3.0, end=13.0, avg_in_flight=2.0)
    assert s.requests == 10  # ends at 4, 6, 8, 10, 12 (two each)
    assert s.tok_s == pytest.approx(10.0)
    assert s.tok_s_se == pytest.approx(0.0)
    assert s.tpot_p50_s == pytest.approx(0.2)
    # The naive count depends on where the window edges fall; Little's law does not.
    assert s.tok_s_completed == pytest.approx(10.0)
    s2 = window_stats(recs, start=3.0, end=12.5, avg_in_flight=2.0)
    assert s2.tok_s == pytest.approx(10.0) and s2.tok_s_completed != pytest.approx(10.0)


def test_window_stats_without_completions_are_nan_not_zero():
    s = window_stats([], start=0.0, end=5.0, avg_in_flight=4.0)
    assert s.requests == 0 and s.tok_s != s.tok_s  # NaN


def test_base_url_and_config_validation():
    assert base_url("localhost:30000") == "http://localhost:30000"
    assert base_url("https://h:8443/") == "https://h:8443"
    with pytest.raises(ConfigError):
        base_url("no-port")
    with pytest.raises(ConfigError, match="endpoint"):
        LoadConfig(endpoint="chat")
    with pytest.raises(ConfigError, match="max_tokens"):
        LoadConfig(max_tokens=0)

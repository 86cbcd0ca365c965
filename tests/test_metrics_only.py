"""Metrics-only mode: coarse observations from a fake stock SGLang serving only /metrics."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from policies import Buckets
from storage import Storage
from tuner.config import TunerConfig
from tuner.daemon import Daemon
from tuner.errors import MalformedReplyError
from tuner.metrics_only import (
    LOADS_PATH,
    METRICS_PATH,
    MetricsSampler,
    metrics_only_notice,
    parse_loads,
    parse_metrics,
)

LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")


class FakeStockSGLang:
    """Exposes SGLang 0.5.23's scheduler metrics through prometheus_client, as SGLang does."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.tokens = Counter(
            "sglang:realtime_tokens", "tokens", [*LABELS, "mode"], registry=self.registry
        )
        self.passes = Counter(
            "sglang:cuda_graph_passes", "passes", [*LABELS, "mode"], registry=self.registry
        )
        self.running = Gauge("sglang:num_running_reqs", "bs", LABELS, registry=self.registry)
        self.steps = Gauge("sglang:spec_num_steps", "steps", LABELS, registry=self.registry)
        self.accept = Gauge("sglang:spec_accept_length", "al", LABELS, registry=self.registry)
        self.labels = {"model_name": "m", "engine_type": "unified", "tp_rank": "0",
                       "pp_rank": "0", "moe_ep_rank": "0"}
        self.restart()

    def restart(self) -> None:
        # prometheus_client cannot reset a counter: re-register fresh ones.
        for c in (self.tokens, self.passes):
            c.clear()
        self.set_state(bs=1, k=3, accept_length=1.0)

    def set_state(self, *, bs: int, k: int, accept_length: float) -> None:
        self.running.labels(**self.labels).set(bs)
        self.steps.labels(**self.labels).set(k)
        self.accept.labels(**self.labels).set(accept_length)

    def decode(self, *, steps: int, bs: int, accept_length: float) -> None:
        self.tokens.labels(**self.labels, mode="decode").inc(round(steps * bs * accept_length))
        self.passes.labels(**self.labels, mode="decode_cuda_graph").inc(steps)
        # Prefill noise that must not count as decode.
        self.tokens.labels(**self.labels, mode="prefill_compute").inc(1000)
        self.passes.labels(**self.labels, mode="prefill_none").inc(3)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


@pytest.fixture
def fake() -> Iterator[tuple[FakeStockSGLang, str]]:
    state = FakeStockSGLang()
    state.posts = []  # type: ignore[attr-defined]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            state.posts.append(self.path)  # type: ignore[attr-defined]
            self.send_error(404)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/server_info":
                # Stock SGLang: internal_states without a "dynspec" section.
                body = json.dumps({"internal_states": [{"last_gen_throughput": 1.0}],
                                   "model_path": "m", "version": "0.5.23"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == METRICS_PATH:
                body = state.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    )
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _scrape(client: httpx.Client, base: str) -> tuple[str, object | None]:
    metrics = client.get(base + METRICS_PATH)
    metrics.raise_for_status()
    loads = client.get(base + LOADS_PATH)
    return metrics.text, (loads.json() if loads.status_code == 200 else None)


def test_observations_from_metrics_only(fake: tuple[FakeStockSGLang, str]) -> None:
    state, base = fake
    sampler = MetricsSampler(server="fake:1", min_steps=40)
    with httpx.Client(timeout=5) as client:
        state.set_state(bs=16, k=3, accept_length=2.5)
        assert sampler.observe(*_scrape(client, base), now=100.0) == []  # baseline only
        state.decode(steps=200, bs=16, accept_length=2.5)
        obs = sampler.observe(*_scrape(client, base), now=110.0)
    assert len(obs) == 1
    o = obs[0]
    assert (o.b, o.k, o.decode_steps) == (16, 3, 200)
    assert o.emitted_tokens == 200 * 16 * 2.5  # decode tokens only, prefill excluded
    assert o.busy_s == pytest.approx(10.0)  # wall clock: no /v1/loads here
    # 1.5 accepted drafts per request-step, 3 drafted.
    assert o.accepted_drafts == 200 * 16 * 1.5
    assert o.drafted_tokens == 200 * 16 * 3
    assert o.problem() is None


def test_arm_change_and_bucket_jump_give_nothing(fake: tuple[FakeStockSGLang, str]) -> None:
    state, base = fake
    sampler = MetricsSampler(server="fake:1", buckets=Buckets((4, 16, 64)), min_steps=10)
    with httpx.Client(timeout=5) as client:
        state.set_state(bs=8, k=3, accept_length=2.0)
        sampler.observe(*_scrape(client, base), now=0.0)
        state.decode(steps=50, bs=8, accept_length=2.0)
        state.set_state(bs=8, k=1, accept_length=1.6)
        assert sampler.observe(*_scrape(client, base), now=5.0) == []
        assert "arm changed" in sampler.last_skip[0]
        state.decode(steps=50, bs=40, accept_length=1.6)
        state.set_state(bs=40, k=1, accept_length=1.6)
        assert sampler.observe(*_scrape(client, base), now=10.0) == []
        assert "across buckets" in sampler.last_skip[0]
        # Steady again: the next interval counts, at k=1.
        state.decode(steps=50, bs=40, accept_length=1.6)
        (o,) = sampler.observe(*_scrape(client, base), now=15.0)
    assert (o.b, o.k, o.decode_steps, o.emitted_tokens) == (40, 1, 50, 3200)


def test_short_interval_is_extended_not_dropped(fake: tuple[FakeStockSGLang, str]) -> None:
    state, base = fake
    sampler = MetricsSampler(server="fake:1", min_steps=100)
    with httpx.Client(timeout=5) as client:
        state.set_state(bs=2, k=5, accept_length=3.0)
        sampler.observe(*_scrape(client, base), now=0.0)
        state.decode(steps=60, bs=2, accept_length=3.0)
        assert sampler.observe(*_scrape(client, base), now=1.0) == []
        state.decode(steps=60, bs=2, accept_length=3.0)
        (o,) = sampler.observe(*_scrape(client, base), now=2.0)
    assert o.decode_steps == 120 and o.busy_s == pytest.approx(2.0)


def test_restart_resets_baseline(fake: tuple[FakeStockSGLang, str]) -> None:
    state, base = fake
    sampler = MetricsSampler(server="fake:1", min_steps=1)
    with httpx.Client(timeout=5) as client:
        state.set_state(bs=4, k=3, accept_length=2.0)
        state.decode(steps=500, bs=4, accept_length=2.0)
        sampler.observe(*_scrape(client, base), now=0.0)
        state.restart()
        state.set_state(bs=4, k=3, accept_length=2.0)
        state.decode(steps=10, bs=4, accept_length=2.0)
        assert sampler.observe(*_scrape(client, base), now=1.0) == []
        assert sampler.restarts == 1
        state.decode(steps=10, bs=4, accept_length=2.0)
        (o,) = sampler.observe(*_scrape(client, base), now=2.0)
    assert o.decode_steps == 10


def test_decode_moments_make_it_exact() -> None:
    sampler = MetricsSampler(server="s", min_steps=10)
    text = (
        '# TYPE sglang:spec_num_steps gauge\nsglang:spec_num_steps{tp_rank="0"} 3\n'
        '# TYPE sglang:realtime_tokens_total counter\n'
        'sglang:realtime_tokens_total{tp_rank="0",mode="decode"} 0\n'
    )
    loads0 = {"loads": [{"dp_rank": 0, "decode_moments": [100, 800, 2e6, 6400, 16e6, 2000]}]}
    # 50 steps at bs 8 (Σbs 400, Σbs² 3200), 0.5 s busy, 1100 tokens -> 700 accepted.
    loads1 = {"loads": [{"dp_rank": 0, "decode_moments": [150, 1200, 2.5e6, 9600, 20e6, 3100]}]}
    assert sampler.observe(text, loads0, now=0.0) == []
    (o,) = sampler.observe(text, loads1, now=60.0)
    assert (o.b, o.k, o.decode_steps, o.emitted_tokens) == (8, 3, 50, 1100)
    assert o.busy_s == pytest.approx(0.5)  # launch-to-launch, not the 60 s wall interval
    assert (o.accepted_drafts, o.drafted_tokens) == (700, 1200)


def test_decode_moments_with_wide_batch_spread_are_dropped() -> None:
    sampler = MetricsSampler(server="s", min_steps=1, max_bs_rsd=0.5)
    text = '# TYPE sglang:spec_num_steps gauge\nsglang:spec_num_steps 0\n' \
           'sglang:realtime_tokens_total{mode="decode"} 0\n'
    sampler.observe(text, {"loads": [{"dp_rank": 0, "decode_moments": [0, 0, 0, 0, 0, 0]}]},
                    now=0.0)
    # 2 steps at bs 1 and bs 63: mean 32, sd 31.
    out = sampler.observe(
        text, {"loads": [{"dp_rank": 0, "decode_moments": [2, 64, 1e4, 3970, 0, 64]}]}, now=1.0
    )
    assert out == [] and "spread" in sampler.last_skip[0]


def test_dp_ranks_and_priority_series() -> None:
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 5\n'
        'sglang:num_running_reqs{dp_rank="0",tp_rank="0",priority="2"} 1\n'
        'sglang:num_running_reqs{dp_rank="1",tp_rank="0"} 9\n'
        'sglang:num_running_reqs{dp_rank="1",tp_rank="1"} 99\n'
        "# TYPE sglang:realtime_tokens_total counter\n"
        'sglang:realtime_tokens_total{dp_rank="0",tp_rank="0",mode="decode"} 10\n'
        'sglang:realtime_tokens_total{dp_rank="1",tp_rank="0",mode="decode"} 20\n'
        'sglang:realtime_tokens_total{dp_rank="1",tp_rank="1",mode="decode"} 999\n'
    )
    r = parse_metrics(text)
    assert (r[0].running_reqs, r[0].decode_tokens) == (5, 10)
    assert (r[1].running_reqs, r[1].decode_tokens) == (9, 20)


def test_bad_replies_name_the_server_and_keep_the_baseline() -> None:
    sampler = MetricsSampler(server="gpu7:30000")
    with pytest.raises(MalformedReplyError, match=r"gpu7:30000: /metrics"):
        sampler.observe("this is { not prometheus", None, now=0.0)
    with pytest.raises(MalformedReplyError, match=r"--enable-metrics"):
        sampler.observe("# TYPE foo gauge\nfoo 1\n", None, now=0.0)
    good = 'sglang:realtime_tokens_total{mode="decode"} 1\n'
    with pytest.raises(MalformedReplyError, match=r"/v1/loads"):
        sampler.observe(good, {"loads": [{"decode_moments": [1, 2]}]}, now=0.0)
    with pytest.raises(ValueError):
        parse_loads(["not", "an", "object"])


def test_notice_says_what_is_missing_and_how_to_enable() -> None:
    text = metrics_only_notice("gpu7:30000")
    assert "gpu7:30000" in text and "cannot be pushed" not in text
    assert "no table can be pushed" in text and "pip install dynspec-tuner" in text


def test_daemon_learns_from_metrics_only_never_pushes_says_so_once(
    fake: tuple[FakeStockSGLang, str], tmp_path, caplog
) -> None:
    """The daemon against a stock server: /server_info without "dynspec", /metrics only."""
    from tuner.report import build_report

    state, base = fake
    address = base.removeprefix("http://")
    now = [1_000.0]
    storage = Storage(f"sqlite:///{tmp_path / 'h.db'}")
    daemon = Daemon(
        TunerConfig(servers=(address,), interval_s=1.0, decision_period_s=2.0,
                    policy="thompson", buckets=(4, 16, 64)),
        storage=storage, clock=lambda: now[0],
    )
    state.set_state(bs=12, k=3, accept_length=2.4)
    with caplog.at_level(logging.WARNING):
        for i in range(12):
            if i == 6:  # the load changes: batch size 40, the server now drafts 1 step
                state.set_state(bs=40, k=1, accept_length=1.7)
            state.decode(steps=100, bs=12 if i < 6 else 40, accept_length=2.4 if i < 6 else 1.7)
            now[0] += 1.0
            daemon.run_once()
    daemon.shutdown()
    status = daemon.status().servers[0]
    assert status.mode == "metrics-only"
    assert state.posts == []  # never pushes
    notices = [r for r in caplog.records if "no \"dynspec\" section" in r.getMessage()]
    assert len(notices) == 1 and "pip install dynspec-tuner" in notices[0].getMessage()
    rows = storage.observations(server=address)
    assert {(r.b, r.k) for r in rows} == {(12, 3), (40, 1)}
    assert all(r.decode_steps == 100 and r.busy_s == pytest.approx(1.0) for r in rows)
    assert [e.kind for e in storage.events(server=address)] == ["plugin_missing"]
    # What it learned reports like anything else.
    report = build_report(storage, buckets=Buckets((4, 16, 64)), now=now[0])
    (s,) = report.servers
    assert s.chosen_from == "data" and s.table is None and s.metrics_only
    assert s.model == "m"  # from /server_info's server args, read while checking for the plugin
    got = {(bk.label, a.arm): a.goodput for bk in s.buckets for a in bk.arms}
    assert got[("5-16", 3)] == pytest.approx(100 * 12 * 2.4)
    assert got[("17-64", 1)] == pytest.approx(100 * 40 * 1.7)
    storage.close()


def test_metrics_only_agrees_with_the_plugins_counters_on_the_simulator(tmp_path) -> None:
    """The daemon watches a simulated server whose /server_info hides the plugin (stock
    SGLang), on the simulator's virtual clock. Its coarse observations, from /metrics and
    /v1/loads' decode moments, must tell the same goodput as the plugin's own counters, which
    the simulator still keeps: the ground truth."""
    from urllib.parse import parse_qs, urlsplit

    from tuner.client import SGLangClient
    from tuner.plugin.core import PluginCore
    from tuner.sim.engine import Engine
    from tuner.sim.load import parse_load
    from tuner.sim.server import HttpRequest, SimServer

    core = PluginCore((0, 3), started_at=0.0, default_arm=3)
    engine = Engine(profile="h200-llama8b", workload="chat", core=core, seed=5,
                    load=parse_load("30:16,30:40"))
    sim = SimServer(engine=engine)

    def stock(req, call_next):  # SGLang without the plugin: no "dynspec" section
        resp = call_next(req)
        if req.path == "/server_info":
            info = json.loads(resp.body)
            for entry in info["internal_states"]:
                entry.pop("dynspec", None)
            resp.body = json.dumps(info).encode()
        return resp

    sim.interceptors.append(stock)

    def handler(request: httpx.Request) -> httpx.Response:
        url = urlsplit(str(request.url))
        resp = sim.dispatch(HttpRequest(request.method, url.path, parse_qs(url.query),
                                        dict(request.headers), request.content))
        return httpx.Response(resp.status, content=resp.body,
                              headers={"content-type": resp.content_type})

    address = "sim:30000"
    storage = Storage(f"sqlite:///{tmp_path / 'h.db'}")
    daemon = Daemon(
        TunerConfig(servers=(address,), interval_s=1.0, decision_period_s=2.0,
                    policy="thompson"),
        storage=storage, clock=lambda: 1_000.0 + engine.now,
        clients={address: SGLangClient(address, transport=httpx.MockTransport(handler))},
    )
    truth_at: dict[float, dict] = {}
    for sec in range(1, 61):
        engine.run_until(float(sec))
        daemon.run_once()
        truth_at[1_000.0 + engine.now] = {(c.b, c.k): c for c in core.state().counters}
    daemon.shutdown()
    assert daemon.status().servers[0].mode == "metrics-only"
    assert core.updates_applied == 0  # nothing was pushed

    rows = storage.observations(server=address)
    assert len(rows) >= 30 and {r.k for r in rows} == {3}
    # Over the intervals the daemon recorded, compare with the plugin's counters.
    stamps = sorted(truth_at)
    for phase, (lo, hi) in {"16": (1_006.0, 1_029.0), "40": (1_036.0, 1_059.0)}.items():
        mine = [r for r in rows if lo <= r.ts <= hi]
        t0 = max(t for t in stamps if t <= min(r.ts for r in mine) - 0.5)
        t1 = max(r.ts for r in mine)
        a, z = truth_at[t0], truth_at[t1]
        emitted = sum(c.emitted_tokens - (a[k].emitted_tokens if k in a else 0)
                      for k, c in z.items())
        busy = sum(c.busy_s - (a[k].busy_s if k in a else 0.0) for k, c in z.items())
        seen = sum(r.emitted_tokens for r in mine) / sum(r.busy_s for r in mine)
        assert seen == pytest.approx(emitted / busy, rel=0.01), phase
        assert abs(sum(r.b * r.decode_steps for r in mine) / sum(r.decode_steps for r in mine)
                   - int(phase)) <= 1.5
    storage.close()

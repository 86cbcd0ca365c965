"""Fault 11: hostile updates. Property-based (hypothesis): random and malformed payloads thrown
at the plugin core, at the simulator's ``/set_internal_state`` (in process, then over real
HTTP), and hostile readouts at the daemon's parser. Never an exception escaping, never a
partially applied table, every refusal counted in ``updates_rejected``."""

from __future__ import annotations

import json
import math
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tuner.client import SGLangClient
from tuner.errors import ServerError
from tuner.plugin.core import PluginCore
from tuner.protocol import (
    DynspecState,
    ProtocolError,
    decode_update,
    encode_update,
    lookup,
    validate_table,
)
from tuner.sim.server import HttpRequest, SimServer

ARMS = (0, 1, 3, 5)
START_TABLE = ((8, 1), (None, 3))
START_VERSION = 5

_OUR_KEYS = ["dynspec_protocol", "dynspec_version", "dynspec_rows"] + [
    f"dynspec_r{i}_{f}" for i in range(5) for f in ("max_bs", "k")
]
keys = st.sampled_from([*_OUR_KEYS, "dynspec_r9_k", "dynspec_", "dynspec_table",
                        "pp_max_micro_batch_size", "speculative_accept_threshold_acc",
                        "no_such_key"]) | st.text(max_size=12)
numbers = (st.integers(-3, 70) | st.integers() | st.booleans()
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-1, 0, 1, 1.0]))
scalars = numbers | st.none() | st.text(max_size=6)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@st.composite
def valid_tables(draw):
    n = draw(st.integers(1, 5))
    bounds = sorted(draw(st.sets(st.integers(1, 512), min_size=n - 1, max_size=n - 1)))
    return tuple(zip([*bounds, None], draw(st.lists(st.sampled_from(ARMS), min_size=n,
                                                    max_size=n)), strict=True))


@st.composite
def near_valid_updates(draw):
    """A valid update, then a few mutations: drop, change or add keys."""
    flat: dict = dict(encode_update(draw(valid_tables()),
                                    draw(st.integers(START_VERSION - 1, START_VERSION + 3))))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["drop", "change", "add"]))
        if action == "drop" and flat:
            flat.pop(draw(st.sampled_from(sorted(flat))))
        elif action == "change" and flat:
            flat[draw(st.sampled_from(sorted(flat)))] = draw(values)
        else:
            flat[draw(keys)] = draw(values)
    return flat


payloads = near_valid_updates() | st.dictionaries(keys, values, max_size=12)


def fresh_core() -> PluginCore:
    core = PluginCore(ARMS, started_at=1.0)
    core.install(START_TABLE, START_VERSION)
    return core


def _independent_verdict(payload, version):
    try:
        return decode_update(payload, arms=ARMS, current_version=version)
    except Exception:  # noqa: BLE001 - any failure is a refusal
        return None


@settings(max_examples=200, deadline=None)
@given(st.lists(payloads, min_size=1, max_size=4))
def test_plugin_core_applies_whole_tables_or_nothing_and_counts_refusals(updates):
    core = fresh_core()
    for payload in updates:
        before = (core.table, core.version, core.updates_applied, core.updates_rejected)
        expected = _independent_verdict(payload, core.version)
        ok, reason = core.apply_update(payload)  # must not raise, whatever the payload
        if ok:
            assert reason is None and expected == (core.band_table, core.version)
            assert validate_table(core.table, ARMS) == core.table
            assert core.version > before[1]
            assert (core.updates_applied, core.updates_rejected) == (before[2] + 1, before[3])
        else:
            assert expected is None and isinstance(reason, str) and reason
            assert (core.table, core.version) == before[:2]  # nothing changed
            assert (core.updates_applied, core.updates_rejected) == (before[2], before[3] + 1)
            assert core.last_rejection == reason
        # The hot path still answers from a complete table for every batch size.
        for b in (1, 7, 8, 9, 64, 511, 512, 513, 10_000):
            assert core.steps_for_batch(b) == lookup(core.table, b) in ARMS
    assert core.updates_applied + core.updates_rejected == len(updates)


json_docs = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=10,
)
bodies = st.one_of(
    st.builds(lambda p: json.dumps({"server_args": p}, allow_nan=True).encode(),
              near_valid_updates()),
    st.builds(lambda p: json.dumps({"server_args": p}, allow_nan=True).encode(),
              st.dictionaries(keys, values, max_size=8)),
    st.builds(lambda d: json.dumps(d).encode(), json_docs),
    st.binary(max_size=64),
)


@pytest.fixture(scope="module")
def sim():
    # Not started: dispatch() answers in process, through the same interceptors and handlers.
    return SimServer(load="none", dp_size=2)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies, st.sampled_from(["POST", "PUT"]))
def test_simulator_set_internal_state_survives_any_body(sim, body, method):
    with sim.lock:
        core = sim.core
        before = (core.table, core.version, core.updates_applied, core.updates_rejected)
    resp = sim.dispatch(HttpRequest(method, "/set_internal_state", {}, {}, body))
    assert resp.status in (200, 400), resp.body  # never a 500: nothing escaped a handler
    after = (core.table, core.version, core.updates_applied, core.updates_rejected)
    if resp.status == 400:
        assert after == before  # refused by SGLang's request validation, before the plugin
        return
    reply = json.loads(resp.body)
    assert isinstance(reply, list) and len(reply) == 2 and len(set(reply)) == 1
    if after[2] > before[2]:  # applied: a whole, valid table and a higher version
        assert reply == [True, True] and after[1] > before[1] and after[3] == before[3]
        assert validate_table(after[0], ARMS) == after[0]
    else:
        assert after[:2] == before[:2]
        # A refusal by the plugin is counted once; SGLang's own refusals never reach it.
        assert after[3] - before[3] in (0, 1)
        assert reply in ([True, True], [False, False])
        if after[3] > before[3]:
            assert reply == [False, False]


def test_hostile_bodies_over_real_http_leave_the_server_serving():
    hostile = [
        b"", b"{", b"null", b"[]", b'{"server_args": []}', b'{"server_args": {"a": {"b": 1}}}',
        json.dumps({"server_args": {"dynspec_protocol": 1, "dynspec_version": 1e308,
                                    "dynspec_rows": 1, "dynspec_r0_max_bs": -1,
                                    "dynspec_r0_k": 0}}).encode(),
        json.dumps({"server_args": {"dynspec_protocol": "1", "dynspec_version": "nan"}}).encode(),
        b'{"server_args": {"dynspec_rows": 1e999}}', "\u00ff\u2603".encode("utf-16"),
        json.dumps({"server_args": {f"dynspec_r{i}_k": 1 for i in range(5000)}}).encode(),
    ]
    with SimServer(load="none") as sim, httpx.Client(base_url=sim.url, timeout=10) as c:
        for body in hostile:
            r = c.post("/set_internal_state", content=body,
                       headers={"content-type": "application/json"})
            assert r.status_code in (200, 400)
        with socket.create_connection(("127.0.0.1", sim.port), timeout=10) as s:
            s.sendall(b"POST /set_internal_state HTTP/1.1\r\nContent-Length: 10\r\n\r\n{")
            s.shutdown(socket.SHUT_WR)  # a body cut short
            s.recv(64)
        ok = c.post("/set_internal_state",
                    json={"server_args": encode_update(((4, 0), (None, 5)), 1)})
        assert ok.json() == [True]
        state = DynspecState.from_json(
            c.get("/server_info").json()["internal_states"][0]["dynspec"])
        assert state.table == ((4, 0), (None, 5)) and state.policy_version == 1
        # The plugin saw two (the 1e308 version, the 5000 stray rows); SGLang refused the rest.
        assert state.updates_applied == 1 and state.updates_rejected == 2


readouts = st.dictionaries(
    st.sampled_from(["protocol", "arms", "policy_version", "table", "counters", "started_at",
                     "updates_applied", "updates_rejected", "hooks_live", "reason"]),
    values, max_size=10,
)


@pytest.fixture(scope="module")
def client():
    with SGLangClient("127.0.0.1:1") as c:
        yield c


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(readouts, json_docs))
def test_daemon_parses_any_readout_or_refuses_it_cleanly(client, obj):
    try:
        state = DynspecState.from_json(obj)
    except ProtocolError:
        pass
    else:
        assert validate_table(state.table, state.arms) == state.table
        assert all(c.decode_steps >= 0 and math.isfinite(c.busy_s) for c in state.counters)
    try:
        client.parse_state({"internal_states": [{"dynspec": obj}]})
    except ServerError:
        pass


def test_a_server_sending_poison_readouts_never_stops_or_loops_the_daemon(tmp_path, caplog):
    """NaN start times (a restart at every reading, were it believed) and counters beyond a
    64-bit column (a history that could never be written again): refused at the door."""
    from storage import Storage
    from tuner.config import TunerConfig
    from tuner.daemon import Daemon

    poison = {"mode": None}

    def hostile(req, call_next):
        resp = call_next(req)
        if req.path != "/server_info" or poison["mode"] is None:
            return resp
        info = json.loads(resp.body)
        d = info["internal_states"][0]["dynspec"]
        if poison["mode"] == "nan":
            d["started_at"] = math.nan
        else:
            d["counters"] = [[5, "1,1," + "_" * 9]]  # 64**9 - 1 steps: beyond 2^53
        return type(resp)(200, json.dumps(info).encode())

    t = [1000.0]
    with SimServer(load="8", speed=50, seed=2) as sim:
        sim.interceptors.append(hostile)
        config = TunerConfig(servers=(f"127.0.0.1:{sim.port}",), policy="never",
                             decision_period_s=2.0)
        d = Daemon(config, storage=Storage(f"sqlite:///{tmp_path / 'h.db'}"), clock=lambda: t[0])
        for mode in (None, "nan", None, "huge", None):
            poison["mode"] = mode
            for _ in range(40):
                t[0] += 1.0
                d.run_once()
        st = d.status().servers[0]
        # Two bursts of 40 s, each tried at 0, 1, 3, 7, 15 and 31 s (backoff), then back.
        assert st.up and st.restarts == 0 and st.errors == 2 * 6
        assert st.pushes == 1 and d.status().storage_ok
        d.shutdown()
    assert max(o.decode_steps for o in d.storage.observations()) < 10**9
    assert "must be within" in caplog.text and "finite number" in caplog.text

"""The simulator's HTTP server on a free loopback port, spoken to over real HTTP."""

from __future__ import annotations

import httpx
import pytest

from tuner.protocol import DynspecState, encode_update
from tuner.sim.server import HttpResponse, SimServer


@pytest.fixture
def server():
    # Fast virtual clock so /generate answers quickly; the built-in load keeps counters moving.
    with SimServer(profile="h200-llama8b", workload="chat", load="4", speed=50.0, port=0) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        yield c


def _dynspec(client: httpx.Client) -> DynspecState:
    info = client.get("/server_info").json()
    (replica,) = info["internal_states"]
    return DynspecState.from_json(replica["dynspec"])


def test_server_info_has_sglang_args_and_the_dynspec_section(server, client):
    assert server.url.startswith("http://127.0.0.1:") and server.port > 0
    assert client.get("/health").status_code == 200
    info = client.get("/server_info").json()
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["speculative_eagle_topk"] == 1
    assert info["speculative_num_draft_tokens"] == info["speculative_num_steps"] + 1
    assert info["max_running_requests"] == 48
    assert info["version"] == "0.5.23"
    alias = client.get("/get_server_info").json()
    assert alias["internal_states"][0]["dynspec"]["arms"] == [0, 1, 3, 5]
    state = _dynspec(client)
    # The plugin starts where SGLang starts: the step /server_info advertises (union[len//2]).
    assert info["speculative_num_steps"] == 3
    assert state.table == ((None, 3),) and state.policy_version == 0


def test_push_a_table_then_refuse_a_bad_one_and_a_nested_value(client):
    table = ((8, 5), (32, 3), (None, 1))
    r = client.post("/set_internal_state", json={"server_args": encode_update(table, 1)})
    assert r.status_code == 200 and r.json() == [True]
    state = _dynspec(client)
    assert state.table == table and state.policy_version == 1 and state.updates_applied == 1

    bad = encode_update(((8, 7), (None, 1)), 2)  # k=7 was never built
    r = client.put("/set_internal_state", json={"server_args": bad})
    assert r.status_code == 200 and r.json() == [False]
    state = _dynspec(client)
    assert state.table == table and state.policy_version == 1
    assert state.updates_rejected == 1 and "not a built arm" in (state.last_rejection or "")

    # SGLang's request validation: 400 with its error object (checked on a real server).
    r = client.post("/set_internal_state", json={"server_args": {"dynspec_table": {"0": [8, 5]}}})
    assert r.status_code == 400 and r.json()["type"] == "Bad Request"
    r = client.post("/set_internal_state", json={"server_args": {"dynspec_version": None}})
    assert r.status_code == 400
    r = client.post("/set_internal_state", content=b"{not json")
    assert r.status_code == 400
    state = _dynspec(client)
    assert (state.table, state.policy_version, state.updates_rejected) == (table, 1, 1)


def test_foreign_keys_are_refused_as_sglang_refuses_them(client):
    flat = encode_update(((None, 1),), 1) | {"no_such_setting": 3}
    assert client.post("/set_internal_state", json={"server_args": flat}).json() == [False]
    assert _dynspec(client).policy_version == 0


def test_sglang_keys_ride_along_and_fall_with_a_refused_table(client):
    bad = encode_update(((None, 2),), 1) | {"speculative_accept_threshold_single": 0.5}
    assert client.post("/set_internal_state", json={"server_args": bad}).json() == [False]
    assert client.get("/server_info").json()["speculative_accept_threshold_single"] == 1.0
    good = encode_update(((None, 1),), 1) | {"speculative_accept_threshold_single": 0.5}
    assert client.post("/set_internal_state", json={"server_args": good}).json() == [True]
    info = client.get("/server_info").json()
    assert info["speculative_accept_threshold_single"] == 0.5
    assert info["internal_states"][0]["dynspec"]["table"] == [[None, 1]]


def test_numbers_as_strings_are_coerced_like_pydantic(client):
    flat = {k: str(v) for k, v in encode_update(((4, 3), (None, 0)), 1).items()}
    assert client.post("/set_internal_state", json={"server_args": flat}).json() == [True]
    assert _dynspec(client).table == ((4, 3), (None, 0))


def test_generate_and_completions_return_synthetic_tokens(client):
    r = client.post(
        "/generate", json={"text": "hello " * 40, "sampling_params": {"max_new_tokens": 20}}
    )
    assert r.status_code == 200
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 20 and meta["prompt_tokens"] == 60
    assert meta["e2e_latency"] > 0
    batch = client.post(
        "/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3}}
    )
    assert [x["meta_info"]["completion_tokens"] for x in batch.json()] == [3, 3]
    assert (
        client.post(
            "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 0}}
        ).status_code
        == 400
    )
    assert (
        client.post(
            "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": "x"}}
        ).status_code
        == 422
    )
    assert (
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 10**9}).status_code
        == 400
    )
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 7})
    assert r.json()["usage"]["completion_tokens"] == 7
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_metrics_and_loads(server, client):
    client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 50}})
    text = client.get("/metrics").text
    assert "# TYPE sglang:realtime_tokens_total counter" in text
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("sglang:realtime_tokens_total") and 'mode="decode"' in ln
    )
    assert float(line.rsplit(" ", 1)[1]) > 0
    for name in ("sglang:num_running_reqs", "sglang:gen_throughput", "sglang:spec_accept_length"):
        assert f"\n{name}{{" in text
    loads = client.get("/v1/loads", params={"include": "core,spec"}).json()
    (load,) = loads["loads"]
    assert load["max_running_requests"] == 48 and len(load["decode_moments"]) == 6
    assert "speculative" in load
    assert client.get("/v1/loads", params={"include": "bogus"}).status_code == 400


def test_unknown_routes_and_methods(client):
    assert client.get("/nope").status_code == 404
    assert client.get("/set_internal_state").status_code == 405


def test_interceptors_wrap_every_request(server, client):
    server.interceptors.append(
        lambda req, call_next: (
            HttpResponse.error(503, "down") if req.path == "/server_info" else call_next(req)
        )
    )
    assert client.get("/server_info").status_code == 503
    assert client.get("/health").status_code == 200


def test_restart_resets_counters_and_start_time(server, client):
    client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 30}})
    client.post("/set_internal_state", json={"server_args": encode_update(((None, 1),), 3)})
    before = _dynspec(client)
    assert before.counters and before.policy_version == 3
    server.restart()
    after = _dynspec(client)
    assert after.policy_version == 0 and after.started_at >= before.started_at
    assert sum(c.decode_steps for c in after.counters) < sum(
        c.decode_steps for c in before.counters
    )


def test_a_bad_content_length_is_refused_and_the_server_lives_on(server, client):
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n")
        assert b" 400 " in sock.recv(64)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
        assert b" 413 " in sock.recv(64)
    assert client.get("/health").status_code == 200


def test_an_admin_key_gates_updates_as_sglang_does():
    update = {"server_args": encode_update(((None, 1),), 1)}
    with SimServer(load="none", admin_api_key="k1") as sim, httpx.Client(base_url=sim.url) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = c.post("/set_internal_state", json=update, headers=headers)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        assert c.get("/server_info", headers={"Authorization": "Bearer nope"}).status_code == 200
        r = c.post("/set_internal_state", json=update, headers={"Authorization": "Bearer k1"})
        assert r.json() == [True]

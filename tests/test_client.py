"""SGLangClient against httpx.MockTransport fakes of SGLang's endpoints."""

from __future__ import annotations

import json

import httpx
import pytest

from tuner.client import SGLangClient
from tuner.errors import (
    MalformedReplyError,
    PluginMissingError,
    ServerError,
    ServerUnavailableError,
    UpdateRejectedError,
)
from tuner.plugin.core import PluginCore
from tuner.protocol import CounterRow, ProtocolError, banded, decode_update

ADDR = "gpu7:30000"


def dynspec(core: PluginCore) -> dict:
    return core.readout()


class FakeSGLang:
    """Serves /server_info and /set_internal_state the way SGLang 0.5.23 does, with the
    plugin's real core per DP replica."""

    def __init__(self, replicas: int = 1, admin_key: str | None = None) -> None:
        self.cores = [PluginCore((0, 1, 3), started_at=1000.0) for _ in range(replicas)]
        self.admin_key = admin_key
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/server_info":
            states = [{"dynspec": dynspec(c), "last_gen_throughput": 1.0} for c in self.cores]
            return httpx.Response(200, json={"tp_size": 1, "internal_states": states})
        if request.url.path == "/set_internal_state":
            if self.admin_key and request.headers.get("authorization") != f"Bearer {self.admin_key}":
                return httpx.Response(401, json={"error": "Unauthorized"})
            args = json.loads(request.content)["server_args"]
            if any(isinstance(v, (dict, list)) for v in args.values()):
                return httpx.Response(422, json={"detail": "nested"})
            return httpx.Response(200, json=[c.apply_update(args)[0] for c in self.cores])
        return httpx.Response(404)


def client(handler, **kw) -> SGLangClient:
    return SGLangClient(ADDR, transport=httpx.MockTransport(handler), **kw)


def test_read_state_one_per_replica():
    fake = FakeSGLang(replicas=2)
    fake.cores[1].record_decode(4, 3, 10, 6, 0.0, 1)
    fake.cores[1].record_decode(4, 3, 10, 6, 0.01, 2)
    with client(fake) as c:
        states = c.read_state()
    assert len(states) == 2
    assert states[0].arms == (0, 1, 3) and states[0].policy_version == 0
    assert states[1].counters == (CounterRow(4, 3, 1, 10, 6, 12, pytest.approx(0.01)),)
    assert fake.requests[0].url == "http://gpu7:30000/server_info"


def test_push_sends_flat_keys_and_returns_per_replica_booleans():
    fake = FakeSGLang(replicas=2, admin_key="adm1n")
    with client(fake, api_key="adm1n") as c:
        assert c.push(((8, 3), (None, 1)), 5) == [True, True]
        state = c.read_state()[0]
    assert state.table == ((8, 3), (None, 1)) and state.policy_version == 5
    sent = json.loads(fake.requests[0].content)["server_args"]
    assert all(isinstance(v, int) for v in sent.values())
    # Nothing read yet: v1 keys, which every plugin applies.
    assert sent["dynspec_protocol"] == 1
    assert decode_update(sent, arms=(0, 1, 3), current_version=0) == (banded(((8, 3), (None, 1))), 5)
    assert fake.requests[0].headers["authorization"] == "Bearer adm1n"


def test_push_refused_by_plugin_returns_false_and_changes_nothing():
    fake = FakeSGLang()
    with client(fake) as c:
        assert c.push(((None, 5),), 1) == [False]  # k=5 is not a built arm
        assert c.read_state()[0].table == ((None, 3),)


def test_wrong_admin_key_is_a_server_error_without_the_key():
    fake = FakeSGLang(admin_key="adm1n")
    with client(fake, api_key="wrong-key") as c:
        with pytest.raises(ServerError, match=r"gpu7:30000: .*401.*DYNSPEC_API_KEY") as info:
            c.push(((None, 1),), 1)
    assert "wrong-key" not in str(info.value) and "wrong-key" not in repr(c)


def test_invalid_table_is_refused_before_sending():
    fake = FakeSGLang()
    with client(fake) as c, pytest.raises(ProtocolError):
        c.push(((8, 1), (4, 1), (None, 0)), 1)
    assert fake.requests == []


@pytest.mark.parametrize(
    ("reply", "error", "match"),
    [
        (httpx.Response(200, text="<html>not json"), MalformedReplyError, "did not answer JSON"),
        (httpx.Response(200, json=[1, 2]), MalformedReplyError, "not an object"),
        (httpx.Response(200, json={"version": "0.5"}), MalformedReplyError, "internal_states"),
        (
            httpx.Response(200, json={"internal_states": [{"last_gen_throughput": 1.0}]}),
            PluginMissingError,
            'no "dynspec"',
        ),
        (
            httpx.Response(200, json={"internal_states": [{"dynspec": {"protocol": 1}}]}),
            MalformedReplyError,
            r"internal_states\[0\]\.dynspec: .*lacks field",
        ),
        (
            httpx.Response(200, json={"internal_states": [{"dynspec": {"protocol": 3}}]}),
            MalformedReplyError,
            "protocol version mismatch",
        ),
        (httpx.Response(503, text="overloaded"), ServerUnavailableError, "HTTP 503: overloaded"),
        (httpx.Response(404), MalformedReplyError, "HTTP 404"),
    ],
)
def test_bad_server_info_replies(reply, error, match):
    with client(lambda request: reply) as c, pytest.raises(error, match=match) as info:
        c.read_state()
    assert str(info.value).startswith(f"{ADDR}: ")
    assert info.value.server == ADDR


def test_second_replica_without_plugin_is_plugin_missing():
    good = dynspec(PluginCore((0, 1), started_at=1.0))
    body = {"internal_states": [{"dynspec": good}, {}]}
    with client(lambda r: httpx.Response(200, json=body)) as c:
        with pytest.raises(PluginMissingError, match=r"internal_states\[1\]"):
            c.read_state()
        # The raw object stays reachable for metrics-only mode.
        assert c.server_info() == body


def test_timeout_and_connection_refused_are_unavailable():
    def slow(request):
        raise httpx.ReadTimeout("timed out", request=request)

    def refused(request):
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with client(slow) as c, pytest.raises(ServerUnavailableError, match="timed out"):
        c.read_state()
    with client(refused) as c, pytest.raises(ServerUnavailableError, match="cannot reach"):
        c.push(((None, 1),), 1)


def test_timeout_is_explicit_and_enforced_on_a_real_socket():
    # A listening socket that never answers: the tiny read timeout must fire, not hang.
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        with SGLangClient(f"127.0.0.1:{port}", timeout=httpx.Timeout(1.0, read=1e-3)) as c:
            with pytest.raises(ServerUnavailableError, match="timed out"):
                c.read_state()


def test_push_reply_shapes():
    with client(lambda r: httpx.Response(422, json={"detail": "bad"})) as c:
        with pytest.raises(UpdateRejectedError, match="HTTP 422"):
            c.push(((None, 1),), 1)
    with client(lambda r: httpx.Response(200, json={"updated": True})) as c:
        with pytest.raises(MalformedReplyError, match="not a list of booleans"):
            c.push(((None, 1),), 1)
    with client(lambda r: httpx.Response(500)) as c:
        with pytest.raises(ServerUnavailableError, match="HTTP 500"):
            c.push(((None, 1),), 1)


def test_metrics_and_loads_raw():
    def handler(request):
        if request.url.path == "/metrics":
            return httpx.Response(200, text="sglang:num_running_reqs 3\n")
        return httpx.Response(404)

    with client(handler) as c:
        assert "num_running_reqs" in c.metrics_text()
        assert c.loads() is None


def test_address_forms():
    assert SGLangClient("localhost:30000").address == "localhost:30000"
    assert SGLangClient("http://h:1/").address == "h:1"
    assert SGLangClient("https://h:443").address == "https://h:443"

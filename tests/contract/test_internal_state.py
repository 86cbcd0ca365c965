"""Updates and readout through SGLang's own ``SchedulerInternalStateController`` (hooked by
``load_plugins``), with requests validated as SGLang's HTTP layer validates them."""

from __future__ import annotations

import pytest
from _contract_env import fake_scheduler, need, spec_worker, write_config

need()

import msgspec  # noqa: E402
import pydantic  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SetInternalStateReq,
)
from sglang.srt.managers.scheduler_components.internal_state import (  # noqa: E402
    SchedulerInternalStateController,
)
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.speculative import adaptive_spec_params as asp  # noqa: E402

from tuner.plugin.launch import adaptive_config  # noqa: E402
from tuner.protocol import DynspecState, encode_update  # noqa: E402

pytestmark = pytest.mark.contract

ARMS = [0, 1, 3, 5]
START = ((None, 3),)
TABLE = ((8, 5), (64, 1), (None, 0))
THRESHOLD = "speculative_accept_threshold_single"


def http_request(server_args: dict) -> SetInternalStateReq:
    """The body as FastAPI turns it into the request struct (pydantic; a 422 on failure)."""
    return pydantic.TypeAdapter(SetInternalStateReq).validate_python({"server_args": server_args})


def over_ipc(req: SetInternalStateReq) -> SetInternalStateReq:
    """Through the msgpack encoding the tokenizer manager and scheduler speak."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=SetInternalStateReq)


@pytest.fixture
def server(sglang_plugin, published, tmp_path):
    policy = asp.AdaptiveSpeculativeParams(
        initial_steps=3, cfg_path=write_config(tmp_path, adaptive_config(ARMS))
    )
    worker = spec_worker(policy, initial_steps=3, graph_bs=[1, 2, 4, 8, 16, 32, 64, 128])
    controller = SchedulerInternalStateController(fake_scheduler(worker), record_step_time=False)
    return controller, policy.dynspec, worker


def send(controller, server_args: dict) -> bool:
    out = controller.set_internal_state(over_ipc(http_request(server_args)))
    return out.updated


def threshold() -> float:
    return get_context().resolved_server_args_dict()[THRESHOLD]


def test_a_valid_update_applies_atomically_and_drives_the_next_launch(server):
    controller, core, worker = server
    assert send(controller, encode_update(TABLE, 1)) is True
    assert (core.table, core.version, core.updates_applied) == (TABLE, 1, 1)
    for b, k in ((8, 5), (9, 1), (64, 1), (65, 0)):
        worker.activate_step_by_batch(b)
        assert worker.speculative_num_steps == k


def test_a_probe_runs_its_arm_for_its_launches_then_the_table(server):
    controller, core, worker = server
    probes = [(9, 64, 5, 3)]
    assert send(controller, encode_update(TABLE, 1, probes=probes)) is True
    assert core.table == TABLE
    ran = []
    for b in (4, 9, 32, 8, 64, 64, 65):
        worker.activate_step_by_batch(b)
        ran.append(worker.speculative_num_steps)
        if b == 9:  # SGLang's readout shows the live probe, one launch spent
            assert readout(controller).probes == ((9, 64, 5, 2),)
    # b = 4 and 8 lie outside the probe; its three launches run k = 5, then the table's 1.
    assert ran == [5, 5, 5, 5, 5, 1, 0]
    assert core.probes == [] and readout(controller).probes == ()
    bad = {**encode_update(TABLE, 2, probes=probes), "dynspec_p0_k": 7}
    assert send(controller, bad) is False  # an unbuilt probe arm: refused, nothing changes
    assert (core.version, core.updates_rejected) == (1, 1)


def _drop(key):
    return lambda d: {k: v for k, v in d.items() if k != key}


INVALID = {
    "no protocol": _drop("dynspec_protocol"),
    "protocol 3": lambda d: {**d, "dynspec_protocol": 3},
    "stale version": lambda d: {**d, "dynspec_version": 1},
    "version zero": lambda d: {**d, "dynspec_version": 0},
    "row count too high": lambda d: {**d, "dynspec_rows": 4},
    "row count too low": lambda d: {**d, "dynspec_rows": 2},
    "missing row key": _drop("dynspec_r1_k"),
    "stray key": lambda d: {**d, "dynspec_r7_k": 1},
    "unbuilt arm": lambda d: {**d, "dynspec_r0_k": 7},
    "negative arm": lambda d: {**d, "dynspec_r0_k": -1},
    "fractional arm": lambda d: {**d, "dynspec_r0_k": 2.5},
    "bounds not increasing": lambda d: {**d, "dynspec_r1_max_bs": 4},
    "bounded last row": lambda d: {**d, "dynspec_r2_max_bs": 512},
    "unbounded middle row": lambda d: {**d, "dynspec_r1_max_bs": -1},
    "zero bound": lambda d: {**d, "dynspec_r0_max_bs": 0},
}


@pytest.mark.parametrize("kind", sorted(INVALID))
def test_each_invalid_update_changes_nothing_and_is_counted(server, kind):
    controller, core, worker = server
    assert send(controller, encode_update(TABLE, 1))
    before = (core.table, core.version, core._index)
    flat = INVALID[kind](encode_update(((4, 5), (16, 3), (None, 1)), 2))
    assert send(controller, flat) is False
    assert (core.table, core.version, core._index) == before
    assert (core.updates_applied, core.updates_rejected) == (1, 1)
    assert core.last_rejection
    state = readout(controller)
    assert (state.updates_rejected, state.last_rejection) == (1, core.last_rejection)


def test_a_nested_table_never_reaches_the_scheduler():
    with pytest.raises(pydantic.ValidationError):
        http_request({"dynspec_policy": {"table": [[8, 5], [None, 1]]}})


def test_mixed_with_a_builtin_key_both_apply(server):
    controller, core, _ = server
    assert threshold() != 0.5
    assert send(controller, {**encode_update(TABLE, 1), THRESHOLD: 0.5}) is True
    assert core.table == TABLE and threshold() == 0.5


def test_mixed_with_a_refused_builtin_key_applies_neither(server):
    controller, core, _ = server
    assert send(controller, {**encode_update(TABLE, 1), "no_such_knob": 1}) is False
    assert (core.table, core.version, core.updates_rejected) == (START, 0, 1)
    assert "no_such_knob" in core.last_rejection
    # A builtin SGLang validates and refuses (pp_max_micro_batch_size must be >= 1).
    assert send(controller, {**encode_update(TABLE, 1), "pp_max_micro_batch_size": 0}) is False
    assert (core.table, core.updates_rejected) == (START, 2)


def test_an_invalid_table_keeps_sglang_from_applying_its_builtin_key(server):
    controller, core, _ = server
    before = threshold()
    assert send(controller, {**encode_update(((None, 7),), 1), THRESHOLD: 0.5}) is False
    assert threshold() == before and core.table == START


def test_builtin_keys_alone_pass_to_sglang_untouched(server):
    controller, core, _ = server
    assert send(controller, {THRESHOLD: 0.25}) is True and threshold() == 0.25
    assert send(controller, {"no_such_knob": 1}) is False
    assert (core.updates_applied, core.updates_rejected) == (0, 0)


def readout(controller) -> DynspecState:
    out = controller.get_internal_state(GetInternalStateReq())
    # The reply crosses ZMQ as msgpack before /server_info serves it.
    out = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=GetInternalStateReqOutput)
    assert "speculative_algorithm" in out.internal_state  # SGLang's own readout is intact
    return DynspecState.from_json(out.internal_state["dynspec"])


def test_readout_has_the_dynspec_section(server):
    controller, core, _ = server
    state = readout(controller)
    assert state.hooks_live and state.reason is None
    assert (state.arms, state.table, state.policy_version) == (tuple(ARMS), START, 0)
    assert send(controller, encode_update(TABLE, 4))
    core.record_decode(2, 5, 8, 6, 10.0, 1)
    core.record_decode(2, 5, 8, 6, 10.02, 2)
    state = readout(controller)
    assert (state.table, state.policy_version, state.updates_applied) == (TABLE, 4, 1)
    [row] = state.counters
    assert (row.b, row.k, row.decode_steps, row.emitted_tokens, row.drafted_tokens) == (
        2, 5, 1, 8, 10
    )
    assert row.busy_s == 0.02  # to the microsecond, not 0.019999999999999574


def test_a_failing_hook_answers_false_and_never_raises(server, monkeypatch):
    controller, core, _ = server

    def broken(_args):
        raise RuntimeError("boom")

    monkeypatch.setattr(core, "check_update", broken)
    assert send(controller, encode_update(TABLE, 1)) is False
    assert core.table == START
    out = controller.get_internal_state(GetInternalStateReq()).internal_state["dynspec"]
    assert out["hook_errors"]["update"] >= 1


# --- servers where the plugin must stay out of the way ---------------------------------------


@pytest.fixture
def stock(sglang_plugin):
    return lambda worker=None, algorithm="EAGLE3": SchedulerInternalStateController(
        fake_scheduler(worker, algorithm=algorithm), record_step_time=False
    )


def test_without_speculative_decoding_the_readout_says_why(stock, sglang_plugin):
    from _contract_env import publish

    with publish(speculative_algorithm=None, speculative_adaptive=False,
                 speculative_num_steps=None, speculative_eagle_topk=None):
        controller = stock(algorithm="NONE")
        rejected = sglang_plugin._RT.stock_rejected
        assert send(controller, encode_update(TABLE, 1)) is False
        state = readout(controller)
    assert not state.hooks_live
    assert "dynspec needs EAGLE or EAGLE3" in state.reason
    assert (state.arms, state.table) == ((0,), ((None, 0),))
    assert state.updates_rejected == rejected + 1


def test_when_sglang_refused_adaptive_the_readout_gives_sglangs_reason(stock):
    from _contract_env import publish

    class StaticWorker:  # EAGLEWorkerV2 without adaptive: adaptive_controller is None
        adaptive_controller = None
        graph_memory_usage = {"draft_decode": 0.0}

    # SGLang's resolution turns adaptive off when it refuses, keeping the user's topk.
    with publish(speculative_adaptive=False, speculative_eagle_topk=4, speculative_num_steps=3):
        controller = stock(StaticWorker())
        state = readout(controller)
        assert send(controller, {THRESHOLD: 0.75}) is True  # SGLang's own keys still work
    assert not state.hooks_live
    assert "SGLang refused adaptive speculative decoding" in state.reason
    assert "speculative_eagle_topk=4" in state.reason
    assert state.table == ((None, 3),)

"""The plugin's pure core: table lookup, atomic updates, telemetry as protocol v1 defines it."""

from __future__ import annotations

import pytest

from tuner.plugin.core import MAX_STEP_GAP_S, PluginCore, Telemetry
from tuner.protocol import CounterRow, DynspecState, ProtocolError, encode_update

ARMS = (0, 1, 3, 5)


def _core(**kw) -> PluginCore:
    return PluginCore(ARMS, started_at=1000.0, **kw)


def test_default_table_uses_the_largest_arm():
    core = _core()
    assert core.table == ((None, 5),)
    assert core.steps_for_batch(1) == core.steps_for_batch(500) == 5
    assert _core(default_arm=0).steps_for_batch(7) == 0


def test_bad_construction():
    with pytest.raises(ValueError, match="non-empty"):
        PluginCore((), started_at=0)
    with pytest.raises(ValueError, match="not among arms"):
        PluginCore(ARMS, started_at=0, default_arm=2)


def test_apply_update_switches_the_table():
    core = _core()
    ok, why = core.apply_update(encode_update(((8, 5), (64, 3), (None, 1)), 1))
    assert (ok, why) == (True, None)
    assert [core.steps_for_batch(b) for b in (1, 8, 9, 64, 65)] == [5, 5, 3, 3, 1]
    assert core.version == 1 and core.updates_applied == 1


@pytest.mark.parametrize(
    "update",
    [
        encode_update(((8, 2), (None, 1)), 5),  # k=2 not built
        encode_update(((8, 5), (None, 1)), 0 + 1) | {"dynspec_protocol": 9},
        {"dynspec_version": 5},
        {"dynspec_protocol": 1, "dynspec_version": "x", "dynspec_rows": 1},
        {
            "dynspec_protocol": 1,
            "dynspec_version": 5,
            "dynspec_rows": 1,
            "dynspec_r0_max_bs": {},
            "dynspec_r0_k": 1,
        },
        None,
        [1, 2, 3],
        {("weird",): 1},
    ],
)
def test_a_rejected_update_changes_nothing(update):
    core = _core()
    assert core.apply_update(encode_update(((16, 3), (None, 1)), 4))[0]
    before = (core.table, core.version, core.updates_applied)
    ok, why = core.apply_update(update)  # type: ignore[arg-type]
    assert not ok and why
    assert (core.table, core.version, core.updates_applied) == before
    assert core.updates_rejected == 1 and core.last_rejection == why
    assert core.readout()["last_rejection"] == why


def test_version_must_grow():
    core = _core()
    assert core.apply_update(encode_update(((None, 1),), 3))[0]
    ok, why = core.apply_update(encode_update(((None, 0),), 3))
    assert not ok and "not greater" in why
    assert core.steps_for_batch(4) == 1


def test_install_validates():
    core = _core()
    core.install(((4, 5), (None, 0)), 2)
    assert core.version == 2 and core.steps_for_batch(5) == 0
    with pytest.raises(ProtocolError):
        core.install(((None, 7),), 3)
    with pytest.raises(ProtocolError):
        core.install(((None, 1),), -1)



def test_a_policy_file_installs_its_bands_only_where_the_core_decides_per_band():
    from tuner.policyfile import PolicyFile
    from tuner.protocol import TreeShape

    bands = ((4, (5, 1, 3, 5, 5)), (None, (0, 0, 0, 0, 0)))
    pf = PolicyFile(table=((4, 5), (None, 0)), arms=ARMS, policy_version=6, bands=bands)
    v2, v1 = _core(), _core(protocol=1)
    tree = PluginCore((0, 2), started_at=1.0, tree=TreeShape(4, 2, 3))
    v2.install_file(pf)
    v1.install_file(pf)
    assert v2.band_table == bands and v2.version == 6
    assert v1.band_table == ((4, (5,) * 5), (None, (0,) * 5)) and v1.version == 6
    with pytest.raises(ProtocolError, match="no acceptance bands"):
        tree.install(((None, 2, 0, 2, 2, 2),), 1)
    tree.install_file(PolicyFile(table=((None, 2),), arms=(0, 2),
                                 bands=((None, (2, 0, 2, 2, 2)),)))
    assert tree.table == ((None, 2),)


# --- telemetry --------------------------------------------------------------------------------


def test_busy_time_is_attributed_one_step_late_to_the_launched_arm():
    tel = Telemetry()
    tel.record(b=4, k=5, emitted=14, accepted=10, launch_ts=10.000, forward_iter=7)
    assert tel.rows() == ()  # duration unknown until the next launch
    tel.record(b=4, k=3, emitted=11, accepted=7, launch_ts=10.012, forward_iter=8)
    (row,) = tel.rows()
    assert (row.b, row.k, row.decode_steps, row.emitted_tokens, row.accepted_drafts) == (
        4,
        5,
        1,
        14,
        10,
    )
    assert row.drafted_tokens == 20
    assert row.busy_s == pytest.approx(0.012)
    tel.record(b=5, k=3, emitted=9, accepted=4, launch_ts=10.020, forward_iter=9)
    rows = {(r.b, r.k): r for r in tel.rows()}
    assert rows[(4, 3)].busy_s == pytest.approx(0.008)
    assert rows[(4, 3)].drafted_tokens == 12
    assert tel.untimed_steps == 0


def test_steps_without_a_contiguous_successor_are_untimed():
    tel = Telemetry()
    tel.record(2, 1, 3, 1, launch_ts=1.0, forward_iter=1)
    tel.record(2, 1, 3, 1, launch_ts=1.01, forward_iter=3)  # a prefill ran in between
    tel.record(2, 1, 3, 1, launch_ts=1.01 + MAX_STEP_GAP_S + 0.5, forward_iter=4)  # idle gap
    tel.record(2, 1, 3, 1, launch_ts=0.5, forward_iter=5)  # clock went backwards
    tel.record(2, 1, 3, 1, launch_ts=0.51, forward_iter=6)
    assert tel.untimed_steps == 3
    (row,) = tel.rows()
    assert row.decode_steps == 1 and row.busy_s == pytest.approx(0.01)


def test_rows_accumulate_and_read_out_in_protocol_shape():
    core = _core()
    t = 0.0
    for i in range(10):
        core.record_decode(8, 3, 20, 12, t, i)
        t += 0.01
    state = DynspecState.from_json(core.readout())
    assert state.counters == (CounterRow(8, 3, 9, 180, 108, 216, pytest.approx(0.09)),)
    assert state.started_at == 1000.0 and state.arms == ARMS
    assert core.state(hooks_live=False, reason="hook failed").to_json()["reason"] == "hook failed"


def test_a_prefill_launch_times_the_decode_step_before_it():
    t = Telemetry()
    t.record(4, 3, 10, 6, launch_ts=1.0, forward_iter=1)
    t.close(launch_ts=1.02, forward_iter=2)  # a prefill launched right after
    t.record(5, 3, 12, 7, launch_ts=1.05, forward_iter=3)
    (row,) = t.rows()
    assert (row.b, row.k, row.decode_steps, row.emitted_tokens) == (4, 3, 1, 10)
    assert row.busy_s == pytest.approx(0.02)
    assert t.untimed_steps == 0


def test_a_forward_after_an_idle_pass_leaves_the_step_untimed():
    t = Telemetry()
    t.record(4, 3, 10, 6, launch_ts=1.0, forward_iter=1)
    t.close(launch_ts=1.5, forward_iter=2, after_idle_gap=True)
    assert t.rows() == ()
    assert t.untimed_steps == 1

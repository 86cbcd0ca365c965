"""Probes (protocol v2): a range of batch sizes runs one arm for a number of decode launches,
then the table again. The wire keys, the plugin's countdown, and how a proposal is split."""

from __future__ import annotations

import pytest

from policies import PROBE_REQUEST_STEPS, probe_steps, split_probes
from tuner.plugin.core import PluginCore
from tuner.protocol import (
    MAX_PROBE_STEPS,
    DynspecState,
    ProtocolError,
    decode_probes,
    decode_update,
    encode_update,
    validate_probes,
)

ARMS = (0, 1, 3, 5)
TABLE = ((8, 3), (None, 1))


def _update(probes, version=1, protocol=2):
    return encode_update(TABLE, version, protocol=protocol, probes=probes)


# --- the wire ------------------------------------------------------------------------------


def test_probes_travel_as_flat_keys_and_back():
    probes = ((9, 16, 5, 20), (193, None, 0, 8))
    args = _update(probes)
    assert args["dynspec_probes"] == 2
    assert (args["dynspec_p1_min_bs"], args["dynspec_p1_max_bs"]) == (193, -1)
    assert decode_update(args, arms=ARMS, current_version=0)[1] == 1
    assert decode_probes(args, arms=ARMS) == probes
    assert decode_probes(encode_update(TABLE, 1), arms=ARMS) == ()  # none sent: none live


@pytest.mark.parametrize(
    ("probes", "match"),
    [
        ([(0, 4, 1, 8)], "1 <= lo <= hi"),
        ([(8, 4, 1, 8)], "1 <= lo <= hi"),
        ([(1, 8, 1, 8), (8, 16, 1, 8)], "overlaps"),
        ([(1, None, 1, 8), (9, 16, 1, 8)], "overlaps"),
        ([(1, 8, 7, 8)], "not a built arm"),
        ([(1, 8, 1, 0)], "steps must be in"),
        ([(1, 8, 1, MAX_PROBE_STEPS + 1)], "steps must be in"),
        ([(1, 8, 1)], r"must be \[lo, hi, k, steps\]"),
        ([(1, 8, True, 8)], "must be an integer"),
    ],
)
def test_bad_probes_are_refused_naming_the_rule(probes, match):
    with pytest.raises(ProtocolError, match=match):
        validate_probes(probes, ARMS)


def test_a_plugin_refuses_bad_probe_keys_and_changes_nothing():
    core = PluginCore(ARMS, started_at=0.0, table=TABLE)
    good = _update([(9, 16, 5, 20)])
    for args, match in [
        ({**good, "dynspec_p0_k": 7}, "not a built arm"),
        ({k: v for k, v in good.items() if k != "dynspec_p0_steps"}, "lacks dynspec_p0_steps"),
        ({**good, "dynspec_probes": 2}, "probe 1 lacks"),
        ({**good, "dynspec_p1_k": 1}, "unexpected keys"),
        ({**good, "dynspec_probes": 65}, "dynspec_probes must be in"),
        ({**good, "dynspec_protocol": 1}, "v1 update has no probes"),
    ]:
        ok, why = core.apply_update(args)
        assert not ok and match in why, (args, why)
    assert (core.version, core.probes, core.updates_rejected) == (0, [], 6)
    assert core.apply_update(good) == (True, None)


def test_probes_are_never_written_for_a_v1_plugin():
    with pytest.raises(ProtocolError, match="v1 plugin"):
        _update([(9, 16, 5, 20)], protocol=1)
    v1 = PluginCore(ARMS, started_at=0.0, table=TABLE, protocol=1)
    ok, why = v1.apply_update({**_update([(9, 16, 5, 20)])})
    assert not ok and "version mismatch" in why


# --- the plugin ----------------------------------------------------------------------------


def test_a_probe_runs_its_arm_for_its_steps_in_its_range_then_the_table():
    core = PluginCore(ARMS, started_at=0.0, table=TABLE)
    assert core.apply_update(_update([(9, 16, 5, 3)]))[0]
    assert [core.steps_for_batch(4) for _ in range(2)] == [3, 3]  # outside: the table
    assert [core.steps_for_batch(12) for _ in range(4)] == [5, 5, 5, 1]
    assert core.probes == []
    assert core.table == TABLE  # the table itself never changed


def test_a_probe_overrides_every_band_and_a_later_update_ends_it():
    banded = ((None, (3, 1, 3, 5, 5)),)
    core = PluginCore(ARMS, started_at=0.0)
    assert core.apply_update(encode_update(banded, 1, probes=[(1, None, 0, 100)]))[0]
    for band in range(5):
        core.acceptance.band = band
        assert core.steps_for_batch(64) == 0
    assert core.apply_update(encode_update(banded, 2))[0]  # no probes: none live
    assert core.probes == []
    assert [core.ks_for(64)[b] for b in range(5)] == [3, 1, 3, 5, 5]


def test_the_readout_shows_live_probes_with_their_steps_left():
    core = PluginCore(ARMS, started_at=0.0, table=TABLE)
    assert core.apply_update(_update([(2, 4, 5, 3), (9, None, 0, 10)]))[0]
    core.steps_for_batch(3)
    out = core.readout()
    assert out["probes"] == [[2, 4, 5, 2], [9, -1, 0, 10]]
    assert DynspecState.from_json(out).probes == ((2, 4, 5, 2), (9, None, 0, 10))
    assert DynspecState.from_json(out) == core.state()
    core.steps_for_batch(3)
    core.steps_for_batch(4)  # the first probe's last step: it is gone
    assert core.readout()["probes"] == [[9, -1, 0, 10]]
    assert core.apply_update(_update([], version=2))[0]
    assert "probes" not in core.readout()  # none live: omitted, as before probes existed
    # A v1 readout never carries them.
    assert "probes" not in PluginCore(ARMS, started_at=0.0, protocol=1).readout()


@pytest.mark.parametrize("bad", [{"x": 1}, [[1, 2, 9, 5]], [[4, 2, 1, 5]], [[1, 2, 1, 0]]])
def test_a_readout_with_malformed_probes_is_refused(bad):
    out = PluginCore(ARMS, started_at=0.0).readout()
    out["probes"] = bad
    with pytest.raises(ProtocolError, match="probe"):
        DynspecState.from_json(out)


def test_every_rank_spends_a_probe_on_the_same_launches():
    # Ranks see the same launches in the same order; the countdown depends on nothing else.
    ranks = [PluginCore(ARMS, started_at=float(r), table=TABLE) for r in range(4)]
    for core in ranks:
        assert core.apply_update(_update([(1, 8, 0, 5), (9, None, 5, 7)]))[0]
    launches = [1, 9, 9, 3, 200, 8, 8, 2, 40, 40, 40, 40, 1, 1, 1]
    runs = [[core.steps_for_batch(b) for b in launches] for core in ranks]
    assert all(r == runs[0] for r in runs)
    assert runs[0] == [0, 5, 5, 0, 5, 0, 0, 0, 5, 5, 5, 5, 3, 3, 3]
    assert ranks[0].probes == [] and ranks[0].steps_for_batch(40) == 1


# --- splitting a proposal ------------------------------------------------------------------


def test_an_exploring_row_becomes_a_probe_over_the_greedy_row():
    greedy = ((8, (3, 1, 3, 5, 5)), (128, (1, 0, 1, 1, 3)), (None, (0,) * 5))
    proposed = ((8, (3, 1, 3, 5, 5)), (96, (1, 0, 1, 1, 3)), (128, (5,) * 5), (None, (0,) * 5))
    table, probes = split_probes(proposed, greedy)
    assert table == greedy
    assert probes == ((97, 128, 5, probe_steps(97)),)
    assert probe_steps(97) == max(8, -(-PROBE_REQUEST_STEPS // 97)) == 11


def test_a_band_difference_stays_in_the_table_and_v1_rows_are_read_as_uniform():
    greedy = ((16, 3), (None, 1))
    proposed = ((16, (3, 1, 3, 3, 5)), (None, 0))
    table, probes = split_probes(proposed, greedy)
    assert table == ((16, (3, 1, 3, 3, 5)), (None, (1,) * 5))
    assert probes == ((17, None, 0, probe_steps(17)),)
    assert split_probes(greedy, greedy) == (greedy, ())
    assert split_probes(((16, 3), (None, 5)), greedy) == (greedy, ((17, None, 5, 61),))


def test_probe_length_is_the_dwell_at_large_batches_and_longer_below():
    assert probe_steps(193) == probe_steps(257) == 8
    assert probe_steps(1) == PROBE_REQUEST_STEPS
    assert probe_steps(25) == 41
    assert probe_steps(500, min_steps=12) == 12

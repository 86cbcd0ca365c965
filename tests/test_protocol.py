"""Wire protocol: table rules, the flat update encoding, the readout, lookup (v1 rules, which
v2 keeps; tests/test_protocol_v2.py has what v2 adds)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuner.protocol import (
    MAX_ROWS,
    PROTOCOL_VERSION,
    CounterRow,
    DynspecState,
    ProtocolError,
    TableIndex,
    banded,
    counter_deltas,
    decode_update,
    encode_update,
    format_table,
    has_dynspec_keys,
    lookup,
    table_from_json,
    table_to_json,
    validate_table,
)

ARMS = (0, 1, 3, 5)


# --- validate_table: every rule ---------------------------------------------------------------


def test_valid_table_is_canonicalised():
    assert validate_table([[8, 5], [64.0, 3], [-1, 1]], ARMS) == ((8, 5), (64, 3), (None, 1))
    assert validate_table([(None, 0)]) == ((None, 0),)


@pytest.mark.parametrize(
    "rows, rule",
    [
        ([], "at least one row"),
        ([[1, 1]] * (MAX_ROWS + 1), "at most"),
        ([[8, 5, 1], [None, 1]], "must be [max_batch_size, k]"),
        ([[None, 5], [None, 1]], "only the last row may be unbounded"),
        ([[8, 5], [-1, 3], [None, 1]], "only the last row may be unbounded"),
        ([[8, 5], [64, 1]], "last row must be unbounded"),
        ([[8, 5], [8, 3], [None, 1]], "strictly increasing"),
        ([[8, 5], [4, 3], [None, 1]], "strictly increasing"),
        ([[0, 5], [None, 1]], "strictly increasing"),
        ([[-3, 5], [None, 1]], "strictly increasing"),
        ([[8.5, 5], [None, 1]], "max_batch_size must be an integer"),
        ([["8", 5], [None, 1]], "max_batch_size must be an integer"),
        ([[True, 5], [None, 1]], "max_batch_size must be an integer"),
        ([[8, 2], [None, 1]], "not a built arm"),
        ([[8, -1], [None, 1]], "k must be >= 0"),
        ([[8, 1.5], [None, 1]], "k must be an integer"),
        ([[8, None], [None, 1]], "k must be an integer"),
        ([[8, math.nan], [None, 1]], "k must be an integer"),
        (5, "must be a list"),
    ],
)
def test_invalid_tables_name_the_rule(rows, rule):
    with pytest.raises(ProtocolError, match=rule.replace("[", r"\[").replace("]", r"\]")):
        validate_table(rows, ARMS)


def test_arms_unchecked_when_not_given():
    assert validate_table([[None, 7]]) == ((None, 7),)


def test_table_from_json_needs_a_list():
    with pytest.raises(ProtocolError, match="JSON list"):
        table_from_json({"rows": []})
    assert table_from_json([[2, 1], [None, 0]], ARMS) == ((2, 1), (None, 0))


def test_json_round_trip_and_format():
    t = ((8, 5), (64, 3), (None, 1))
    assert table_from_json(table_to_json(t)) == t
    assert format_table(t) == "b<=8:k5 b<=64:k3 rest:k1"


# --- lookup -----------------------------------------------------------------------------------


def test_lookup_bounds_are_inclusive():
    t = ((8, 5), (64, 3), (None, 1))
    assert [lookup(t, b) for b in (1, 8, 9, 64, 65, 10_000)] == [5, 5, 3, 3, 1, 1]
    idx = TableIndex(t)
    assert [idx(b) for b in (1, 8, 9, 64, 65, 10_000)] == [5, 5, 3, 3, 1, 1]


@given(
    bounds=st.lists(st.integers(1, 600), min_size=0, max_size=12, unique=True),
    arms=st.lists(st.sampled_from(ARMS), min_size=13, max_size=13),
    b=st.integers(1, 1000),
)
def test_table_index_agrees_with_lookup(bounds, arms, b):
    bounds = sorted(bounds)
    table = validate_table([*zip(bounds, arms, strict=False), (None, arms[len(bounds)])], ARMS)
    assert TableIndex(table)(b) == lookup(table, b)


# --- the flat update --------------------------------------------------------------------------


def test_encode_update_is_flat_numbers():
    flat = encode_update(((8, 5), (64, 3), (None, 1)), 8)
    assert flat == {
        "dynspec_protocol": PROTOCOL_VERSION,
        "dynspec_version": 8,
        "dynspec_rows": 3,
        "dynspec_r0_max_bs": 8,
        "dynspec_r0_k": 5,
        "dynspec_r1_max_bs": 64,
        "dynspec_r1_k": 3,
        "dynspec_r2_max_bs": -1,
        "dynspec_r2_k": 1,
    }
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in flat.values())


def test_encode_update_refuses_bad_input():
    with pytest.raises(ProtocolError, match="version must be >= 1"):
        encode_update(((None, 1),), 0)
    with pytest.raises(ProtocolError, match="last row must be unbounded"):
        encode_update(((8, 1),), 1)


def test_decode_round_trip_ignores_foreign_keys():
    flat = encode_update(((8, 5), (None, 1)), 3)
    flat["speculative_accept_threshold_single"] = 0.5
    assert decode_update(flat, arms=ARMS, current_version=2) == (banded(((8, 5), (None, 1))), 3)
    assert has_dynspec_keys(flat)
    assert not has_dynspec_keys({"speculative_accept_threshold_single": 1})


def _flat(**over):
    flat = encode_update(((8, 5), (None, 1)), 3)
    flat.update(over)
    return {k: v for k, v in flat.items() if v is not None}


@pytest.mark.parametrize(
    "flat, rule",
    [
        (_flat(dynspec_protocol=None), "dynspec_protocol is missing"),
        (_flat(dynspec_protocol=3), "protocol version mismatch"),
        (_flat(dynspec_protocol=True), "dynspec_protocol must be an integer"),
        (_flat(dynspec_version=None), "dynspec_version is missing"),
        (_flat(dynspec_rows=None), "dynspec_rows is missing"),
        (_flat(dynspec_version=2), "not greater than the current version"),
        (_flat(dynspec_version=1), "not greater than the current version"),
        (_flat(dynspec_version=3.5), "dynspec_version must be an integer"),
        (_flat(dynspec_rows=0), "dynspec_rows must be in 1"),
        (_flat(dynspec_rows=MAX_ROWS + 1), "dynspec_rows must be in 1"),
        (_flat(dynspec_rows=3), "row 2 is missing"),
        (_flat(dynspec_r1_k=None), "row 1 is missing"),
        (_flat(dynspec_rows=1), "unexpected keys"),
        (_flat(dynspec_r5_k=1), "unexpected keys"),
        (_flat(dynspec_r0_k=2), "not a built arm"),
        (_flat(dynspec_r1_max_bs=64), "last row must be unbounded"),
        (_flat(dynspec_r0_max_bs=-1), "only the last row may be unbounded"),
    ],
)
def test_decode_update_rules(flat, rule):
    with pytest.raises(ProtocolError, match=rule):
        decode_update(flat, arms=ARMS, current_version=2)


def test_decode_update_needs_a_mapping():
    with pytest.raises(ProtocolError, match="server_args must be an object"):
        decode_update([("dynspec_protocol", 1)], arms=ARMS, current_version=0)  # type: ignore[arg-type]


# --- the readout ------------------------------------------------------------------------------


def _state_json(**over):
    obj = {
        "protocol": 1,
        "arms": [0, 1, 3, 5],
        "policy_version": 7,
        "table": [[8, 5], [64, 3], [None, 1]],
        "counters": [[8, 5, 10, 250, 170, 400, 0.07], [48, 1, 3, 250, 106, 144, 0.025]],
        "started_at": 1764400000.0,
        "updates_applied": 7,
        "updates_rejected": 1,
        "hooks_live": True,
    }
    obj.update(over)
    return obj


def test_state_round_trip():
    st_ = DynspecState.from_json(_state_json(untimed_steps=4, last_rejection="why"))
    assert st_.arms == ARMS
    assert st_.table == ((8, 5), (64, 3), (None, 1))
    assert st_.counters[0] == CounterRow(8, 5, 10, 250, 170, 400, 0.07)
    assert st_.untimed_steps == 4 and st_.last_rejection == "why"
    assert DynspecState.from_json(st_.to_json()) == st_


@pytest.mark.parametrize(
    "over, rule",
    [
        ({"protocol": 3}, "protocol version mismatch"),
        ({"arms": []}, "arms must be a non-empty list"),
        ({"arms": [-1, 1]}, "arms must be >= 0"),
        ({"table": [[8, 7], [None, 1]]}, "not a built arm"),
        ({"counters": {}}, "counters must be a list"),
        ({"counters": [[8, 5, 1]]}, "counter row must have 7 numbers"),
        ({"counters": [[8, 5, 1, 2, 1, 5, -0.1]]}, "negative value"),
        ({"counters": [[8, 5, 1, -2, 1, 5, 0.1]]}, "negative value"),
        ({"counters": [[0, 5, 1, 2, 1, 5, 0.1]]}, "batch size must be >= 1"),
        ({"counters": [[8, 5, 1, 2, 1, 5, "x"]]}, "busy_s must be a finite number"),
        ({"counters": [[8, 5, 1, 2, 1, 5, math.inf]]}, "busy_s must be a finite number"),
        ({"counters": [[8, 5, 1.5, 2, 1, 5, 0.1]]}, "must be an integer"),
        ({"started_at": "yesterday"}, "started_at must be a number"),
        ({"policy_version": -1}, "policy_version must be >= 0"),
        ({"hooks_live": "false"}, "hooks_live must be true or false"),
    ],
)
def test_state_rules(over, rule):
    with pytest.raises(ProtocolError, match=rule):
        DynspecState.from_json(_state_json(**over))


@pytest.mark.parametrize(
    "field", ["protocol", "arms", "policy_version", "table", "counters", "started_at"]
)
def test_state_missing_field_is_named(field):
    obj = _state_json()
    del obj[field]
    with pytest.raises(ProtocolError, match=f"lacks field '{field}'"):
        DynspecState.from_json(obj)


def test_state_must_be_an_object():
    with pytest.raises(ProtocolError, match="must be an object"):
        DynspecState.from_json([1, 2])


def test_counter_deltas_between_two_readings():
    before = (CounterRow(4, 3, 10, 100, 60, 120, 0.5), CounterRow(8, 1, 5, 60, 20, 40, 0.2))
    after = (
        CounterRow(4, 3, 15, 150, 90, 180, 0.75),
        CounterRow(8, 1, 5, 60, 20, 40, 0.2),  # no new steps: left out
        CounterRow(16, 0, 2, 32, 0, 0, 0.1),  # first seen: all of it is new
    )
    assert counter_deltas(before, after) == (
        CounterRow(4, 3, 5, 50, 30, 60, 0.25),
        CounterRow(16, 0, 2, 32, 0, 0, 0.1),
    )


def test_counter_deltas_refuse_a_restart():
    before = (CounterRow(4, 3, 10, 100, 60, 120, 0.5),)
    assert counter_deltas(before, (CounterRow(4, 3, 2, 20, 12, 24, 0.1),)) is None
    assert counter_deltas(before, ()) is None  # a row vanished


# --- protocol v2: banded tables, banded updates, the bounded readout ------------------------

from tuner.protocol import (  # noqa: E402
    BAND_EDGES,
    N_BANDS,
    N_CLASSES,
    UNKNOWN_BAND,
    COUNTED_MAX_BATCH,
    DEPTH_EVERY,
    BandCounter,
    BandIndex,
    DepthCounter,
    band_agnostic,
    band_counter_deltas,
    band_of,
    class_of,
    class_range,
    format_band_table,
    validate_band_table,
)

BANDED = validate_band_table([[8, 5, 1, 3, 5, 5], [64, 3], [None, 1, 0, 1, 1, 3]], ARMS)


def test_bands_and_classes_partition_their_ranges():
    assert band_of(0.0) == 1 and band_of(1.0) == N_BANDS - 1
    assert [band_of(e) for e in BAND_EDGES] == list(range(2, N_BANDS))  # an edge opens a band
    assert [class_of(b) for b in (1, 2, 3, 4, 5, 256, 257, 10**6)] == [0, 1, 2, 2, 3, 12, 13, 13]
    for cls in range(N_CLASSES):
        lo, hi = class_range(cls)
        assert class_of(lo) == cls and (hi is None or (class_of(hi), class_of(hi + 1)) ==
                                        (cls, cls + 1))


def test_a_v1_table_is_a_banded_table_with_one_band():
    assert validate_band_table([[8, 5], [None, 1]], ARMS) == banded(((8, 5), (None, 1)))
    assert band_agnostic(BANDED) == ((8, 5), (64, 3), (None, 1))
    assert format_band_table(BANDED) == "b<=8:k5/1,3,5,5 b<=64:k3 rest:k1/0,1,1,3"


@pytest.mark.parametrize(
    "rows, rule",
    [
        ([[8, 5, 1, 3], [None, 1]], "must be \\[max_batch_size, k\\] or"),
        ([[8, 5, 1, 3, 5, 2], [None, 1]], "not a built arm"),
        ([[8, 5, 1, 3, 5, -1], [None, 1]], "k must be >= 0"),
        ([[8, 5, 1, 3, 5, True], [None, 1]], "band 4 k must be an integer"),
        # The unknown band would never draft again once the estimate went stale.
        ([[8, 0, 0, 0, 0, 1], [None, 1]], "unknown band must draft"),
        ([[8, 5], [4, 3], [None, 1]], "strictly increasing"),
    ],
)
def test_band_table_rules(rows, rule):
    with pytest.raises(ProtocolError, match=rule):
        validate_band_table(rows, ARMS)


def test_band_index_matches_lookup_on_every_band():
    index = BandIndex(BANDED)
    for b in (0, 1, 8, 9, 64, 65, 5000):
        for band in range(N_BANDS):
            row = next(ks for bound, ks in BANDED if bound is None or b <= bound)
            assert index(b, band) == row[band]
    # A bound beyond the flat part is found by bisect.
    far = BandIndex(validate_band_table([[10**6, 5], [None, 1]], ARMS))
    assert (far(10**6), far(10**6 + 1)) == (5, 1)


def test_banded_update_round_trips_and_a_v1_update_is_a_one_band_v2_update():
    flat = encode_update(BANDED, 4)
    assert flat["dynspec_protocol"] == 2 and flat["dynspec_r2_k4"] == 3
    assert decode_update(flat, arms=ARMS, current_version=3) == (BANDED, 4)
    v1 = encode_update(band_agnostic(BANDED), 4, protocol=1)
    assert v1["dynspec_protocol"] == 1 and not any("_k1" in key for key in v1)
    assert decode_update(v1, arms=ARMS, current_version=3) == (
        banded(band_agnostic(BANDED)), 4)


def test_banded_update_rules():
    with pytest.raises(ProtocolError, match="cannot be sent to a protocol v1 plugin"):
        encode_update(BANDED, 1, protocol=1)
    flat = encode_update(BANDED, 4)
    del flat["dynspec_r1_k3"]
    with pytest.raises(ProtocolError, match="row 1 lacks dynspec_r1_k3"):
        decode_update(flat, arms=ARMS, current_version=0)
    # Band keys in a v1 update are foreign to v1: refused, not half-read.
    v1 = {**encode_update(BANDED, 4), "dynspec_protocol": 1}
    with pytest.raises(ProtocolError, match="unexpected keys"):
        decode_update(v1, arms=ARMS, current_version=0)
    # A plugin that speaks only v1 refuses any v2 update.
    with pytest.raises(ProtocolError, match="this side speaks v1"):
        decode_update(encode_update(((None, 1),), 1), arms=ARMS, current_version=0,
                      accept=(1,))


def _day_state(days: float = 1.0, arms=(0, 1, 2, 3, 5, 7)) -> DynspecState:
    """The worst case: every batch size 1..256 at every arm in every band, counters at
    ``days`` of 50 decode steps/s spread evenly (the magnitude the issue measured v1 at)."""
    steps = int(86_400 * days * 50 // (256 * len(arms)))
    counters, bands = [], {}
    for b in range(1, 257):
        for k in arms:
            accepted = steps * b * (k // 2)
            busy = steps * (0.004 + 0.00003 * b + 0.0011 * k) + 1 / 3
            counters.append(CounterRow(b, k, steps, accepted + steps * b, accepted,
                                       k * b * steps, round(busy, 6)))
            for band in range(N_BANDS):
                key = (class_of(b), band, k)
                n, r, a, z = bands.get(key, (0, 0, 0, 0))
                share = steps // N_BANDS
                counted = k > 1 and band and b <= COUNTED_MAX_BATCH  # first-draft rejections
                bands[key] = (n + share, r + share * b, a + share * b * (k // 2),
                              z + (share * b // 4 if counted else 0))
    # How many drafts each request accepted, per chain arm: the plugin samples one forward in
    # DEPTH_EVERY, and counts its first COUNTED_MAX_BATCH requests.
    sampled = int(86_400 * days * 50 // DEPTH_EVERY) * COUNTED_MAX_BATCH // len(arms)
    depths = tuple(DepthCounter(k, tuple(sampled // (k + 1) for _ in range(k + 1)))
                   for k in arms if k >= 2)
    return DynspecState(
        arms=tuple(arms), policy_version=12, table=((8, 5), (64, 3), (None, 1)),
        counters=tuple(counters), started_at=1764400000.0, updates_applied=12,
        depths=depths,
        bands=tuple(BandCounter(*key, *v) for key, v in sorted(bands.items())),
        acceptance=(3, 0.734), band_table=validate_band_table(
            [[8, 5, 1, 3, 5, 7], [64, 3], [None, 1, 0, 1, 1, 3]], arms),
    )


@pytest.mark.parametrize("days", [1, 365])
def test_v2_readout_of_every_batch_size_arm_and_band_stays_within_32_kb(days):
    state = _day_state(days)
    text = json.dumps(state.to_json(), separators=(",", ":"))  # as /server_info (orjson)
    assert len(state.counters) == 256 * 6 and len(state.bands) == 13 * N_BANDS * 6
    assert len(text) <= 32 * 1024, f"{len(text) / 1024:.1f} KB after {days} days"
    back = DynspecState.from_json(json.loads(text))
    assert back.counters == state.counters and back.bands == state.bands
    assert back.depths == state.depths and len(state.depths) == 4
    assert (back.band_table, back.table, back.acceptance) == (
        state.band_table, state.table, state.acceptance)
    # The same state in v1 rows: what the bound replaces.
    v1 = json.dumps(replace(state, protocol=1).to_json(), separators=(",", ":"))
    assert len(v1) > 2 * len(text)


def test_v2_counters_derive_emitted_and_drafted_and_keep_integer_microseconds():
    state = DynspecState(arms=(0, 3), policy_version=0, table=((None, 3),), started_at=1.0,
                         counters=(CounterRow(2, 3, 10, 20 + 13, 13, 60, 0.0123456789),
                                   CounterRow(5, 0, 1, 5, 0, 0, 2.0)))
    raw = state.to_json()
    # Dense over b from 1, base-64 digits: 12346 us = 3*64^2 + 0*64 + 58 ("w").
    assert raw["counters"] == [[0, ";;;;1,0,7eI0"], [3, ";A,D,30w"]]
    back = DynspecState.from_json(raw)
    assert back.counters == (CounterRow(2, 3, 10, 33, 13, 60, 0.012346),
                             CounterRow(5, 0, 1, 5, 0, 0, 2.0))


@pytest.mark.parametrize(
    "counters, rule",
    [
        ({"k": 1}, "counters must be a list"),
        ([[1, "1,2"]], "must have 3 numbers"),
        ([[1, "1,2,*"]], "outside the digits"),
        ([[1, "1,2,1234567890"]], "1..9 digits"),
        ([[1, "1,2,3"], [1, "1,2,3"]], "negative or repeated"),
        ([[1, ";" * 70000]], "more than 65536 cells"),
        ([[1, 7]], "must be a string of cells"),
    ],
)
def test_v2_counter_rules(counters, rule):
    raw = {**_day_state(0.001).to_json(), "counters": counters}
    with pytest.raises(ProtocolError, match=rule):
        DynspecState.from_json(raw)


def test_v2_band_and_acceptance_rules():
    raw = _day_state(0.001).to_json()
    with pytest.raises(ProtocolError, match="out of range or repeated"):
        DynspecState.from_json({**raw, "bands": [[1, N_BANDS, "1,1,1"]]})
    with pytest.raises(ProtocolError, match="more than 14 classes"):
        DynspecState.from_json({**raw, "bands": [[1, 1, ";" * 14 + "1,1,1"]]})
    with pytest.raises(ProtocolError, match="0..1000 per mille"):
        DynspecState.from_json({**raw, "acceptance": [1, 1001]})
    assert DynspecState.from_json({**raw, "acceptance": [UNKNOWN_BAND, None]}).acceptance == (
        UNKNOWN_BAND, None)


def test_band_counter_deltas():
    a = (BandCounter(0, 1, 3, 5, 5, 7, 1),)
    b = (BandCounter(0, 1, 3, 8, 8, 9, 3), BandCounter(2, 4, 3, 1, 4, 12))
    assert band_counter_deltas(a, b) == (BandCounter(0, 1, 3, 3, 3, 2, 2), b[1])
    assert band_counter_deltas(b, a) is None  # a row vanished: another run
    assert band_counter_deltas(b, (BandCounter(0, 1, 3, 7, 8, 9), b[1])) is None
    assert band_counter_deltas(b, (BandCounter(0, 1, 3, 8, 8, 9, 2), b[1])) is None


def test_first_draft_rejections_ride_in_a_fourth_number_where_counted():
    counted = BandCounter(class_of(COUNTED_MAX_BATCH), 2, 3, 10, 300, 400, 45)
    above = BandCounter(class_of(COUNTED_MAX_BATCH + 1), 2, 3, 10, 400, 500)
    none_rejected = BandCounter(0, 2, 3, 4, 4, 12)
    assert (counted.first_counted, above.first_counted, none_rejected.first_counted) == (
        300, 0, 4)
    # k = 1 and the unknown band say nothing of the shape: nothing counted.
    assert BandCounter(0, 2, 1, 4, 4, 2).first_counted == 0
    assert BandCounter(0, UNKNOWN_BAND, 3, 4, 4, 2).first_counted == 0
    state = replace(_day_state(0.001), bands=(none_rejected, counted, above))
    raw = state.to_json()
    cells = {(k, band): text.split(";") for k, band, text in raw["bands"]}[(3, 2)]
    assert [len(c.split(",")) for c in cells if c] == [3, 4, 3]
    assert DynspecState.from_json(raw).bands == state.bands
    # A readout of three numbers a cell (a plugin before first_rejected) reads as 0.
    old = {**raw, "bands": [[3, 2, ";".join(",".join(c.split(",")[:3]) for c in cells)]]}
    assert [c.first_rejected for c in DynspecState.from_json(old).bands] == [0, 0, 0]
    with pytest.raises(ProtocolError, match="more first-draft rejections than requests"):
        DynspecState.from_json({**raw, "bands": [[3, 2, "1,2,3,3"]]})
    with pytest.raises(ProtocolError, match="must have 3 or 4 numbers"):
        DynspecState.from_json({**raw, "bands": [[3, 2, "1,2,3,1,1"]]})

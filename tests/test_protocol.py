"""Wire protocol v1: table rules, the flat update encoding, the readout, lookup."""

from __future__ import annotations

import math

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
    assert decode_update(flat, arms=ARMS, current_version=2) == (((8, 5), (None, 1)), 3)
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
        (_flat(dynspec_protocol=2), "protocol version mismatch"),
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
        ({"protocol": 2}, "protocol version mismatch"),
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

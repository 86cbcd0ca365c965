"""The dynspec policy file: round trips, provenance, and every way a file can be refused."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import ArmEstimate, Buckets, PolicySnapshot
from tuner import policyfile
from tuner.policyfile import DataWindow, Estimate, PolicyFile, PolicyFileError, Provenance
from tuner.protocol import ProtocolError

TABLE = ((8, 5), (64, 3), (None, 1))
ARMS = (0, 1, 3, 5)


def _policy(**kw) -> PolicyFile:
    base = dict(
        table=TABLE,
        arms=ARMS,
        policy_version=7,
        provenance=Provenance(
            server="http://127.0.0.1:30000",
            created_at=1764400000.0,
            tool_version="0.1.0",
            policy="thompson",
            buckets=(8, 64),
            data_window=DataWindow(start=1764390000.0, end=1764400000.0, observations=321),
            estimates=(Estimate(0, 5, 410.5, 12.0, 900), Estimate(2, 1, 3100.0, 40.0, 2000)),
        ),
    )
    base.update(kw)
    return PolicyFile(**base)


def test_save_then_load_gives_the_same_policy(tmp_path):
    path = policyfile.save(_policy(), tmp_path / "p.json")
    assert policyfile.load(path) == _policy()
    on_disk = json.loads(path.read_text())
    assert on_disk["format"] == "dynspec-policy" and on_disk["format_version"] == 1
    assert on_disk["table"] == [[8, 5], [64, 3], [None, 1]]


def test_save_is_atomic_and_readable_by_others(tmp_path):
    target = tmp_path / "p.json"
    target.write_text("old")
    policyfile.save(_policy(), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temp file left behind
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


def test_from_snapshot_takes_a_policy_snapshot(tmp_path):
    snap = PolicySnapshot(
        policy="ucb",
        buckets=Buckets((8, 64)),
        arms=ARMS,
        chosen=(5, 3, 1),
        estimates=(ArmEstimate(bucket=0, arm=5, estimate=400.0, std=5.0, n=10),),
    )
    pf = PolicyFile.from_snapshot(
        snap, table=TABLE, policy_version=3, server="s", data_window=DataWindow(observations=4)
    )
    assert pf.provenance.policy == "ucb" and pf.provenance.buckets == (8, 64)
    assert pf.provenance.estimates == (Estimate(0, 5, 400.0, 5.0, 10),)
    assert policyfile.load(policyfile.save(pf, tmp_path / "s.json")) == pf


def test_table_for_checks_a_servers_arms():
    pf = _policy()
    assert pf.table_for((0, 1, 3, 5, 7)) == TABLE
    with pytest.raises(ProtocolError, match="not a built arm"):
        pf.table_for((0, 1, 3))


def test_bands_round_trip_and_a_reader_without_them_sees_the_table(tmp_path):
    bands = ((8, (5, 3, 5, 5, 5)), (64, (3, 1, 1, 3, 5)), (None, (1, 1, 1, 1, 1)))
    pf = _policy(bands=bands)
    back = policyfile.load(policyfile.save(pf, tmp_path / "p.json"))
    assert back == pf and back.bands == bands
    assert back.bands_for((0, 1, 3, 5, 7)) == bands
    with pytest.raises(ProtocolError, match="not a built arm"):
        back.bands_for((0, 1, 3))
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["table"] == [[8, 5], [64, 3], [None, 1]]  # what a v1 reader installs
    assert raw["bands"] == [[8, 5, 3, 5, 5, 5], [64, 3, 1, 1, 3, 5], [None, 1]]
    # Bands that all agree are no bands: the file is a plain v1 one.
    plain = _policy(bands=tuple((b, (k,) * 5) for b, k in TABLE))
    assert plain.bands is None and "bands" not in plain.to_json()
    assert plain.bands_for(ARMS) == tuple((b, (k,) * 5) for b, k in TABLE)


def _write(tmp_path, obj) -> str:
    path = tmp_path / "bad.json"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


GOOD = _policy().to_json()


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: [1, 2], "expected a JSON object"),
        (lambda d: {"1": {"candidate_steps": [0, 1]}}, "speculative-adaptive-config file"),
        (lambda d: {**d, "format": "other"}, "not a dynspec policy file"),
        (lambda d: {**d, "format_version": 2}, "format_version 2 is not supported"),
        (lambda d: {**d, "protocol": 2}, "protocol 2 is not supported"),
        (lambda d: {k: v for k, v in d.items() if k != "table"}, "'table' is missing"),
        (lambda d: {**d, "table": [[8, 7], [None, 1]]}, "k=7 is not a built arm"),
        (lambda d: {**d, "table": [[8, 5], [4, 3], [None, 1]]}, "strictly increasing"),
        (lambda d: {**d, "table": [[8, 5]]}, "last row must be unbounded"),
        (lambda d: {**d, "arms": []}, "arms must be a non-empty list"),
        (lambda d: {**d, "policy_version": -1}, "policy_version must be >= 0"),
        (lambda d: {**d, "provenance": {"estimates": [[0, 1]]}}, "an estimate must be"),
        (lambda d: {**d, "provenance": {"buckets": [8, 4]}}, "strictly increasing"),
        (
            lambda d: {**d, "provenance": {"data_window": {"start": 5.0, "end": 1.0}}},
            "ends",
        ),
        (lambda d: {**d, "bands": {"8": 5}}, "bands must be a list"),
        (lambda d: {**d, "bands": [[8, 5, 3], [64, 3], [None, 1]]}, "row 0 must be"),
        (lambda d: {**d, "bands": [[8, 5, 1, 3, 5, 7], [64, 3], [None, 1]]},
         "k=7 is not a built arm"),
        (lambda d: {**d, "bands": [[8, 3, 1, 3, 5, 5], [64, 3], [None, 1]]},
         "unknown-band k must be the table's"),
        (lambda d: {**d, "table": [[8, 5], [None, 0]], "bands": [[8, 5], [None, 0, 1, 0, 0, 0]]},
         "the unknown band must draft"),
    ],
)
def test_a_bad_file_is_refused_naming_file_and_problem(tmp_path, mutate, problem):
    path = _write(tmp_path, mutate(dict(GOOD)))
    with pytest.raises(PolicyFileError) as info:
        policyfile.load(path)
    assert str(info.value).startswith(f"{path}: ")
    assert problem in str(info.value)


def test_unreadable_and_oversized_files_are_refused(tmp_path):
    with pytest.raises(PolicyFileError, match="cannot read"):
        policyfile.load(tmp_path / "missing.json")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (policyfile.MAX_FILE_BYTES + 1))
    with pytest.raises(PolicyFileError, match="larger than"):
        policyfile.load(big)


def test_save_into_a_missing_directory_names_the_file(tmp_path):
    with pytest.raises(PolicyFileError, match="cannot write") as info:
        policyfile.save(_policy(), tmp_path / "nope" / "p.json")
    assert str(tmp_path / "nope" / "p.json") in str(info.value)


@st.composite
def _tables(draw):
    arms = sorted(draw(st.sets(st.integers(0, 9), min_size=1, max_size=6)))
    bounds = sorted(draw(st.sets(st.integers(1, 512), max_size=8)))
    ks = draw(st.lists(st.sampled_from(arms), min_size=len(bounds) + 1, max_size=len(bounds) + 1))
    return tuple(arms), tuple(zip([*bounds, None], ks))


@given(_tables(), st.integers(0, 10**9))
def test_any_valid_table_round_trips(arms_table, version):
    arms, table = arms_table
    pf = PolicyFile(table=table, arms=arms, policy_version=version)
    assert policyfile.loads(policyfile.dumps(pf)) == pf

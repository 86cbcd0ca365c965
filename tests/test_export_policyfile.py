"""export --format dynspec: our policy file, written through tuner.policyfile and read back
by the plugin's loader into the plugin's core."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report import ARMS, FINAL_TABLE, SERVER, T0, history  # noqa: F401  (history: a fixture)

from policies import Buckets
from storage import Storage
from tuner import policyfile
from tuner.errors import ConfigError
from tuner.export import export, load_sglang_adaptive
from tuner.plugin import _sglang
from tuner.protocol import lookup


def test_policy_file_round_trips_into_the_plugin(history: str, tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    with Storage(history, read_only=True) as st:
        res = export(st, fmt="dynspec", out=out, buckets=Buckets((2, 16, 48)), now=T0 + 100)
    pf = policyfile.load(out)
    assert pf.table == FINAL_TABLE and pf.arms == ARMS and pf.policy_version == 14
    prov = pf.provenance
    assert prov.server == SERVER and prov.policy == "thompson" and prov.buckets == (2, 16, 48)
    assert prov.data_window.observations == res.learned.report.observations
    assert prov.data_window.start <= prov.data_window.end
    # The estimates are the report's, bucket by bucket.
    rep = {(bk.index, a.arm): a for bk in res.learned.report.buckets for a in bk.arms}
    assert {(e.bucket, e.arm) for e in prov.estimates} == set(rep)
    for e in prov.estimates:
        assert e.goodput == pytest.approx(rep[(e.bucket, e.arm)].goodput)
        assert e.n == rep[(e.bucket, e.arm)].decode_steps
    # A server started with the file (the plugin's own start-up path, DYNSPEC_POLICY_FILE)
    # decides by the learned table from its first step.
    core = _sglang._new_core(list(ARMS), 3, {_sglang.POLICY_FILE_ENV: str(out)})
    assert core.version == 14 and core.updates_rejected == 0
    assert all(core.steps_for_batch(b) == lookup(FINAL_TABLE, b) for b in range(1, 300))
    # A server built with fewer arms refuses it whole and keeps its default table.
    small = _sglang._new_core([0, 3], 3, {_sglang.POLICY_FILE_ENV: str(out)})
    assert small.version == 0 and small.table == ((None, 3),) and small.updates_rejected == 1


def test_data_source_policy_file(history: str, tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    with Storage(history, read_only=True) as st:
        res = export(st, fmt="dynspec", out=out, source="data", now=T0 + 100)
    pf = policyfile.load(out)
    assert pf.table == res.learned.table and pf.provenance.policy == "greedy-by-data"


def test_each_loader_refuses_the_other_format_naming_the_file(history: str,
                                                             tmp_path: Path) -> None:
    ours, theirs = tmp_path / "policy.json", tmp_path / "adaptive.json"
    with Storage(history, read_only=True) as st:
        export(st, fmt="dynspec", out=ours, now=T0 + 100)
        export(st, fmt="sglang-adaptive", out=theirs, now=T0 + 100)
    with pytest.raises(ValueError, match=f"{theirs}: this is an SGLang"):
        policyfile.load(theirs)
    with pytest.raises(ConfigError, match=f"{ours}: this is a dynspec policy file"):
        load_sglang_adaptive(ours)


def test_a_failed_export_leaves_the_previous_file_untouched(history: str,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    with Storage(history, read_only=True) as st:
        export(st, fmt="dynspec", out=out, now=T0 + 100)
        before = out.read_text()
        with pytest.raises(ConfigError):
            export(st, fmt="dynspec", out=out, server="nobody:1")
        with pytest.raises(ConfigError, match="does not exist"):
            export(st, fmt="dynspec", out=tmp_path / "missing-dir" / "x" / "p.json")
    assert not (tmp_path / "missing-dir").exists()  # one rule for --out: no folders made
    assert out.read_text() == before
    assert json.loads(before)["format"] == "dynspec-policy"


def test_cli_export_dynspec(history: str, tmp_path: Path, capsys) -> None:
    from tuner.cli import main

    out = tmp_path / "p.json"
    assert main(["export", "--db", history, "--format", "dynspec", "--out", str(out)]) == 0
    assert "from policy v14" in capsys.readouterr().out
    assert policyfile.load(out).table == FINAL_TABLE


BANDS = ((2, (5, 3, 5, 7, 7)), (16, (3, 1, 3, 3, 5)), (None, (1, 1, 1, 1, 1)))


def test_a_banded_table_is_exported_whole_and_installed_by_a_v2_plugin(tmp_path: Path) -> None:
    """The last applied table was learnt per band: our file keeps the bands (a v2 plugin
    without a tree installs them, a v1 plugin the band-agnostic view), SGLang's format gets
    the band-agnostic view and says so."""
    from storage import ObservationRecord, PolicyVersionRecord, ServerSeen
    from tuner.plugin.core import PluginCore
    from tuner.protocol import band_agnostic

    db = f"sqlite:///{tmp_path / 'h.db'}"
    arms = (0, 1, 3, 5, 7)
    with Storage(db) as st:
        st.record_tick(
            servers=[ServerSeen(SERVER, arms, T0)],
            observations=[ObservationRecord(SERVER, T0 + i, 2, 3, 100, 300, 200, 300, 1.0)
                          for i in range(10)],
            policy_versions=[PolicyVersionRecord(SERVER, T0 + 5, 3, band_agnostic(BANDS),
                                                 "model", "learned", "applied", BANDS)],
        )
    ours, theirs = tmp_path / "policy.json", tmp_path / "adaptive.json"
    with Storage(db, read_only=True) as st:
        mine = export(st, fmt="dynspec", out=ours, now=T0 + 100)
        stock = export(st, fmt="sglang-adaptive", out=theirs, now=T0 + 100)
    pf = policyfile.load(ours)
    assert pf.bands == BANDS and pf.table == band_agnostic(BANDS) and not mine.warnings
    assert any("per acceptance band" in w for w in stock.warnings)
    assert load_sglang_adaptive(theirs)[0] == band_agnostic(BANDS)
    core = _sglang._new_core(list(arms), 3, {_sglang.POLICY_FILE_ENV: str(ours)})
    assert core.band_table == BANDS and core.version == 3 and core.updates_rejected == 0
    old = PluginCore(arms, started_at=0.0, protocol=1)  # a v1 plugin has no bands
    _sglang._install_policy_file(old, str(ours))
    assert old.table == band_agnostic(BANDS) and old.updates_rejected == 0

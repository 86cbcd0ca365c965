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

"""export: the learned table as SGLang's adaptive config (and, see test_export_policyfile, as
our own policy file), from a database written by a short simulated run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report import FINAL_TABLE, SERVER, T0, history  # noqa: F401  (history: a fixture)

from policies import Buckets
from storage import ObservationRecord, ServerSeen, Storage
from tuner.errors import ConfigError
from tuner.export import (
    export,
    learned_table,
    load_sglang_adaptive,
    padding_crossings,
    sglang_adaptive_config,
)


def test_sglang_file_holds_one_candidate_per_slot(history: str, tmp_path: Path) -> None:
    out = tmp_path / "adaptive.json"
    with Storage(history, read_only=True) as st:
        res = export(st, fmt="sglang-adaptive", out=out, now=T0 + 100)
    assert res.learned.source == "policy" and res.learned.version == 14
    cfg = json.loads(out.read_text())
    slots = {k: v for k, v in cfg.items() if k.isdigit()}
    # b<=2:k5 b<=16:k3 rest:k0 -> lower bounds 1, 3, 17
    assert slots == {"1": {"candidate_steps": [5]}, "3": {"candidate_steps": [3]},
                     "17": {"candidate_steps": [0]}}
    meta = cfg["_dynspec"]
    assert meta["prebuilt_arms"] == [0, 3, 5] and meta["server"] == SERVER
    assert meta["policy_version"] == 14 and "union" in meta["note"]
    table, meta2 = load_sglang_adaptive(out)
    assert table == FINAL_TABLE and meta2 == meta
    # 2 and 16 are captured CUDA-graph sizes: the mapping is exact, no warning.
    assert res.warnings == ()


def test_sglang_routing_matches_the_table_for_every_batch_size() -> None:
    """SGLang's rule (pad to a captured size, then the largest slot key <= it) gives the
    table's arm for every batch size when the bounds are captured sizes."""
    from bisect import bisect_right

    from tuner.protocol import lookup
    from tuner.sim.graphs import cuda_graph_bs, pad_batch_size

    table = ((1, 5), (8, 3), (32, 1), (None, 0))
    cfg = sglang_adaptive_config(table)
    keys = sorted(int(k) for k in cfg if k.isdigit())
    graphs = cuda_graph_bs(512)
    for b in range(1, 600):
        slot = keys[max(0, bisect_right(keys, pad_batch_size(b, graphs)) - 1)]
        assert cfg[str(slot)]["candidate_steps"] == [lookup(table, b)], b


def test_neighbouring_rows_with_one_arm_merge() -> None:
    cfg = sglang_adaptive_config(((4, 3), (8, 3), (None, 0)))
    assert sorted(k for k in cfg if k.isdigit()) == ["1", "9"]


def test_bounds_that_are_not_graph_sizes_are_reported() -> None:
    warnings = padding_crossings(((9, 3), (50, 1), (None, 0)))
    assert len(warnings) == 2
    assert "batch sizes 9..9 pad to CUDA-graph size 10 and run k1" in warnings[0]
    assert "49..50 pad to CUDA-graph size 52 and run k0" in warnings[1]
    assert padding_crossings(((8, 3), (64, 1), (None, 0))) == []


def test_source_data_derives_greedy_per_bucket(history: str, tmp_path: Path) -> None:
    with Storage(history, read_only=True) as st:
        lt = learned_table(st, source="data", buckets=Buckets((2, 16, 48)), now=T0 + 100)
        rep = lt.report
    best = {bk.label: bk.best for bk in rep.buckets if bk.best is not None}
    assert lt.source == "data" and lt.version is None
    # Every bucket with data gets its best arm; the one above the data takes the last.
    assert best == {"1-2": lt.table[0][1], "3-16": Buckets((2, 16, 48)).arms_of(lt.table)[1],
                    "17-48": lt.table[-1][1]}
    assert Buckets((2, 16, 48)).arms_of(lt.table)[3] == best["17-48"]


def test_metrics_only_server_exports_from_data(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen("stock:1", (), T0)], observations=[
            ObservationRecord("stock:1", T0 + i, 8, 3, 100, 1800, 1000, 2400, 1.0)
            for i in range(3)
        ] + [ObservationRecord("stock:1", T0 + i, 40, 0, 100, 4000, 0, 0, 1.0)
             for i in range(3)])
        res = export(st, fmt="sglang-adaptive", out=tmp_path / "a.json", now=T0 + 10)
        with pytest.raises(ConfigError, match="no table recorded.*--source data"):
            export(st, fmt="sglang-adaptive", out=tmp_path / "b.json", source="policy")
    assert res.learned.source == "data"
    # Data at b=8 (k3 best) and b=40 (k0): the buckets between go to the nearer one.
    assert res.learned.table == ((24, 3), (None, 0))
    assert not (tmp_path / "b.json").exists()


def test_server_must_be_named_when_several(history: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'two.db'}"
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen("a:1", (0, 3), T0), ServerSeen("b:2", (0, 3), T0)])
        with pytest.raises(ConfigError, match="holds 2 servers \\(a:1, b:2\\): name one"):
            export(st, fmt="sglang-adaptive", out=tmp_path / "x.json")
        with pytest.raises(ConfigError, match="a:1: no observations"):
            export(st, fmt="sglang-adaptive", out=tmp_path / "x.json", server="a:1")
        with pytest.raises(ConfigError, match="--format 'yaml'"):
            export(st, fmt="yaml", out=tmp_path / "x.json", server="a:1")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("not json at all", "not a JSON file"),
        ("[1, 2]", "expected a JSON object"),
        ('{"ema_alpha": 0.2}', "no batch-size slots"),
        ('{"1": {"candidate_steps": [1, 3]}}', "slot '1' must have exactly one candidate"),
        ('{"8": {"candidate_steps": [1]}}', "needs a slot \"1\""),
        ('{"1": {"candidate_steps": [true]}}', "exactly one candidate"),
        ('{"1": "fast"}', "exactly one candidate"),
        ('{"protocol": 1, "table": [[8, 3], [null, 0]]}', "no batch-size slots"),
    ],
)
def test_bad_or_foreign_files_are_refused_naming_the_file(
    tmp_path: Path, content: str, problem: str
) -> None:
    path = tmp_path / "foreign.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_sglang_adaptive(path)
    assert str(path) in str(info.value) and problem in str(info.value)


def test_unwritable_output_names_the_path(history: str, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with Storage(history, read_only=True) as st:
        with pytest.raises(ConfigError, match="does not exist"):
            export(st, fmt="sglang-adaptive", out=blocker / "sub" / "a.json")
        with pytest.raises(ConfigError, match="is not a folder"):
            export(st, fmt="sglang-adaptive", out=blocker / "a.json")
        with pytest.raises(ConfigError, match="is a folder"):
            export(st, fmt="sglang-adaptive", out=tmp_path)
    assert not (blocker.parent / "sub").exists()


def test_cli_export(history: str, tmp_path: Path, capsys) -> None:
    from tuner.cli import main

    out = tmp_path / "a.json"
    assert main(["export", "--db", history, "--format", "sglang-adaptive",
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "from policy v14" in said and "pre-builds arms [0, 3, 5]" in said
    assert load_sglang_adaptive(out)[0] == FINAL_TABLE
    assert main(["export", "--db", history, "--format", "sglang-adaptive", "--out", str(out),
                 "--source", "data", "--buckets", "2,16,48"]) == 0
    assert "best arm per bucket" in capsys.readouterr().out
    assert main(["export", "--db", history, "--format", "sglang-adaptive", "--out", str(out),
                 "--server", "nobody:1"]) == 2


def _arm(k: int, goodput: float, intervals: int, half: float = 1.0):
    from tuner.report import ArmStat

    return ArmStat(arm=k, goodput=goodput, ci_low=goodput - half, ci_high=goodput + half,
                   decode_steps=100 * intervals, intervals=intervals, busy_s=1.0,
                   emitted_tokens=1, raw_goodput=goodput, mean_b=1.0, accepted_per_step=None,
                   acceptance_rate=None)


def _bucket(i: int, edges: Buckets, *arms):
    from tuner.report import BucketReport

    low, high = edges.bounds(i)
    return BucketReport(index=i, label=edges.label(i), low=low, high=high, b_ref=1.0,
                        arms=tuple(arms), chosen=None, best=None, gain_vs_off=None,
                        gain_vs_always=None)


def test_data_tables_say_which_batch_sizes_had_no_data_and_how_they_were_filled() -> None:
    from tuner.export import table_from_buckets

    edges = Buckets((2, 8, 16, 64))  # buckets 1-2, 3-8, 9-16, 17-64, >64
    buckets = [
        _bucket(0, edges, _arm(5, 300, 50), _arm(3, 900, 4)),  # k3: 4 intervals only
        _bucket(1, edges),  # no data, between measured buckets
        _bucket(2, edges, _arm(5, 500, 40, half=30), _arm(1, 480, 40, half=30)),  # overlap
        _bucket(3, edges), _bucket(4, edges),  # nothing measured above b=16
    ]
    table, notes = table_from_buckets(buckets, edges)
    assert table == ((None, 5),)  # 4 intervals do not beat 50; the top arm carries on
    text = "\n".join(notes)
    assert "no data from b=17 up: the table stops at the largest measured bucket (9-16)" in text
    assert "no data at b 3-8 (k5 from 1-2)" in text
    assert "b 1-2: k3 left out (fewer than 5 intervals)" in text
    assert "b 9-16: k5 over k1 by the point estimate only" in text


def test_export_from_data_writes_the_notes_into_the_file_and_warns(tmp_path: Path) -> None:
    from tuner import policyfile

    db = f"sqlite:///{tmp_path / 'h.db'}"
    with Storage(db) as st:
        st.record_tick(servers=[ServerSeen("a:1", (0, 5), T0, T0)], observations=[
            ObservationRecord("a:1", T0 + i, 4, 5, 100, 900, 400, 500, 1.0) for i in range(6)])
    out = tmp_path / "p.json"
    with Storage(db, read_only=True) as st:
        result = export(st, fmt="dynspec", out=out, source="data", now=T0 + 100)
    assert any("no data from b=5 up" in w for w in result.warnings)
    notes = policyfile.load(out).provenance.notes
    assert notes and "the table stops at the largest measured bucket" in notes[0]

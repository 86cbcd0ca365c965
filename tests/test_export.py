"""export: the learned table as SGLang's adaptive config (and, see test_export_policyfile, as
our own policy file), from a database written by a short simulated run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report import FINAL_TABLE, SERVER, T0, simulate_history

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


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('hist') / 'dynspec.db'}"
    simulate_history(url)
    return url


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
        with pytest.raises(ConfigError, match="cannot write"):
            export(st, fmt="sglang-adaptive", out=blocker / "sub" / "a.json")


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

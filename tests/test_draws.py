"""benchmarks/draws.py: the figures a change is judged by, read back from bench's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests._bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def dr() -> ModuleType:
    return load_benchmark("draws")


def run(policy: str, profile: str, pcts: list[float | None], workload: str = "chat") -> dict:
    return {"policy": policy, "profile": profile, "workload": workload,
            "phases": [{"pct_oracle": p} for p in pcts]}


WORLDS: dict[str, Any] = {"worlds": [{"index": 0}, {"index": 1}, {"index": 2}], "runs": [
    run("model", "world-0", [101.0, 99.0, 98.0]),  # ok: 98 is not below 98
    run("model", "world-1", [97.0, 94.0, 100.0]),  # 1 + 4 points short, below 95
    run("model", "world-2", [99.0, None, 99.0]),  # a phase without a figure is not ok
    run("thompson", "world-1", [90.0, 90.0, 90.0]),  # another policy's runs are not read
]}


def test_a_worlds_draw_counts_ok_worlds_low_phases_and_their_shortfall(dr: ModuleType) -> None:
    s = dr.score(WORLDS)
    assert (s["runs"], s["ok"], s["below"], s["floor"]) == (3, 1, 2, 1)
    assert s["shortfall"] == pytest.approx(5.0)
    assert s["worst"] == (94.0, "world-1")
    assert [name for name, _ in s["low"]] == ["world-1"]
    assert "behind" not in s


def test_a_profiles_draw_counts_phases_behind_the_better_of_both_bandits(dr: ModuleType) -> None:
    doc = {"runs": [
        run("model", "h200", [99.0, 98.5, 97.0]),
        run("thompson", "h200", [100.5, 97.0, 97.0]),  # phase 0: 1.5 ahead
        run("ucb", "h200", [99.5, 99.0, 98.5]),  # phase 2: 1.5 ahead (thompson is not)
        run("model", "kimi", [100.0, 100.0, 100.0], "code"),
    ]}
    s = dr.score(doc)
    assert s["behind"] == 2 and s["below"] == 1
    assert s["worst"] == (97.0, "h200 chat")
    # ... and including warm-up, where the bandits explore every arm of a new bucket
    for r, all_ in zip(doc["runs"], ([97.0, 98.0, 96.0], [92.0, 95.0, 96.5], [96.0, 99.5, 97.0],
                                      [100.0, 100.0, 100.0]), strict=True):
        for ph, p in zip(r["phases"], all_, strict=True):
            ph["pct_oracle_all"] = p
    s = dr.score(doc)
    assert (s["behind"], s["behind_all"]) == (2, 1)  # phase 1: ucb 1.5 ahead


def test_the_base_draws_pair_with_the_new_ones_and_totals_stand_side_by_side(
        dr: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new, base = tmp_path / "new.json", tmp_path / "base.json"
    new.write_text(json.dumps(WORLDS))
    base.write_text(json.dumps({**WORLDS, "runs": WORLDS["runs"][:1]}))
    assert dr.main([str(new), "--base", str(base), "--low"]) == 0
    out = capsys.readouterr().out
    assert "base: ok 1/1" in out and "new: ok 1/3" in out and "shortfall 5.0" in out
    assert "world-1" in out and " 94.0 " in out
    with pytest.raises(SystemExit):
        dr.main([str(new), "--base", str(base), str(base)])
    (tmp_path / "bad.json").write_text("{}")
    assert dr.main([str(tmp_path / "bad.json")]) == 2


def test_a_screen_on_some_worlds_is_judged_against_the_same_worlds_of_the_base(
        dr: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new, base = tmp_path / "new.json", tmp_path / "base.json"
    # the change screened on world-1 alone, against the base's draw of every world
    new.write_text(json.dumps({**WORLDS, "runs": [run("model", "world-1", [99.0, 96.5, 100.0])]}))
    base.write_text(json.dumps(WORLDS))
    assert dr.main([str(new), "--base", str(base), "--pair"]) == 0
    out = capsys.readouterr().out
    assert "base: ok 0/1" in out and "new: ok 0/1" in out  # world-0 and world-2 left out
    assert "shortfall 5.0" in out and "shortfall 1.5" in out
    assert " 97.0  94.0 100.0  ->   99.0  96.5 100.0" in out
    with pytest.raises(SystemExit):
        dr.main([str(new), "--pair"])  # nothing to pair with

"""The bench's per-step oracle beside the per-bucket one: its JSON fields and headroom."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tuner import bench
from tuner.bench import BenchConfig, run_bench, run_one
from tuner.cli import main


def test_the_per_bucket_oracles_own_table_scores_100_and_below_the_step_oracle_by_its_headroom():
    # k = 3 is the per-bucket oracle's arm on the H100 at one request, chat and diverse alike.
    for wl, low, high in (("chat", 1.0, 1.06), ("diverse", 1.03, 1.15)):
        r = run_one(profile="h100-llama8b", workload=wl, load="60:1", policy="always:k=3",
                    warmup_s=5.0)
        (ph,) = r.phases
        assert ph.pct_oracle_all == pytest.approx(100.0, abs=1e-9)
        assert low <= ph.step_headroom <= high
        assert ph.pct_step_oracle_all == pytest.approx(100.0 / ph.step_headroom)
        assert r.pct_step_oracle_all == pytest.approx(ph.pct_step_oracle_all)


def test_requests_that_differ_more_leave_more_headroom_and_batches_average_it_out():
    chat, diverse = (run_one(profile="seed-kimi-pcie", workload=wl, load="40:1,40:16",
                             policy="model", warmup_s=5.0) for wl in ("chat", "diverse"))
    assert diverse.phases[0].step_headroom > chat.phases[0].step_headroom + 0.03
    for r in (chat, diverse):
        one, sixteen = r.phases
        assert one.step_headroom > sixteen.step_headroom >= 1.0
        for ph in r.phases:
            assert ph.pct_step_oracle <= ph.pct_oracle
            assert ph.pct_step_oracle_all <= ph.pct_oracle_all


def test_json_and_text_carry_the_step_oracle(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--profiles", "h100-llama8b", "--workloads", "diverse", "--load",
               "10:1,10:4", "--policies", "never,model", "--warmup", "2", "--jobs", "1",
               "--json", str(out)])
    assert rc == 0
    assert "per-step oracle headroom, % per phase (model's batches):" in capsys.readouterr().out
    for run in json.loads(out.read_text())["runs"]:
        for ph in run["phases"]:
            assert 0 < ph["pct_step_oracle_all"] <= ph["pct_oracle_all"]
            assert ph["step_oracle_goodput"] >= ph["oracle_goodput"]
            # One arm per bucket cannot beat the per-bucket oracle; banded tables may.
            if run["policy"] == "never":
                assert ph["pct_oracle_all"] <= 100


def test_run_bench_results_hold_the_step_oracle_per_phase():
    cfg = BenchConfig(profiles=("seed-kimi-pcie",), workloads=("diverse",), load="20:1",
                      policies=("always:k=3",), warmup_s=2.0, jobs=1)
    (r,) = run_bench(cfg).runs
    (ph,) = r.phases
    assert ph.step_oracle_goodput > ph.oracle_goodput
    assert ph.pct_step_oracle < ph.pct_oracle


class _FixedBanded:
    """A fixed banded table in a policy's place (what a band-learning policy pushes)."""

    def __init__(self, table):
        self.table = table

    def propose(self):
        return self.table

    def greedy(self):
        return self.table

    def update(self, obs):
        return True

    def snapshot(self):
        return SimpleNamespace(notes=())


def test_a_banded_table_is_scored_on_its_steps_and_can_beat_the_per_bucket_oracle(monkeypatch):
    # seed-kimi-pcie, diverse, one request: the per-bucket oracle runs k = 3; this table
    # drafts 1, 3, 5, 7 as the batch's acceptance rises through the bands (3 while unknown).
    table = ((None, (3, 1, 3, 5, 7)),)
    monkeypatch.setattr(bench, "build_policy", lambda *a, **kw: _FixedBanded(table))
    r = run_one(profile="seed-kimi-pcie", workload="diverse", load="60:1", policy="banded",
                warmup_s=5.0)
    (ph,) = r.phases
    assert ph.pct_oracle_all > 102.0 and ph.pct_oracle > 102.0
    assert ph.pct_step_oracle_all <= 100.0
    # Every arm it ran is one of its bands': no exploration.
    assert ph.explore_tokens_lost == 0.0
    # The same table without bands is the per-bucket oracle's, scored by expectation.
    monkeypatch.setattr(bench, "build_policy", lambda *a, **kw: _FixedBanded(((None, 3),)))
    flat = run_one(profile="seed-kimi-pcie", workload="diverse", load="60:1", policy="flat",
                   warmup_s=5.0)
    assert flat.phases[0].pct_oracle_all == pytest.approx(100.0, abs=1e-9)

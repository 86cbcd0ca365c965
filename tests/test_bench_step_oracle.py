"""The bench's per-step oracle beside the per-bucket one: its JSON fields and headroom."""

from __future__ import annotations

import json

import pytest

from tuner.bench import BenchConfig, run_bench, run_one
from tuner.cli import main


def test_the_per_bucket_oracles_own_table_scores_100_and_below_the_step_oracle_by_its_headroom():
    # k = 3 is the per-bucket oracle's arm on the H100 at one request, chat and diverse alike.
    for wl, low, high in (("chat", 1.0, 1.06), ("diverse", 1.03, 1.15)):
        r = run_one(profile="h100-llama8b", workload=wl, load="60:1", policy="always:k=3",
                    warmup_s=5.0)
        (ph,) = r.phases
        assert ph.pct_oracle_all == 100.0
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
            assert 0 < ph["pct_step_oracle_all"] <= ph["pct_oracle_all"] <= 100
            assert ph["step_oracle_goodput"] >= ph["oracle_goodput"]


def test_run_bench_results_hold_the_step_oracle_per_phase():
    cfg = BenchConfig(profiles=("seed-kimi-pcie",), workloads=("diverse",), load="20:1",
                      policies=("always:k=3",), warmup_s=2.0, jobs=1)
    (r,) = run_bench(cfg).runs
    (ph,) = r.phases
    assert ph.step_oracle_goodput > ph.oracle_goodput
    assert ph.pct_step_oracle < ph.pct_oracle

"""The bench's ``sglang-real`` baseline: SGLang 0.5.23's own ``AdaptiveSpeculativeParams``
driven through its public methods by the simulator, next to our pure model of it."""

from __future__ import annotations

import pytest
from _contract_env import need, stock_adaptive_params

need()

from tuner.bench import SGLANG_REAL, BenchConfig, _SGLangCore, run_bench, run_one  # noqa: E402
from tuner.protocol import lookup  # noqa: E402

pytestmark = pytest.mark.contract

LOAD = "40:1,40:64"


def test_the_core_drives_sglangs_own_class_even_after_the_plugin_replaced_it(monkeypatch):
    from sglang.srt.speculative import adaptive_spec_params as asp

    from tuner.plugin._sglang import build_policy_class

    stock = stock_adaptive_params()
    assert stock.__module__ == asp.__name__
    # As in a process that ran load_plugins(): the name holds our subclass.
    monkeypatch.setattr(asp, "AdaptiveSpeculativeParams", build_policy_class(stock))
    core = _SGLangCore((0, 1, 3, 5), started_at=0.0, graph_bs=(1, 2, 4, 8, 16, 32, 64))
    assert type(core._params) is stock
    first = core.steps_for_batch(1)
    for i in range(200):  # every request accepts every draft: the EMA climbs to the top arm
        core.record_decode(1, first, first + 1, first, launch_ts=i * 0.01, forward_iter=i)
    assert core.steps_for_batch(1) > first
    assert lookup(core.decision_table(), 1) == core.steps_for_batch(1)


def test_sglang_real_runs_and_agrees_with_the_static_model_of_it():
    real = run_one(profile="h200-llama8b", workload="chat", load=LOAD, policy=SGLANG_REAL)
    model = run_one(profile="h200-llama8b", workload="chat", load=LOAD, policy="sglang-default")
    for r in (real, model):
        assert all(0.0 <= p.pct_oracle <= 100.0 for p in r.phases)
    # At c=64 the real EMA settles where policies.sglang_static_table says it does.
    assert real.phases[1].pct_oracle == pytest.approx(model.phases[1].pct_oracle, abs=1.0)
    assert lookup(real.final_table, 64) == lookup(model.final_table, 64)
    assert real.switches == 0 and real.explore_pct < 0.5


def test_bench_keeps_sglang_real_when_sglang_is_importable():
    cfg = BenchConfig(profiles=("seed-kimi-pcie",), workloads=("chat",), load="20:1",
                      policies=("model", SGLANG_REAL), jobs=1)
    res = run_bench(cfg)
    assert {r.policy for r in res.runs} == {"model", SGLANG_REAL} and not res.skipped

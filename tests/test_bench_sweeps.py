"""benchmarks/default_schedule_seeds.py and benchmarks/estimate_decay.py: what they report and
that the decay sweep leaves the plugin core's estimate as it found it."""

from __future__ import annotations

import pytest

from tests._bench_scripts import load_benchmark
from tuner.plugin import core
from tuner.plugin.acceptance import DECAY


def test_the_seed_summary_counts_worst_phases_and_the_first_visit_to_64() -> None:
    mod = load_benchmark("default_schedule_seeds")
    runs = {"a": [99.0, 97.0, 100.0, 90.0, 100.0], "b": [100.0, 100.0, 100.0, 99.0]}
    text = mod.summary(runs)
    assert "2 runs: worst phase mean 94.50, lowest 90.0" in text
    assert "runs < 98 % 1; phases < 98 % 2 of 9" in text
    assert "first visit to 64: mean 94.50, lowest 90.0" in text


def test_the_decay_sweep_runs_each_decay_and_restores_the_default(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    mod = load_benchmark("estimate_decay")
    seen: list[float] = []
    real_run_one = mod.bench.run_one

    def run_one(**kwargs):  # type: ignore[no-untyped-def]
        seen.append(core.AcceptanceEstimate().decay)  # what the plugin core builds
        return real_run_one(**{**kwargs, "load": "5:1"})

    monkeypatch.setattr(mod.bench, "run_one", run_one)
    monkeypatch.setattr("sys.argv", ["estimate_decay", "--decays", "0.5", "0.95", "--profiles",
                                     "h200-llama8b", "--workloads", "chat", "--concurrency", "1"])
    mod.main()
    assert seen == [0.5, 0.95]
    assert core.AcceptanceEstimate().decay == DECAY
    out = capsys.readouterr().out
    assert "mean 0.5 " in out and "mean 0.95 " in out

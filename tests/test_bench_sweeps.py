"""benchmarks/default_schedule_seeds.py and benchmarks/estimate_decay.py: what they report and
that the decay sweep leaves the estimator's defaults as it found them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tuner.plugin.acceptance import DECAY, AcceptanceEstimate

_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_seed_summary_counts_worst_phases_and_the_first_visit_to_64() -> None:
    mod = _load("default_schedule_seeds")
    runs = {"a": [99.0, 97.0, 100.0, 90.0, 100.0], "b": [100.0, 100.0, 100.0, 99.0]}
    text = mod.summary(runs)
    assert "2 runs: worst phase mean 94.50, lowest 90.0" in text
    assert "runs < 98 % 1; phases < 98 % 2 of 9" in text
    assert "first visit to 64: mean 94.50, lowest 90.0" in text


def test_the_decay_sweep_runs_each_decay_and_restores_the_default(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _load("estimate_decay")
    seen: list[float] = []
    real_run_one = mod.bench.run_one

    def run_one(**kwargs):  # type: ignore[no-untyped-def]
        seen.append(AcceptanceEstimate().decay)  # what the plugin core would build
        return real_run_one(**{**kwargs, "load": "5:1"})

    monkeypatch.setattr(mod.bench, "run_one", run_one)
    monkeypatch.setattr("sys.argv", ["estimate_decay", "--decays", "0.5", "0.95", "--profiles",
                                     "h200-llama8b", "--workloads", "chat", "--concurrency", "1"])
    mod.main()
    assert seen == [0.5, 0.95]
    assert AcceptanceEstimate().decay == DECAY
    out = capsys.readouterr().out
    assert "mean 0.5 " in out and "mean 0.95 " in out

"""benchmarks/restart_warm.py: the restart it simulates replays what the policy was fed."""

from __future__ import annotations

from tests._bench_scripts import load_benchmark

rw = load_benchmark("restart_warm")


def test_a_kept_restart_ends_where_no_restart_does_and_a_cold_one_does_not():
    # One request of a diverse workload: the bands matter, and little else is random.
    args = ("seed-kimi-pcie", "diverse", 1, 21)
    runs = {b: rw.run(*args, b, 60.0, 10.0, 30.0) for b in rw.BRANCHES}
    assert len({tuple(r[:1]) for r in runs.values()}) == 1  # alike up to the restart
    assert runs["kept"] == runs["none"]
    assert runs["cold"][1] != runs["none"][1]

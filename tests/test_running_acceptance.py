"""benchmarks/running_acceptance.py measures the running requests' acceptance and what the
policy was fed: at a steady load the three agree with the workload's steady state."""

from __future__ import annotations

import pytest

from tests._bench_scripts import load_benchmark

ra = load_benchmark("running_acceptance")


@pytest.fixture(scope="module")
def steady_run():
    return ra.measure(load="60:16", window_s=20.0, seed=0, policy_seed=0,
                      profile="h100-llama8b", workload="chat")


def test_at_a_steady_load_the_running_requests_accept_as_the_workload_does(steady_run):
    wins, prof, wl = steady_run
    assert sorted(wins) == [0, 1, 2]
    for i in (1, 2):  # past the first window's ramp: 16 requests, admitted as others finish
        w = wins[i]
        assert w["steps"] > 10_000
        for a, k in enumerate(ra.ARMS[:2]):  # k = 1, 3: the mix of the arm that ran
            running = w["running"][a] / w["steps"]
            assert running == pytest.approx(ra.steady(prof, wl, k, 20.0 * i + 10), rel=0.05)


def test_what_the_policy_was_fed_is_what_the_running_requests_accept(steady_run):
    wins, _, _ = steady_run
    w = wins[1]
    fed = {k: v for k, v in w["fed"].items() if k in ra.ARMS}
    k, (acc, rs) = max(fed.items(), key=lambda kv: kv[1][1])  # the arm that ran most
    assert rs > 0.9 * w["steps"]
    running = w["running"][ra.ARMS.index(k)] / w["steps"]
    assert acc / rs == pytest.approx(running, rel=0.03)


def test_the_command_line_prints_a_row_per_window(capsys):
    assert ra.main(["--profile", "h100-llama8b", "--load", "20:4", "--window", "10"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if " s  k1 " in r]
    assert [r.split(" s ")[0].split() for r in rows] == [["0-", "10"], ["10-", "20"]]

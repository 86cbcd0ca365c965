"""The simulator's engine: acceptance statistics, costs, padding, k=0 modes, telemetry order."""

from __future__ import annotations

import pytest

from tuner.plugin.core import PluginCore
from tuner.protocol import encode_update
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop
from tuner.sim.oracle import expected_emitted, workload_emitted
from tuner.sim.profiles import ProfileRangeError, TableProfile, load_profile
from tuner.sim.workloads import LengthDist, Phase, RequestClass, Workload

ARMS = (0, 1, 3, 5)


def _workload(
    alpha: float = 0.8, delta: float = 0.95, *, kappa: float = 20.0, out: int = 200
) -> Workload:
    cls = RequestClass(
        name="t",
        acceptance={"eagle3-dense": (alpha, delta), "kimi-eagle3": (alpha, delta)},
        prompt=LengthDist(100, 0.0),
        output=LengthDist(out, 0.0, 1, 100_000),
    )
    return Workload(name="t", phases=(Phase(1.0, ((1.0, cls),)),), kappa=kappa)


def _engine(*, k: int | None = None, table=None, conc: int = 48, **kw) -> Engine:
    core = PluginCore(ARMS, started_at=0.0, default_arm=k if k is not None else 5)
    if table is not None:
        core.install(table, 1)
    kw.setdefault("profile", "h200-llama8b")
    kw.setdefault("workload", "chat")
    return Engine(core=core, load=ClosedLoop([(1e9, conc)]), **kw)


def _emitted_per_request_step(eng: Engine) -> float:
    return eng.counters.decode_tokens / eng.counters.request_steps


def test_sample_mean_of_emitted_tokens_matches_the_closed_form():
    # Homogeneous α (huge κ): every request-step is one draw of the chain, so the sample mean
    # must equal 1 + Σ α^i δ^(i(i−1)/2).
    eng = _engine(k=3, workload=_workload(0.8, 0.95, kappa=1e9), seed=7)
    eng.run_until(30.0)
    assert eng.counters.request_steps > 50_000
    assert _emitted_per_request_step(eng) == pytest.approx(
        expected_emitted(0.8, 0.95, 3), rel=0.005
    )


def test_heterogeneous_acceptance_matches_the_request_step_expectation():
    eng = _engine(k=5, workload="mixed", seed=3)
    eng.run_until(120.0)
    measured = _emitted_per_request_step(eng)
    steady = workload_emitted("mixed", "eagle3-dense", 5)
    per_request = workload_emitted("mixed", "eagle3-dense", 5, weighting="request")
    assert measured == pytest.approx(steady, rel=0.015)
    # The naive per-request mean is measurably off: long, poorly accepted requests fill batches.
    assert abs(measured - per_request) / per_request > 0.05


def test_timed_steps_cost_exactly_the_profile_step():
    eng = _engine(table=((8, 5), (24, 3), (None, 0)), conc=0, seed=1)
    eng.attach_load(ClosedLoop([(5.0, 4), (5.0, 16), (5.0, 48)]))
    eng.run_until(15.0)
    rows = eng.core.state().counters
    assert {r.k for r in rows} >= {5, 3, 0}
    for r in rows:
        expect = eng.profile.step_s(eng.padded(r.b), r.k)
        assert r.busy_s / r.decode_steps == pytest.approx(expect, rel=1e-9)
        assert r.drafted_tokens == r.k * r.b * r.decode_steps
        assert r.accepted_drafts <= r.drafted_tokens
        assert r.emitted_tokens == r.accepted_drafts + r.b * r.decode_steps


def test_lookup_and_cost_use_the_cuda_graph_padded_batch_size():
    # 9 requests run in the bs=10 graph: the table row for b<=9 must not apply.
    eng = _engine(table=((9, 5), (None, 1)), conc=9, workload=_workload(out=100_000))
    eng.run_until(2.0)
    rows = eng.core.state().counters
    assert rows and all((r.b, r.k) == (9, 1) for r in rows)
    (row,) = rows
    assert row.busy_s / row.decode_steps == pytest.approx(eng.profile.step_s(10, 1))


def test_running_cap_and_queue():
    eng = _engine(conc=100, max_running=16)
    eng.run_until(20.0)
    assert eng.num_running == 16 and eng.num_waiting == 84
    assert max(r.b for r in eng.core.state().counters) == 16
    assert load_profile("seed-kimi-pcie").max_running == 64
    assert Engine(profile="seed-kimi-pcie", workload="chat").max_running == 64
    assert Engine(profile="h200-llama8b", workload="chat").max_running == 48


def test_profile_that_cannot_cost_the_cap_is_refused_up_front():
    small = TableProfile(
        rows=[(1, 1, 5.0, 0.3), (8, 1, 6.0, 0.3)]
        + [(b, q, 6.0, 0.3) for b in (1, 8) for q in (2, 4, 6)],
        name="small",
    )
    # 9 requests would run in the bs=10 graph, beyond the table.
    with pytest.raises(ProfileRangeError, match="batch size 10 would be an extrapolation"):
        Engine(profile=small, workload="chat", max_running=10)
    Engine(profile=small, workload="chat", max_running=8)


def test_tpot_of_a_lone_request_without_speculation_is_the_step_time():
    eng = _engine(k=0, conc=0, skip_zero_draft_extend=True)
    done = []
    eng.submit(prompt_tokens=50, output_tokens=101, on_finish=done.append)
    eng.run_until(10.0)
    (r,) = done
    assert r.output_tokens == 101 and r.finished_at > r.first_token_at > r.arrival == 0.0
    assert r.tpot_s == pytest.approx(eng.profile.step_s(1, 0, skip_zero_draft_extend=True))
    stats = eng.request_stats()
    assert stats.finished == 1 and stats.tpot_p50_s == pytest.approx(r.tpot_s)
    assert stats.output_tokens == 101


def test_k0_default_keeps_acceptance_skip_mode_pays_cold_recovery():
    def run(skip: bool) -> tuple[float, float]:
        eng = _engine(
            k=0, conc=16, skip_zero_draft_extend=skip, workload=_workload(out=100_000), seed=5
        )
        eng.run_until(2.0)
        k0 = [r for r in eng.core.state().counters if r.k == 0]
        step0 = k0[0].busy_s / k0[0].decode_steps
        assert eng.core.apply_update(encode_update(((None, 3),), 2))[0]
        before = eng.counters.accepted_drafts, eng.counters.request_steps
        eng.run_until(4.0)
        acc = eng.counters.accepted_drafts - before[0]
        return acc / (eng.counters.request_steps - before[1]), step0

    warm, step_default = run(False)
    cold, step_skip = run(True)
    prof = load_profile("h200-llama8b")
    assert step_default == pytest.approx(prof.step_s(16, 0))
    assert step_skip == pytest.approx(prof.step_s(16, 0, skip_zero_draft_extend=True))
    assert step_skip < step_default
    assert warm == pytest.approx(expected_emitted(0.8, 0.95, 3, kappa=20) - 1, rel=0.1)
    assert cold < 0.35 * warm  # stale draft state: α·0.2 until the requests finish


class _SpyCore(PluginCore):
    """Logs the order of lookups and records, as the overlap scheduler makes them."""

    def __init__(self) -> None:
        super().__init__(ARMS, started_at=0.0)
        self.events: list[tuple] = []

    def steps_for_batch(self, batch_size: int) -> int:
        k = super().steps_for_batch(batch_size)
        self.events.append(("launch", k))
        return k

    def record_decode(self, b, k, emitted, accepted, launch_ts, forward_iter, idle=False,
                      band=None, first_rejected=0):
        self.events.append(("record", k, forward_iter))
        super().record_decode(b, k, emitted, accepted, launch_ts, forward_iter, idle, band,
                              first_rejected)


def test_telemetry_records_step_n_after_launching_n_plus_1_with_its_launch_arm():
    core = _SpyCore()
    eng = Engine(
        profile="h200-llama8b",
        workload=_workload(out=100_000),
        core=core,
        load=ClosedLoop([(1e9, 4)]),
    )
    eng.run_until(0.5)
    assert core.apply_update(encode_update(((None, 1),), 1))[0]
    eng.run_until(1.0)
    launches = [e for e in core.events if e[0] == "launch"]
    records = [e for e in core.events if e[0] == "record"]
    switch = next(i for i, e in enumerate(launches) if e[1] == 1)
    assert switch > 0 and all(e[1] == 5 for e in launches[:switch])
    # Every record carries the arm its step launched with, including the step in flight when
    # the table changed (recorded after the first k=1 launch).
    assert [r[1] for r in records] == [e[1] for e in launches[: len(records)]]
    first_k1_launch = core.events.index(("launch", 1))
    assert core.events[first_k1_launch + 1][:2] == ("record", 5)


def test_same_seed_same_run():
    a, b = _engine(workload="shift", seed=11), _engine(workload="shift", seed=11)
    a.run_until(30.0)
    b.run_until(30.0)
    assert a.core.state().counters == b.core.state().counters
    c = _engine(workload="shift", seed=12)
    c.run_until(30.0)
    assert c.core.state().counters != a.core.state().counters


def test_run_until_is_idempotent_and_idles_forward():
    eng = _engine(conc=0)
    eng.run_until(5.0)
    assert eng.now == 5.0 and eng.counters.decode_steps == 0
    eng.run_until(3.0)
    assert eng.now == 5.0

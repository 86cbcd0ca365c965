"""The tuner's own /metrics: served on loopback, parsed with prometheus_client's parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from policies import ArmEstimate, Buckets, PolicySnapshot
from tuner.tuner_metrics import TunerMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _snapshot(chosen: tuple[int, ...]) -> PolicySnapshot:
    buckets = Buckets((4, 64))
    return PolicySnapshot(
        policy="thompson",
        buckets=buckets,
        arms=(0, 3),
        chosen=chosen,
        estimates=(
            ArmEstimate(bucket=0, arm=3, estimate=250.0, std=5.0, n=400),
            ArmEstimate(bucket=0, arm=0, estimate=120.0, std=2.5, n=100),
            ArmEstimate(bucket=2, arm=0, estimate=3000.0, std=40.0, n=90),
        ),
    )


def test_metrics_endpoint_parses_and_reports_state() -> None:
    m = TunerMetrics()
    m.set_snapshot("a:1", _snapshot((3, 3, 0)))
    m.record_push("a:1", version=7)
    m.record_push("a:1", version=8)
    m.record_rejected_update("a:1")
    m.record_observations("a:1", 12)
    m.set_up("a:1", True)
    m.set_up("a:1", False)
    m.record_outage("a:1")
    m.set_plugin_loaded("b:2", False)
    m.record_observations("b:2", 3)
    with m.serve(port=0) as server:
        reply = httpx.get(server.url, timeout=5)
    assert reply.status_code == 200
    got = _samples(reply.text)

    def v(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert v("dynspec_chosen_arm", server="a:1", bucket="1-4") == 3
    assert v("dynspec_chosen_arm", server="a:1", bucket=">64") == 0
    assert v("dynspec_goodput_estimate_tokens_per_second", server="a:1", bucket="1-4",
             arm="3") == 250.0
    assert v("dynspec_goodput_std_tokens_per_second", server="a:1", bucket=">64",
             arm="0") == 40.0
    assert v("dynspec_estimate_decode_steps", server="a:1", bucket="1-4", arm="0") == 100
    assert v("dynspec_policy_version", server="a:1") == 8
    assert v("dynspec_pushes_total", server="a:1") == 2
    assert v("dynspec_rejected_updates_total", server="a:1") == 1
    assert v("dynspec_outages_total", server="a:1") == 1
    assert v("dynspec_observations_total", server="a:1") == 12
    assert v("dynspec_server_up", server="a:1") == 0
    assert v("dynspec_plugin_loaded", server="b:2") == 0
    assert v("dynspec_observations_total", server="b:2") == 3


def test_new_snapshot_replaces_old_series() -> None:
    m = TunerMetrics()
    m.set_snapshot("a:1", _snapshot((3, 3, 0)))
    m.set_snapshot("a:1", PolicySnapshot(policy="static", buckets=Buckets((8,)), arms=(1,),
                                         chosen=(1, 1), estimates=()))
    from prometheus_client import generate_latest

    got = _samples(generate_latest(m.registry).decode())
    chosen = {dict(k[1])["bucket"]: val for k, val in got.items() if k[0] == "dynspec_chosen_arm"}
    assert chosen == {"1-8": 1, ">8": 1}
    assert not any(k[0] == "dynspec_goodput_estimate_tokens_per_second" for k in got)


def test_own_registry_per_instance() -> None:
    a, b = TunerMetrics(), TunerMetrics()
    a.record_observations("s", 5)
    from prometheus_client import generate_latest

    assert _samples(generate_latest(a.registry).decode())
    assert _samples(generate_latest(b.registry).decode()) == {}


def test_daemon_keeps_the_metrics_up_to_date(tmp_path) -> None:
    """`run --simulate` with metrics: what /metrics says matches what the run recorded."""
    from prometheus_client import generate_latest

    from storage import Storage
    from tuner.config import SimulateConfig, TunerConfig
    from tuner.simulate import run_simulation

    m = TunerMetrics()
    url = f"sqlite:///{tmp_path / 'h.db'}"
    summary = run_simulation(
        TunerConfig(db_url=url, interval_s=1.0, decision_period_s=2.0),
        SimulateConfig(load="10:4", speed=2000, duration_s=10), metrics=m,
    )
    got = _samples(generate_latest(m.registry).decode())
    server = summary.server
    with Storage(url, read_only=True) as st:
        applied = [v for v in st.policy_versions(server=server) if v.outcome == "applied"]
        stored = st.count_observations(server=server)
    assert got[("dynspec_pushes_total", (("server", server),))] == len(applied)
    assert got[("dynspec_observations_total", (("server", server),))] == stored
    assert got[("dynspec_policy_version", (("server", server),))] == applied[-1].version
    assert got[("dynspec_server_up", (("server", server),))] == 1
    assert got[("dynspec_plugin_loaded", (("server", server),))] == 1
    assert any(name == "dynspec_chosen_arm" for name, _ in got)
    assert any(name == "dynspec_goodput_estimate_tokens_per_second" for name, _ in got)


def test_gain_over_start_k0_and_always_is_exposed_with_its_interval() -> None:
    m = TunerMetrics()
    m.set_snapshot("a:1", _snapshot((3, 3, 0)))
    m.set_tables("a:1", start=((None, 3),), current=((4, 3), (None, 0)))
    with m.serve(port=0) as srv:
        samples = _samples(httpx.get(srv.url).text)
    labels = (("baseline", "k0"), ("server", "a:1"))
    # Bucket 0 (1-4): k3 250 vs k0 120 over 500 steps; bucket 2 runs k0 either way.
    ratio = samples[("dynspec_gain_ratio", labels)]
    assert ratio > 0
    assert samples[("dynspec_gain_ratio_lower", labels)] < ratio
    assert samples[("dynspec_gain_ratio_upper", labels)] > ratio
    assert samples[("dynspec_gain_measured_share", labels)] == 1.0
    start = (("baseline", "start"), ("server", "a:1"))
    assert ("dynspec_gain_ratio", start) in samples


def test_the_gain_interval_is_the_jackknife_over_stretches_of_readings() -> None:
    """Readings whose goodput drifts from stretch to stretch widen the interval past the
    per-interval delta method's; with fewer than three stretches it is the delta method's."""
    from types import SimpleNamespace as Obs

    from tuner.tuner_metrics import GAIN_STRETCH_S

    def interval(stretches: int) -> tuple[float, float, float]:
        m = TunerMetrics()
        m.set_snapshot("a:1", _snapshot((3, 3, 0)))
        m.set_tables("a:1", start=((None, 3),), current=((4, 3), (None, 0)))
        for j in range(stretches):
            drift = 1.3 if j % 2 else 0.7  # the load's swing, shared by neighbouring readings
            m.record_sums("a:1", [Obs(b=2, k=3, emitted_tokens=250 * drift, busy_s=1.0),
                                  Obs(b=2, k=0, emitted_tokens=120.0, busy_s=1.0)],
                          now=j * GAIN_STRETCH_S + 1.0)
        with m.serve(port=0) as srv:
            samples = _samples(httpx.get(srv.url).text)
        labels = (("baseline", "k0"), ("server", "a:1"))
        return tuple(samples[(f"dynspec_gain_ratio{x}", labels)] for x in ("", "_lower",
                                                                           "_upper"))

    r0, lo0, hi0 = interval(2)
    r1, lo1, hi1 = interval(8)
    assert r0 == r1  # the point estimate stays the policy's
    assert lo0 < r0 < hi0
    assert hi1 - lo1 > 3 * (hi0 - lo0)

"""The engine feeds the plugin's acceptance estimate as the plugin's hook does, so a banded
table switches arms with the running batch's acceptance and counts steps per band."""

from __future__ import annotations

from collections import Counter

from tuner.plugin.core import PluginCore
from tuner.protocol import N_BANDS, UNKNOWN_BAND, encode_update
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop

ARMS = (0, 1, 3, 5, 7)
# One row: the unknown band drafts 3; bands 1..4 (acceptance < .55, < .70, < .85, above)
# draft 1, 3, 5 and 7.
BAND_KS = (3, 1, 3, 5, 7)


def _run(table, seconds=120.0):
    core = PluginCore(ARMS, started_at=0.0)
    assert core.apply_update(encode_update(table, 1))[0]
    eng = Engine(profile="seed-kimi-pcie", workload="diverse", core=core, seed=2,
                 load=ClosedLoop([(1e12, 1)]))
    eng.run_until(seconds)
    return core, eng


def test_a_banded_table_follows_the_running_requests_acceptance():
    core, _ = _run(((None, BAND_KS),))
    rows = core.telemetry.band_rows()
    steps = Counter()
    for r in rows:
        steps[(r.band, r.k)] += r.decode_steps
    bands = {band for band, _ in steps}
    # Requests far apart (κ = 4): one at a time, the estimate visits every known band.
    assert bands >= {1, 2, 3, 4}
    # A step counts in the band its result returns: the band after the previous step's
    # result, where its own arm was chosen one result earlier (the overlap scheduler), so
    # steps near a band's edge ran a neighbour's arm. Most ran their band's.
    for band in range(1, N_BANDS):
        ran = {k: n for (b, k), n in steps.items() if b == band}
        assert max(ran, key=ran.__getitem__) == BAND_KS[band]
    matched = sum(n for (b, k), n in steps.items() if k == BAND_KS[b])
    assert matched >= 0.75 * sum(steps.values())
    # Band counters add up to the (b, k) counters.
    by_k = Counter()
    for r in rows:
        by_k[r.k] += r.decode_steps
    assert by_k == Counter({r.k: r.decode_steps for r in core.state().counters})
    assert core.acceptance.band != UNKNOWN_BAND


def test_a_band_agnostic_table_runs_as_before_with_the_estimate_kept():
    core, eng = _run(((None, 3),), seconds=30.0)
    assert {r.k for r in core.state().counters} == {3}
    assert 0.0 < core.acceptance.alpha < 1.0
    assert eng.counters.decode_steps > 0

"""The plugin's per-position acceptance estimate, its bands, and banded decisions."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from tuner.plugin._sglang import decode_step_fn
from tuner.plugin.acceptance import STALE_STEPS, AcceptanceEstimate
from tuner.plugin.core import PluginCore
from tuner.protocol import (
    COUNTED_MAX_BATCH,
    N_BANDS,
    UNKNOWN_BAND,
    DynspecState,
    band_of,
    class_of,
    encode_update,
)

ARMS = (0, 1, 3, 5, 7)


def chain(rng: random.Random, alpha: float, k: int) -> int:
    """Accepted drafts of a k-chain whose positions each accept with ``alpha``."""
    a = 0
    while a < k and rng.random() < alpha:
        a += 1
    return a


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_the_estimate_does_not_depend_on_the_arm_that_ran(alpha):
    found = {}
    for k in (1, 3, 7):
        rng = random.Random(7)
        est = AcceptanceEstimate(decay=0.999)  # long memory: the estimator, not the noise
        for _ in range(3000):
            est.observe(k, [chain(rng, alpha, k) for _ in range(8)])
        found[k] = est.alpha
    assert all(abs(a - alpha) < 0.03 for a in found.values()), found
    # What it replaces: accepted / drafted falls as k grows at the same alpha.
    rng = random.Random(7)
    ratio = {k: sum(chain(rng, alpha, k) for _ in range(20000)) / (20000 * k) for k in (1, 7)}
    assert ratio[7] < ratio[1] - 0.1


def test_trials_count_the_positions_a_chain_reached():
    est = AcceptanceEstimate(decay=0.0)  # this step only
    # k = 3: accepted 0 tried 1, accepted 2 tried 3, accepted 3 (all) tried 3.
    est.observe(3, [0, 2, 3])
    assert (est.successes, est.trials) == (5, 7)
    assert est.band == band_of(5 / 7)
    other = AcceptanceEstimate(decay=0.0)
    other.observe_totals(3, requests=3, accepted=5, full=1)
    assert (other.successes, other.trials, other.band) == (5, 7, est.band)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_large_batches_take_the_uncounted_full_chains_at_their_expectation(alpha):
    """Above FULL_SAMPLE requests the hook passes no count of full chains; the estimate
    takes their expectation under itself, and still finds alpha (from the totals alone)."""
    for k in (1, 3, 7):
        rng = random.Random(11)
        est = AcceptanceEstimate(decay=0.999)
        for _ in range(600):
            acc = [chain(rng, alpha, k) for _ in range(64)]
            est.observe_totals(k, requests=64, accepted=sum(acc))
        assert abs(est.alpha - alpha) < 0.03, (k, est.alpha)
    # Before any estimate it starts from the per-drafted ratio, and takes none or all as
    # they are.
    first = AcceptanceEstimate(decay=0.0)
    first.observe_totals(2, requests=40, accepted=40)  # ratio 1/2: 40 * 0.25 = 10 full
    assert (first.successes, first.trials) == (40, 70)
    for accepted, trials in ((0, 40), (80, 80)):
        edge = AcceptanceEstimate(decay=0.0)
        edge.observe_totals(2, requests=40, accepted=accepted)
        assert edge.trials == trials


def test_a_step_counts_in_the_band_before_its_own_result():
    est = AcceptanceEstimate(decay=0.0)
    assert est.observe(3, [3, 3]) == UNKNOWN_BAND  # first evidence: the step saw none
    assert est.band == N_BANDS - 1
    assert est.observe(3, [0, 0]) == N_BANDS - 1
    assert est.band == 1


def test_no_drafting_for_a_while_makes_the_band_unknown_and_clears_the_evidence():
    est = AcceptanceEstimate()
    est.observe(3, [3, 3, 3])
    band = est.band
    for _ in range(STALE_STEPS - 1):
        assert est.observe(0, [0, 0, 0]) == band  # k = 0: nothing learned, nothing lost
    assert est.band == band and est.alpha is not None
    est.observe(0, [0, 0, 0])
    assert (est.band, est.alpha, est.trials) == (UNKNOWN_BAND, None, 0.0)
    est.observe(1, [1])  # one drafted step is evidence again
    assert est.band != UNKNOWN_BAND


def test_speculation_cannot_lock_off_through_a_stale_band():
    """Band 1 says k = 0; once the band is stale the unknown band's k probes, and the band
    comes back from what the probe measured."""
    core = PluginCore(ARMS, started_at=0.0)
    # Every row: unknown band k = 3, band 1 (low alpha) k = 0, the others k = 5.
    assert core.apply_update(encode_update(((None, (3, 0, 5, 5, 5)),), 1))[0]
    assert core.steps_for_batch(4) == 3  # nothing known yet
    drafted = []
    for _ in range(5 * STALE_STEPS):
        k = core.steps_for_batch(4)
        drafted.append(k)
        core.observe(k, [0] * 4)  # the drafts are never accepted
    assert drafted[:2] == [3, 0]  # one step measured alpha = 0: band 1, k = 0
    probes = [i for i, k in enumerate(drafted) if k]
    # A probe after every STALE_STEPS steps without drafting: never locked off.
    assert probes == list(range(0, 5 * STALE_STEPS, STALE_STEPS + 1))


def test_core_decides_by_batch_size_and_band_and_counts_per_band():
    core = PluginCore(ARMS, started_at=0.0)
    assert core.apply_update(encode_update(((8, (5, 1, 3, 5, 7)), (None, (1,) * N_BANDS)), 1))[0]
    rng = random.Random(3)
    it = 0
    seen = set()
    for step in range(400):
        b = 1 + step % 12
        alpha = 0.95 if step < 200 else 0.3
        k = core.steps_for_batch(b)
        seen.add((b <= 8, core.acceptance.band, k))
        acc = [chain(rng, alpha, k) for _ in range(b)]
        band = core.observe(k, acc)
        it += 1
        core.record_decode(b, k, sum(acc) + b, sum(acc), it * 0.01, it, band=band)
    assert (True, N_BANDS - 1, 7) in seen and (True, 1, 1) in seen and (False, 1, 1) in seen
    state = core.state()
    # Summed over bands, a class's band counters are the (b, k) rows of its batch sizes.
    by_class: dict[tuple[int, int], list[int]] = {}
    for c in state.counters:
        t = by_class.setdefault((class_of(c.b), c.k), [0, 0, 0])
        t[0] += c.decode_steps
        t[1] += c.b * c.decode_steps
        t[2] += c.accepted_drafts
    by_band: dict[tuple[int, int], list[int]] = {}
    for c in state.bands:
        t = by_band.setdefault((c.cls, c.k), [0, 0, 0])
        t[0] += c.decode_steps
        t[1] += c.requests
        t[2] += c.accepted_drafts
    assert by_band == by_class
    assert {c.band for c in state.bands} >= {1, N_BANDS - 1}
    assert DynspecState.from_json(core.readout()) == state.__class__.from_json(state.to_json())


def test_a_v1_core_reads_out_v1_and_refuses_v2_updates():
    core = PluginCore(ARMS, started_at=0.0, protocol=1)
    assert core.readout()["protocol"] == 1 and "bands" not in core.readout()
    ok, why = core.apply_update(encode_update(((None, 3),), 1))
    assert not ok and "this side speaks v1" in why
    assert core.apply_update(encode_update(((None, 3),), 1, protocol=1)) == (True, None)
    with pytest.raises(ValueError, match="no acceptance bands"):
        core.install(((None, (3, 1, 3, 3, 3)),), 2)


def _batch(b: int, it: int, rid: str = "r"):
    return SimpleNamespace(reqs=[SimpleNamespace(rid=f"{rid}{i}") for i in range(b)],
                           launch_ts=it * 0.01, forward_iter=it, after_idle_gap=False)


def _result(k: int, per_req: list[int]):
    return SimpleNamespace(speculative_num_draft_tokens=k + 1, num_correct_drafts=sum(per_req),
                           num_correct_drafts_per_req_cpu=per_req)


def test_every_tp_rank_holds_the_same_band_and_only_rank0_counts():
    rank0, rank1 = PluginCore(ARMS, started_at=0.0), PluginCore(ARMS, started_at=0.0)
    steps = decode_step_fn(rank0, record=True), decode_step_fn(rank1, record=False)
    rng = random.Random(5)
    for it in range(1, 300):
        k = rank0.steps_for_batch(3)
        assert rank1.steps_for_batch(3) == k
        batch, result = _batch(3, it), _result(k, [chain(rng, 0.6, k) for _ in range(3)])
        for step in steps:
            step(batch, result)
        assert (rank0.acceptance.successes, rank0.acceptance.trials) == (
            rank1.acceptance.successes, rank1.acceptance.trials)
    assert rank0.state().counters and not rank1.state().counters
    # Health checks are not traffic: they neither count nor move the estimate.
    before = (rank0.acceptance.trials, rank0.telemetry.untimed_steps)
    steps[0](_batch(1, 400, rid="HEALTH_CHECK"), _result(3, [3]))
    assert (rank0.acceptance.trials, rank0.telemetry.untimed_steps) == before


@pytest.mark.parametrize("per_req", [[0, 0, 0], [3, 3, 3], [3, 0, 2], [1] * 20 + [3] * 12])
def test_the_hook_folds_in_what_the_per_request_estimate_would(per_req):
    core = PluginCore(ARMS, started_at=0.0)
    reference = AcceptanceEstimate()
    step = decode_step_fn(core, record=False)
    for it in range(1, 4):
        step(_batch(len(per_req), it), _result(3, per_req))
        reference.observe(3, per_req)
    est = core.acceptance
    assert (est.successes, est.trials, est.band) == (
        reference.successes, reference.trials, reference.band)


def test_the_hook_counts_first_draft_rejections_where_the_band_counters_keep_them():
    """Requests that accepted no draft, per (class, band, k): on batches of up to
    COUNTED_MAX_BATCH requests at k >= 2 in a known band; the policy's shape comes from them."""
    core = PluginCore(ARMS, started_at=0.0)
    step = decode_step_fn(core, record=True)
    rng = random.Random(9)
    it = 0
    for b, k in ((4, 3), (4, 1), (COUNTED_MAX_BATCH + 1, 3)):
        for _ in range(300):
            it += 1
            step(_batch(b, it), _result(k, [chain(rng, 0.6, k) for _ in range(b)]))
    it += 1
    step(_batch(1, it), _result(3, [0]))  # commits the last step
    rows: dict[tuple[int, int], list[int]] = {}  # over the known bands
    for c in core.state().bands:
        if c.band:
            t = rows.setdefault((c.cls, c.k), [0, 0, 0])
            t[0] += c.requests
            t[1] += c.first_counted
            t[2] += c.first_rejected
    small, k1, large = rows[(class_of(4), 3)], rows[(class_of(4), 1)], rows[(class_of(33), 3)]
    assert small[0] == small[1] > 1000
    assert abs(small[2] / small[1] - 0.4) < 0.05  # 1 - alpha
    assert k1[0] > 1000 and k1[1:] == [0, 0]  # k = 1: its accepted drafts say as much
    assert large[0] > 1000 and large[1:] == [0, 0]  # above the count's batch size
    # The readout carries them, and the unknown band none.
    assert DynspecState.from_json(core.readout()).bands == core.state().bands
    assert all(c.first_rejected == 0 for c in core.state().bands if not c.band)


def test_the_default_memory_places_one_request_in_its_band_and_follows_a_change():
    """What DECAY trades: at one request drafting k = 1 (a trial per step) the batch is in its
    true band far more often than with SGLang's 0.8, yet after a fall from 0.9 to 0.25 the
    old arm stops within the real tier's bound (tests/real/test_bands_real.py: 15 steps)."""
    def share_in_band(decay: float) -> float:
        rng, est, hits, n = random.Random(3), AcceptanceEstimate(decay=decay), 0, 20_000
        for i in range(n):
            band = est.observe(1, [chain(rng, 0.78, 1)])  # 0.78: band 3 (0.70-0.85)
            hits += i >= 100 and band == 3
        return hits / (n - 100)

    assert share_in_band(AcceptanceEstimate().decay) > share_in_band(0.8) + 0.1
    ks = (3, 1, 1, 3, 3)  # unknown band, then bands 1-4, as the real tier's table
    rng, worst = random.Random(5), 0
    for _ in range(2000):
        est, k = AcceptanceEstimate(), 3
        for _ in range(60):
            est.observe(k, [chain(rng, 0.9, k) for _ in range(4)])
            k = ks[est.band]
        old = 0
        for _ in range(40):
            k = ks[est.band]
            old += k == 3
            est.observe(k, [chain(rng, 0.25, k) for _ in range(4)])
        worst = max(worst, old)
    assert 1 <= worst <= 12, worst

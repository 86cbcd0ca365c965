"""Acceptance bands in the model policy: an arm per (bucket, band) from band counters."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from policies import BandObservation, Buckets, ModelPolicy, Observation, make_policy
from policies._acceptance import chain_accepted
from policies._banded import BandBook, band_table
from tuner.protocol import validate_band_table

ARMS = (0, 1, 3, 5)
EDGES = (0.55, 0.70, 0.85)


def step_s(b: int, k: int) -> float:
    return (10 + 0.2 * b + k * (2 + 0.3 * b)) / 1000


MID_ACCEPTANCE = {0: 0.0, 1: 0.6, 3: 1.18, 5: 1.4}  # accepted drafts per request-step


def trained(seed: int = 0, acc: dict[int, float] = MID_ACCEPTANCE,
            step: Callable[[int, int], float] = step_s) -> ModelPolicy:
    """Every arm measured at 1 and 16 requests: by default at a mid acceptance (0.6 per
    position) with ``step_s``'s step times."""
    p = make_policy("model", arms=ARMS, seed=seed)
    assert isinstance(p, ModelPolicy)
    p.set_bands(EDGES)
    for _ in range(4):
        for b in (1, 16):
            for k in ARMS:
                n = 200
                a = round(acc[k] * b * n)
                p.update(Observation(b, k, n, b * n + a, a, k * b * n, n * step(b, k)))
    return p


def feed_band(p: ModelPolicy, band: int, k: int, per_position: float, n: int = 400) -> None:
    accepted = sum(per_position**i for i in range(1, k + 1))  # the chain, δ = 1
    assert p.update_bands(BandObservation(band, k, n, n, round(accepted * n)))


def test_a_band_of_high_acceptance_drafts_deeper_than_one_of_low():
    p = trained()
    j = Buckets().index(1)
    row = p.greedy_arms()[j]
    assert row == 1
    feed_band(p, 1, row, 0.1, n=4000)  # requests that accept little: drafting does not pay
    feed_band(p, 4, row, 0.95)  # requests that accept nearly all: the deepest arm pays
    table = p.greedy_bands()
    assert table is not None
    ks = next(ks for bound, ks in table if bound is None or bound >= 1)
    assert ks[0] == row  # the unknown band keeps the bucket's band-agnostic arm
    assert ks[1] == 0 and ks[4] == 5
    # Bands without evidence of their own sit at their middle, in between.
    assert ks[1] <= ks[2] <= ks[3] <= ks[4]


def test_without_bands_set_nothing_is_banded():
    p = make_policy("model", arms=ARMS, seed=0)
    assert isinstance(p, ModelPolicy)
    assert p.propose_bands() is None and p.greedy_bands() is None
    assert not p.update_bands(BandObservation(1, 3, 10, 10, 5))


def test_band_arms_stand_on_their_own_evidence_whatever_the_row_arm():
    book = BandBook(EDGES, ARMS, 0.973)
    assert book.update(BandObservation(4, 3, 500, 500, 1400), 1.0)  # 2.8 of 3 accepted
    log_t = [0.0, 0.5, 1.0, 1.5]  # each draft token dearer: only high acceptance pays
    off, on = book.arms_for(0, log_t, 0.0), book.arms_for(1, log_t, 0.0)
    assert off[0] == 0 and off[3] > 0  # the band of low acceptance stays off, the high drafts
    assert off[3] == on[3]  # the same evidence, the same arm, whatever the row runs


def test_a_band_departs_from_its_row_only_where_its_chain_agrees_with_its_cells():
    log_t = [0.0, 0.2, 0.55, 1.2]  # the row runs k = 3; k = 1 is its rival

    def band_arm(accepted_k1: float, accepted_k3: float) -> tuple[float, int]:
        book = BandBook(EDGES, ARMS, 0.973)
        # Band 3: k = 1 measured long, and a cell of the row's arm just over the request-steps
        # that let it stand on its own mean.
        assert book.update(BandObservation(3, 1, 2000, 2000, round(accepted_k1 * 2000)), 1.0)
        assert book.update(BandObservation(3, 3, 320, 320, round(accepted_k3 * 320)), 1.0)
        em = book.emitted(3)[0]
        own_gain = math.log(em[1]) - log_t[1] - (math.log(em[3]) - log_t[2])
        return own_gain, book.arms_for(3, log_t, 0.01)[2]

    # k = 1 accepts 78 % of its drafts, and the row's cell reads 1.2 of 3, far below the chain
    # through that: its own cells alone put k = 1 ahead, the chain through both does not.
    gain, arm = band_arm(0.78, 1.2)
    assert gain > 0.1 and arm == 3
    # k = 1 accepts half, and the row's cell reads as the chain through that: they agree.
    gain, arm = band_arm(0.5, 0.86)
    assert gain > 0.1 and arm == 1


def test_a_band_takes_the_chain_shape_the_pooled_acceptance_fits():
    # Acceptance that falls off past the second position (a horizon): in band 3, k = 5 ran
    # most (2.06 accepted drafts a request-step) and k = 3 a little (1.93, too few
    # request-steps to stand for itself). Through the default chain, k = 5's mean puts k = 3
    # at 1.67; through the flatter shape the server's pooled acceptance shows, nearer its own.
    book = BandBook(EDGES, ARMS, 0.973)
    assert book.update(BandObservation(3, 5, 700, 700, round(2.06 * 700)), 1.0)
    assert book.update(BandObservation(3, 3, 130, 130, round(1.93 * 130)), 1.0)
    default = book.emitted(3)[0][3]
    book.set_delta(0.86)
    em, evidence = book.emitted(3)
    assert evidence == 830 and em[5] == pytest.approx(3.06)
    assert default < 2.7 < 2.75 < em[3]


def test_the_bands_share_the_pooled_fit_of_the_chain_shape():
    def accepted(k: int) -> float:  # 0.8 a position for two positions, then 0.4
        return sum(0.8 ** min(i, 2) * 0.4 ** max(i - 2, 0) for i in range(1, k + 1))

    p = trained(acc={k: accepted(k) for k in ARMS})
    assert p.greedy_bands() is not None and p._bands is not None
    assert p._delta < 0.95 and p._bands.delta == p._delta


def test_the_bands_shape_is_measured_on_the_requests_themselves():
    # Requests accept 0.45 or 0.95 a position, both falling off by 0.9 a position. Under a
    # banded row k = 1 runs in band 1 and k = 5 in band 4: pooled per arm, the deep arm's
    # counts come from the requests that accept most, and the shape they fit rises with depth.
    def accepted(alpha: float, k: int) -> float:
        return chain_accepted(alpha, 0.9, k)

    pooled = {0: 0.0, 1: accepted(0.45, 1), 3: (accepted(0.45, 3) + accepted(0.95, 3)) / 2,
              5: accepted(0.95, 5)}
    p = trained(acc=pooled)
    assert p.greedy_bands() is not None and p._bands is not None
    assert p._delta > 1.0 and p._bands.shape() == p._delta  # nothing counted: the pooled fit
    n = 4000
    for band, alpha, k in ((1, 0.45, 3), (4, 0.95, 3), (4, 0.95, 5)):
        # A step's requests that accepted no draft: 1 - alpha of those looked at.
        assert p.update_bands(BandObservation(band, k, n, n, round(accepted(alpha, k) * n),
                                              n, round((1 - alpha) * n)))
    assert p._delta > 1.0 and p._bands.shape() == pytest.approx(0.9, abs=0.01)
    # Band 1's deeper arm through its chain: near the requests' own, not the pooled shape's.
    assert p._bands.emitted(1)[0][5] == pytest.approx(1 + accepted(0.45, 5), abs=0.03)
    # A measured shape above the pooled fit (a mixture of requests in each band) does not
    # raise it.
    q = trained()
    assert q.greedy_bands() is not None and q._bands is not None
    for k in (3, 5):
        rising = chain_accepted(0.6, 1.1, k)
        assert q.update_bands(BandObservation(2, k, n, n, round(rising * n), n, round(0.4 * n)))
    assert q._bands.shape() == q._delta < 1.05


def test_the_pooled_shape_bounds_the_bands_only_once_two_depths_measured_it():
    # Acceptance that rises with depth (0.6 a position at first, 1.1 times more each
    # further one), measured in band 2 at k = 3 on the requests themselves.
    book = BandBook(EDGES, ARMS, 0.973)
    n, rising = 4000, chain_accepted(0.6, 1.1, 3)
    assert book.update(BandObservation(2, 3, n, n, round(rising * n), n, round(0.4 * n)), 1.0)
    assert book.shape() == 0.973  # a pooled δ measured at two depths bounds the bands'
    bounded = book.emitted(2)[0][5]
    book.set_delta(0.973, measured=False)  # the policy's prior: no bound
    assert book.shape() == pytest.approx(1.1, abs=0.01)
    # The band's deeper arm through its own shape, not the prior's falling chain.
    assert book.emitted(2)[0][5] == pytest.approx(1 + chain_accepted(0.6, 1.1, 5), abs=0.05)
    assert book.emitted(2)[0][5] > bounded + 0.15


def test_the_policy_says_whether_its_chain_shape_is_measured():
    p = make_policy("model", arms=ARMS, seed=0)
    assert isinstance(p, ModelPolicy)
    p.set_bands(EDGES)
    for _ in range(4):  # one depth only, however long
        p.update(Observation(1, 3, 200, 200 + 236, 236, 600, 200 * step_s(1, 3)))
    assert p.greedy_bands() is not None and p._bands is not None
    assert not p._delta_measured() and not p._bands._delta_measured
    q = trained()  # every arm measured at length
    assert q.greedy_bands() is not None and q._bands is not None
    assert q._delta_measured() and q._bands._delta_measured


def cheap_drafts_low_acceptance() -> ModelPolicy:
    """Drafts cheap but rarely accepted (0.1 per position): the greedy table is off."""
    return trained(acc={0: 0.0, 1: 0.1, 3: 0.111, 5: 0.111},
                   step=lambda b, k: (10 + 0.2 * b + k * (1 + 0.1 * b)) / 1000)


def test_a_row_that_does_not_draft_drafts_in_a_band_of_high_acceptance():
    p = cheap_drafts_low_acceptance()
    j = Buckets().index(16)
    assert p.greedy_arms()[j] == 0
    feed_band(p, 1, 1, 0.1)
    feed_band(p, 4, 3, 0.95)  # requests that accept nearly all: drafting pays even here
    table = p.greedy_bands()
    assert table is not None
    ks = next(ks for bound, ks in table if bound is None or bound >= 16)
    assert ks[1] == 0 and ks[4] > 0
    # The protocol's rule: the unknown band drafts where a band does (its shallowest arm),
    # so a stale "off" band is measured again; the server accepts the table.
    assert ks[0] == min(k for k in ks[1:] if k > 0)
    assert validate_band_table([[bound, *ks] for bound, ks in table], ARMS) == table


def row_at(p: ModelPolicy, b: int) -> tuple[int, ...]:
    table = p.greedy_bands()
    assert table is not None
    return next(ks for bound, ks in table if bound is None or bound >= b)


def test_a_row_that_is_off_drafts_only_in_bands_its_batches_reach():
    """Keeping an "off" band fresh costs probe steps at a drafting arm: a band of high
    acceptance that batches of this size never reach must not make an off row draft."""
    p = cheap_drafts_low_acceptance()
    feed_band(p, 1, 1, 0.1)
    feed_band(p, 4, 3, 0.95)  # seen at one request
    assert row_at(p, 16)[4] > 0  # no occupancy at 16 yet: the pooled spread of bands
    # At 16 requests every step sits in band 1 (the batch averages its requests out).
    # Steps at k = 0 say where the batches sat, nothing of acceptance.
    assert not p.update_bands(BandObservation(1, 0, 2000, 32000, 0))
    assert row_at(p, 16) == (0,) * 5
    assert row_at(p, 1)[4] > 0  # one request's batches do reach band 4
    # Batches of 16 that sit in band 4 a third of the time: drafting there pays its probes.
    p.update_bands(BandObservation(4, 0, 1000, 16000, 0))
    assert row_at(p, 16)[4] > 0


def test_an_off_row_forgets_where_its_batches_sat_and_drafts_again():
    """A row that is off measures no band: the requests that put every step in band 1 are
    long gone after minutes at k = 0, so the row's occupancy forgets them (the bucket's busy
    time, any arm) and its bands of high acceptance draft again, probes and all."""
    p = cheap_drafts_low_acceptance()
    feed_band(p, 1, 1, 0.1)
    feed_band(p, 4, 3, 0.95)
    assert not p.update_bands(BandObservation(1, 0, 2000, 32000, 0))
    assert row_at(p, 16) == (0,) * 5

    def off_for(seconds: float) -> None:
        n = round(seconds / step_s(16, 0))
        p.update(Observation(16, 0, n, 16 * n, 0, 0, n * step_s(16, 0)))

    off_for(5.0)  # a few seconds: still where the batches sat
    assert row_at(p, 16) == (0,) * 5
    for _ in range(10):
        off_for(30.0)  # minutes off: the evidence is gone, the bands' spread is the prior
    assert row_at(p, 16)[4] > 0


def test_the_probe_rule_matches_the_plugin():
    from policies._banded import _STALE_STEPS
    from tuner.plugin.acceptance import STALE_STEPS

    assert _STALE_STEPS == STALE_STEPS


def test_band_acceptance_forgets_with_drafting_busy_seconds():
    p = trained()
    feed_band(p, 4, 3, 0.95)
    high = p._bands.emitted(4)[0][3]
    # Minutes of drafting later (8x the 30 s acceptance memory), the band accepts little.
    for _ in range(10):
        p.update(Observation(1, 1, 2000, 2000 + 1200, 1200, 2000, 2000 * step_s(1, 1)))
    # A refused band reading ages nothing and loses none of those seconds.
    assert not p.update_bands(BandObservation(4, 3, 10, 10, 31))
    feed_band(p, 4, 3, 0.3)
    low = p._bands.emitted(4)[0][3]
    assert high > 3.5 and low < 1.5, (high, low)  # the old evidence is gone, not averaged in


def test_an_exploring_row_explores_in_every_band():
    p = trained()
    feed_band(p, 4, 3, 0.95)
    greedy = p.greedy_arms()
    explore = [1 if g == 3 else 3 for g in greedy]
    rows = p._banded(explore, greedy)
    assert all(ks == (ks[0],) * len(ks) for _, ks in rows)


@pytest.mark.parametrize("bad", [BandObservation(1, 3, 10, 10, 31), BandObservation(0, 3, 1, 1, 0),
                                 BandObservation(9, 3, 1, 1, 0), BandObservation(2, 2, 1, 1, 0),
                                 BandObservation(2, 0, 1, 1, 0), BandObservation(2, 3, 1, -1, 0),
                                 BandObservation(2, 3, 1, 4, 2, 4, 5),
                                 BandObservation(2, 3, 1, 4, 2, 5, 1)])
def test_unusable_band_observations_are_refused(bad):
    book = BandBook(EDGES, ARMS, 0.973)
    assert not book.update(bad, 1.0)


def test_band_edges_are_validated():
    for edges in ((0.7, 0.55), (0.0, 0.5), (0.5, 1.2), (0.5, 0.5)):
        with pytest.raises(ValueError, match="band edges"):
            BandBook(edges, ARMS, 0.973)


def test_band_tables_merge_equal_neighbours_and_end_unbounded():
    assert band_table([1, 2, 4, None], [(3, 1, 3), (3, 1, 3), (1, 1, 1), (1, 1, 1)]) == (
        (2, (3, 1, 3)), (None, (1, 1, 1)))

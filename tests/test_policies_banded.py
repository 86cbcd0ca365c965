"""Acceptance bands in the model policy: an arm per (bucket, band) from band counters."""

from __future__ import annotations

import pytest

from policies import BandObservation, Buckets, ModelPolicy, Observation, make_policy
from policies._banded import BandBook, band_table

ARMS = (0, 1, 3, 5)
EDGES = (0.55, 0.70, 0.85)


def step_s(b: int, k: int) -> float:
    return (10 + 0.2 * b + k * (2 + 0.3 * b)) / 1000


def trained(seed: int = 0) -> ModelPolicy:
    """Every arm measured at 1 and 16 requests at a mid acceptance (0.6 per position)."""
    p = make_policy("model", arms=ARMS, seed=seed)
    assert isinstance(p, ModelPolicy)
    p.set_bands(EDGES)
    acc = {0: 0.0, 1: 0.6, 3: 1.18, 5: 1.4}
    for _ in range(4):
        for b in (1, 16):
            for k in ARMS:
                n = 200
                a = round(acc[k] * b * n)
                p.update(Observation(b, k, n, b * n + a, a, k * b * n, n * step_s(b, k)))
    return p


def feed_band(p: ModelPolicy, band: int, k: int, per_position: float, n: int = 400) -> None:
    accepted = sum(per_position**i for i in range(1, k + 1))  # the chain, δ = 1
    assert p.update_bands(BandObservation(band, k, n, n, round(accepted * n)))


def test_a_band_of_high_acceptance_drafts_deeper_than_one_of_low():
    p = trained()
    j = Buckets().index(1)
    row = p.greedy_arms()[j]
    assert row == 1
    feed_band(p, 1, row, 0.1)  # requests that accept little: drafting does not pay
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


def test_a_row_that_does_not_draft_drafts_in_no_band():
    # The protocol refuses a row whose unknown band is off while a known band drafts.
    book = BandBook(EDGES, ARMS, 0.973)
    assert book.update(BandObservation(4, 3, 500, 500, 1400), 1.0)
    assert book.arms_for(0, [0.0, 0.0, 0.0, 0.0], 0.0) == (0, 0, 0, 0)
    assert book.arms_for(1, [0.0, 0.0, 0.0, 0.0], 0.0)[3] == 5


def test_an_exploring_row_explores_in_every_band():
    p = trained()
    feed_band(p, 4, 3, 0.95)
    greedy = p.greedy_arms()
    explore = [3 if g == 1 else g for g in greedy]
    rows = p._banded(explore, greedy)
    assert all(ks == (ks[0],) * len(ks) for _, ks in rows)


@pytest.mark.parametrize("bad", [BandObservation(1, 3, 10, 10, 31), BandObservation(0, 3, 1, 1, 0),
                                 BandObservation(9, 3, 1, 1, 0), BandObservation(2, 2, 1, 1, 0),
                                 BandObservation(2, 0, 1, 1, 0), BandObservation(2, 3, 1, -1, 0)])
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

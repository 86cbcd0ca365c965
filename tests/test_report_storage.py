"""The two report queries added to Storage: moments() and observation_span()."""

from __future__ import annotations

import pytest

from storage import ObservationRecord, Storage


@pytest.fixture
def url(db_url: str) -> str:
    """A fresh database on each backend (tests/conftest.py: SQLite, then PostgreSQL)."""
    return db_url


def _obs(ts: float, b: int, k: int, e: int, t: float, server: str = "s:1") -> ObservationRecord:
    return ObservationRecord(server=server, ts=ts, b=b, k=k, decode_steps=10, emitted_tokens=e,
                             accepted_drafts=e // 4, drafted_tokens=e // 2, busy_s=t)


def test_moments_sum_squares_per_bin_b_k(url: str) -> None:
    rows = [_obs(100.0, 4, 3, 40, 0.5), _obs(104.0, 4, 3, 60, 0.5), _obs(111.0, 4, 3, 10, 0.25),
            _obs(101.0, 8, 0, 80, 1.0), _obs(101.0, 8, 0, 7, 1.0, server="other:2")]
    with Storage(url) as st:
        st.record_tick(observations=rows)
        assert st.observation_span() == (100.0, 111.0)
        assert st.observation_span(server="s:1", since=101.0) == (101.0, 111.0)
        assert st.observation_span(server="nobody:1") is None

        whole = {(m.server, m.b, m.k): m for m in st.moments()}
        m = whole[("s:1", 4, 3)]
        assert (m.bin, m.rows, m.emitted_tokens, m.busy_s) == (0, 3, 110, 1.25)
        assert m.emitted_sq == 40 * 40 + 60 * 60 + 10 * 10
        assert m.emitted_busy == pytest.approx(40 * 0.5 + 60 * 0.5 + 10 * 0.25)
        assert m.busy_sq == pytest.approx(0.25 + 0.25 + 0.0625)
        assert (m.first_ts, m.last_ts) == (100.0, 111.0)

        binned = st.moments(server="s:1", bin_s=5.0, origin=100.0)
        assert [(x.bin, x.b, x.k, x.rows) for x in binned] == [
            (0, 4, 3, 2), (0, 8, 0, 1), (2, 4, 3, 1)
        ]
        assert st.moments(server="s:1", since=104.0, until=111.0)[0].emitted_tokens == 60
        with pytest.raises(ValueError):
            st.moments(bin_s=0)


def test_moments_bins_are_floored_below_the_origin(url: str) -> None:
    huge = 1 << 20
    rows = [_obs(100.0, huge + 3, 1, 40, 0.5), _obs(100.0, 3, 1, 60, 0.5),
            _obs(90.0, 3, 1, 6, 0.5)]  # before the origin: bin -1 (floor, not truncation)
    with Storage(url) as st:
        st.record_tick(observations=rows)
        got = [(m.bin, m.b, m.k, m.emitted_tokens) for m in st.moments(bin_s=5.0, origin=92.0)]
    assert got == [(-1, 3, 1, 6), (1, 3, 1, 60), (1, huge + 3, 1, 40)]

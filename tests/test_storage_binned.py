"""SQLite's time-binned moments read from the covering index (storage._binned) give what the
grouped query gives: same groups, same sums, same report."""

from __future__ import annotations

import random
import shutil
import sqlite3
from pathlib import Path

import pytest

import storage._binned as binned
from storage import ObservationRecord, PolicyVersionRecord, ServerSeen, Storage
from tuner.report import build_report, render_json

ARMS = (0, 1, 3)
T0 = 1_764_400_000.0


def _history(path: Path, *, rows: int = 4000, seed: int = 3) -> None:
    """Two servers, a few (b, k), times on and beside the report's bin edges, a roll-up."""
    rng = random.Random(seed)
    url = f"sqlite:///{path}"
    with Storage(url) as st:
        st.record_tick(servers=[ServerSeen(s, ARMS, T0, T0) for s in ("a:1", "b:2")])
        obs = []
        for i in range(rows):
            ts = T0 + 7200.0 * i / rows
            if i % 97 == 0:  # exactly on an edge of 60 s bins from T0
                ts = T0 + 60.0 * (i % 120)
            b, k = rng.choice((1, 2, 8, 32)), rng.choice(ARMS)
            steps = rng.randint(5, 50)
            busy = steps * (0.01 + 0.0003 * b) * rng.uniform(0.8, 1.3)
            acc = int(steps * b * k * 0.5 * rng.uniform(0.7, 1.2))
            obs.append(ObservationRecord("a:1" if i % 3 else "b:2", ts, b, k, steps,
                                         steps * b + acc, acc, steps * b * k, busy))
        st.record_tick(observations=obs)
        st.record_tick(policy_versions=[
            PolicyVersionRecord("a:1", T0 + 600.0 * v, v + 1, ((8, 3), (None, 0)), "model",
                                "explore", "applied") for v in range(10)])
        # Rolled-up rows carry their own moments (non-NULL columns) and share time stamps.
        assert st.rollup(older_than=T0 + 1800.0, bin_s=300.0) > 0


@pytest.fixture
def pair(tmp_path: Path) -> tuple[str, str]:
    """The same history twice: with the covering index (a writer made it) and without."""
    fast = tmp_path / "fast.db"
    _history(fast)
    slow = tmp_path / "slow.db"
    shutil.copy(fast, slow)
    with sqlite3.connect(slow) as c:
        c.execute(f"DROP INDEX {binned.COVERING_INDEX}")
    return f"sqlite:///{fast}", f"sqlite:///{slow}"


@pytest.fixture
def anysize(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-group queries on however few rows (a small history is enough to compare)."""
    monkeypatch.setattr(binned, "MIN_ROWS_PER_QUERY", 0)


@pytest.fixture
def used(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each moments() call answered from the covering index."""
    calls: list[bool] = []
    real = binned.binned_moments

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("storage._queries.binned_moments", spy)
    return calls


def _key(m) -> tuple:  # noqa: ANN001
    return (m.server, m.bin, m.b, m.k)


def _same(got: list, want: list) -> None:
    assert [_key(m) for m in got] == [_key(m) for m in want]
    for g, w in zip(got, want, strict=True):
        assert (g.rows, g.decode_steps, g.emitted_tokens, g.accepted_drafts,
                g.drafted_tokens, g.first_ts, g.last_ts) == (
            w.rows, w.decode_steps, w.emitted_tokens, w.accepted_drafts, w.drafted_tokens,
            w.first_ts, w.last_ts), _key(g)
        for name in ("busy_s", "emitted_sq", "emitted_busy", "busy_sq"):
            assert getattr(g, name) == pytest.approx(getattr(w, name), rel=1e-12), name


@pytest.mark.parametrize("query", [
    {"bin_s": 60.0, "origin": T0},  # rows exactly on bin edges
    {"bin_s": 150.0, "origin": T0 + 37.5},  # rows before the origin: negative bins
    {"bin_s": 150.0 * (1 + 1e-9), "origin": T0, "server": "a:1"},  # the report's binning
    {"bin_s": 90.0, "origin": T0 + 1000.0, "since": T0 + 1000.0, "until": T0 + 5000.0},
])
def test_covering_index_gives_the_grouped_query_s_moments(
    pair: tuple[str, str], used: list[bool], anysize: None, query: dict
) -> None:
    fast, slow = pair
    with Storage(fast, read_only=True) as a, Storage(slow, read_only=True) as b:
        got = a.moments(**query)
        want = b.moments(**query)
    assert used == [True], "the covering index was not read"
    assert len(want) > 20
    _same(got, want)


def test_report_is_the_same_with_and_without_the_index(
    pair: tuple[str, str], used: list[bool], anysize: None
) -> None:
    fast, slow = pair
    out = []
    for url in pair:
        with Storage(url, read_only=True) as st:
            out.append(render_json(build_report(st, time_bins=24, now=0.0)).replace(url, "DB"))
    assert used == [True]
    assert out[0] == out[1]
    assert '"observations": ' in out[0]


def test_small_or_finely_binned_histories_run_the_grouped_query(
    tmp_path: Path, used: list[bool]
) -> None:
    path = tmp_path / "small.db"
    _history(path, rows=200)
    with Storage(f"sqlite:///{path}", read_only=True) as st:
        few = st.moments(bin_s=600.0, origin=T0)
        assert used == [False]  # 200 rows, far fewer than 32 per per-group query
        assert sum(m.rows for m in few) == sum(m.rows for m in st.moments())


def test_a_writer_builds_the_index_on_a_history_without_it(pair: tuple[str, str]) -> None:
    _fast, slow = pair
    path = slow.removeprefix("sqlite:///")

    def has_index() -> bool:
        with sqlite3.connect(path) as c:
            return c.execute("SELECT 1 FROM sqlite_master WHERE name = ?",
                             (binned.COVERING_INDEX,)).fetchone() is not None

    with Storage(slow, read_only=True):
        pass
    assert not has_index()  # readers never write
    with Storage(slow):
        pass
    assert has_index()


@pytest.mark.parametrize("parallel", [True, False])
def test_two_connections_or_one_give_the_same_groups(
    pair: tuple[str, str], anysize: None, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    monkeypatch.setattr(binned, "PARALLEL_MIN_QUERIES", 0 if parallel else 10**9)
    runs: list[int] = []
    real = binned._run

    def spy(conn, sql, tasks):  # noqa: ANN001, ANN202
        runs.append(len(tasks))
        return real(conn, sql, tasks)

    monkeypatch.setattr(binned, "_run", spy)
    fast, slow = pair
    query = {"bin_s": 60.0, "origin": T0}
    with Storage(fast, read_only=True) as a, Storage(slow, read_only=True) as b:
        got = a.moments(**query)
        want = b.moments(**query)
    assert len(runs) == (2 if parallel else 1) and sum(runs) > 1000
    _same(got, want)

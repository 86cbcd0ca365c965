"""The plugin's acceptance estimate, computed from the verify output SGLang's own decode-result
processing hands the hook (real ``Req``/``ScheduleBatch``/``GenerationBatchResult``, real
``_resolve_spec_v2_tokens``), identical on every TP rank, and steering the lookup by band."""

from __future__ import annotations

import pytest
from _contract_env import need, write_config

need()

from test_decode_telemetry import ARMS, Server  # noqa: E402

from tuner.plugin import _sglang  # noqa: E402
from tuner.plugin.acceptance import STALE_STEPS  # noqa: E402
from tuner.plugin.launch import adaptive_config  # noqa: E402
from tuner.protocol import (  # noqa: E402
    COUNTED_MAX_BATCH,
    DEPTH_EVERY,
    UNKNOWN_BAND,
    DepthCounter,
    band_of,
    encode_update,
)

pytestmark = pytest.mark.contract

# Unknown band: k = 3; band 1 (alpha < 0.55): off; the others: k = 5.
TABLE = ((None, (3, 0, 5, 5, 5)),)


@pytest.fixture
def servers(sglang_plugin, published, tmp_path, monkeypatch):
    """Two TP ranks of one server: rank 0 counts, rank 1 only estimates."""
    cfg = write_config(tmp_path, adaptive_config(ARMS))
    rank0 = Server(cfg)
    monkeypatch.setattr(_sglang, "_is_tp_rank0", lambda: False)
    rank1 = Server(cfg)
    for s in (rank0, rank1):
        assert s.policy.dynspec.apply_update(encode_update(TABLE, 1))[0]
    return rank0, rank1


def launch(servers, b: int) -> int:
    """Both ranks' decision for the next launch (they must agree)."""
    ks = {s.policy.get_steps_for_batch(b) for s in servers}
    assert len(ks) == 1, ks
    return ks.pop()


def test_the_estimate_comes_from_the_verify_output_and_is_the_same_on_every_rank(servers):
    rank0, rank1 = servers
    assert launch(servers, 3) == 3  # nothing known: the unknown band's k
    # accept_lens include the bonus token: k = 3 accepted 2, 0, 3 -> tried 3, 1, 3.
    for s in servers:
        s.step(k=3, accept_lens=[3, 1, 4], it=1, ts=10.0)
    est = rank0.policy.dynspec.acceptance
    assert (est.successes, est.trials) == (5, 7)
    assert est.band == band_of(5 / 7) and launch(servers, 3) == 5
    # Poor acceptance moves both ranks to band 1 at the same step.
    it = 1
    while rank0.policy.dynspec.acceptance.band != 1:
        it += 1
        k = launch(servers, 3)
        for s in servers:
            s.step(k=k, accept_lens=[1, 1, 2], it=it, ts=10.0 + 0.02 * it)
        assert it < 30
    assert launch(servers, 3) == 0
    e0, e1 = rank0.policy.dynspec.acceptance, rank1.policy.dynspec.acceptance
    assert (e0.successes, e0.trials, e0.band) == (e1.successes, e1.trials, e1.band)
    # Only rank 0 keeps counters, split by the band each step ran in (a step is committed
    # when the next one launches).
    for s in servers:
        s.step(k=0, accept_lens=[1, 1, 1], it=it + 1, ts=10.0 + 0.02 * (it + 1))
    assert rank0.rows() and not rank1.rows()
    bands = rank0.policy.dynspec.state().bands
    assert {c.band for c in bands} == {UNKNOWN_BAND, band_of(5 / 7)}  # the last is pending
    # Requests that accepted no draft, where the shape is learnt from them (a known band,
    # k >= 2): accepted 0, 0, 1 of 5 drafts, every step since the first.
    known = [c for c in bands if c.band != UNKNOWN_BAND]
    assert known and all(c.k == 5 and c.first_counted == c.requests for c in known)
    assert all(3 * c.first_rejected == 2 * c.requests for c in known)
    assert all(c.first_rejected == 0 for c in bands if c.band == UNKNOWN_BAND)


def test_how_many_drafts_each_request_accepted_is_counted_on_the_sampled_forwards(servers):
    """From the same verify output: rank 0 counts, per chain arm, the requests that accepted
    0..k drafts, on one forward in DEPTH_EVERY; of a larger batch, COUNTED_MAX_BATCH spread
    over it."""
    rank0, rank1 = servers
    for it in range(1, 2 * DEPTH_EVERY + 1):
        for s in servers:
            # accept_lens include the bonus token: at k = 5, accepted 0, 2 and 5 drafts.
            s.step(k=5, accept_lens=[1, 3, 6], it=it, ts=10.0 + 0.02 * it)
    # 64 requests: the first half accepted 1 of 3 drafts, the second all 3; every other one
    # is counted.
    big = [2] * COUNTED_MAX_BATCH + [4] * COUNTED_MAX_BATCH
    for s in servers:
        s.step(k=3, accept_lens=big, it=3 * DEPTH_EVERY, ts=11.0)
    assert rank0.policy.dynspec.state().depths == (
        DepthCounter(3, (0, 16, 0, 16)), DepthCounter(5, (2, 0, 2, 0, 0, 2)))
    assert rank1.policy.dynspec.state().depths == ()
    raw = rank0.policy.dynspec.readout()
    assert raw["depths"] == [[3, "0,G,0,G"], [5, "2,0,2,0,0,2"]]


def test_steps_without_drafting_make_the_band_unknown_and_the_unknown_band_probes(servers):
    for s in servers:
        s.step(k=3, accept_lens=[1, 1], it=1, ts=1.0)  # alpha 0: band 1
    assert launch(servers, 2) == 0
    it = 1
    # The k = 0 steps that follow: one token per request (accept_lens all 1).
    for _ in range(STALE_STEPS):
        it += 1
        for s in servers:
            s.step(k=0, accept_lens=[1, 1], it=it, ts=1.0 + 0.01 * it)
    assert rank_band(servers) == UNKNOWN_BAND and launch(servers, 2) == 3


def rank_band(servers) -> int:
    bands = {s.policy.dynspec.acceptance.band for s in servers}
    assert len(bands) == 1
    return bands.pop()


def test_a_banded_policy_file_steers_by_band_from_the_first_step(
    sglang_plugin, published, tmp_path, monkeypatch
):
    """A server started with an exported banded table (``DYNSPEC_POLICY_FILE``) decides by
    the band from its first steps, before any daemon pushes."""
    from tuner import policyfile
    from tuner.protocol import band_agnostic

    pf = policyfile.PolicyFile(table=band_agnostic(TABLE), arms=ARMS, policy_version=4,
                               bands=TABLE)
    monkeypatch.setenv(_sglang.POLICY_FILE_ENV, str(policyfile.save(pf, tmp_path / "p.json")))
    server = Server(write_config(tmp_path, adaptive_config(ARMS)))
    core = server.policy.dynspec
    assert (core.band_table, core.version, core.updates_rejected) == (TABLE, 4, 0)
    assert launch([server], 3) == 3  # nothing known yet: the unknown band's k
    server.step(k=3, accept_lens=[4, 4, 4], it=1, ts=10.0)  # every draft accepted
    assert core.acceptance.band == 4 and launch([server], 3) == 5

"""The plugin inside a real SGLang 0.5.23 server: live hooks, its arms, and per-(b, k)
counters that agree with what SGLang itself reports for each request."""

from __future__ import annotations

from _drive import counters, pin
from _server import ARMS, generate, readout

from tuner.protocol import PROTOCOL_VERSION, DynspecState, counter_deltas


def settle(url: str) -> None:
    generate(url, 1, max_new_tokens=1, seed=99)


def test_readout_is_live_with_the_configured_arms(plugin_server):
    state = DynspecState.from_json(readout(plugin_server.url))
    assert state.hooks_live, "the plugin's hooks are not live in the scheduler"
    assert tuple(state.arms) == ARMS
    assert state.protocol == PROTOCOL_VERSION
    assert "Failed to apply hooks" not in plugin_server.log_text()


def test_counters_per_batch_size_and_arm_match_the_requests_sent(plugin_server):
    url = plugin_server.url
    for k, n, max_new in ((1, 3, 12), (3, 2, 16), (0, 4, 10)):
        pin(url, k)
        # The plugin commits a decode step when the next forward launches. A prefill-only
        # request (one token: a forward with no decode step of its own) commits whatever step
        # is still pending, here one left by an earlier test on this shared server, so that
        # every step counted below holds the burst's requests, and after the burst it
        # commits the burst's last step. That step has no duration (the scheduler idled
        # before the next forward: SGLang's after_idle_gap), so it counts as untimed.
        settle(url)
        untimed_before = readout(url)["untimed_steps"]
        before = counters(url)
        outs = generate(url, n, max_new_tokens=max_new, seed=k)
        settle(url)
        deltas = counter_deltas(before, counters(url))
        assert deltas is not None
        untimed = readout(url)["untimed_steps"] - untimed_before
        meta = [o["meta_info"] for o in outs]
        assert all(len(o["output_ids"]) == max_new for o in outs)
        # Every decode step ran on the pinned arm, at batch sizes no larger than the batch.
        assert {d.k for d in deltas} == {k}, deltas
        assert all(1 <= d.b <= n for d in deltas)
        assert all(d.busy_s > 0 for d in deltas)
        assert sum(d.drafted_tokens for d in deltas) == k * sum(d.decode_steps * d.b for d in deltas)
        # SGLang counts every verify pass of a request (spec_verify_ct) and its accepted drafts,
        # so their sums over the burst are the plugin's steps x b and accepted drafts, except
        # for untimed steps (counted in untimed_steps only): the burst's last one always, and
        # any whose gap to the next forward exceeded MAX_STEP_GAP_S (a loaded machine). Each
        # untimed step holds between 1 and n of the burst's requests.
        verifies = sum(m["spec_verify_ct"] for m in meta)
        correct = sum(m["spec_num_correct_drafts"] for m in meta)
        timed = sum(d.decode_steps * d.b for d in deltas)
        assert untimed >= 1
        assert untimed <= verifies - timed <= untimed * n, (verifies, timed, untimed)
        missed = verifies - timed  # request-verifies in untimed steps
        assert 0 <= correct - sum(d.accepted_drafts for d in deltas) <= k * missed
        # Tokens: one per request-verify plus its accepted drafts.
        emitted = sum(d.emitted_tokens for d in deltas)
        assert 0 <= verifies + correct - emitted <= (k + 1) * missed
        assert verifies + correct >= n * (max_new - 1)

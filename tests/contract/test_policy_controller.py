"""SGLang's ``AdaptiveController`` drives the plugin's policy class (as ``load_plugins`` left it)."""

from __future__ import annotations

import logging

import pytest
from _contract_env import need, spec_worker, stock_adaptive_params, write_config

need()

from sglang.srt.speculative import adaptive_spec_params as asp  # noqa: E402

from tuner import policyfile  # noqa: E402
from tuner.plugin.launch import adaptive_config  # noqa: E402
from tuner.protocol import encode_update  # noqa: E402

pytestmark = pytest.mark.contract

ARMS = [0, 1, 2, 3, 5]
GRAPH_BS = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 128, 256]


@pytest.fixture
def policy_class(sglang_plugin):
    return asp.AdaptiveSpeculativeParams  # what EAGLEWorkerV2 constructs after load_plugins


@pytest.fixture
def cfg(tmp_path):
    return write_config(tmp_path, adaptive_config(ARMS))  # what `sglang-args` writes


def make(policy_class, cfg, initial_steps=2):
    policy = policy_class(initial_steps=initial_steps, cfg_path=cfg)
    return policy, spec_worker(policy, initial_steps=initial_steps, graph_bs=GRAPH_BS)


def test_init_states_builds_exactly_the_configured_arms_with_full_graphs(policy_class, cfg):
    policy, worker = make(policy_class, cfg)
    assert isinstance(policy, stock_adaptive_params())
    assert policy.dynspec.arms == tuple(ARMS)
    # The startup state (2) was registered; SGLang builds the others, each with every graph BS.
    assert worker.built == [(k, GRAPH_BS) for k in ARMS if k != 2]
    assert sorted(worker.adaptive_controller._states) == ARMS


def test_activation_follows_the_table_and_an_update_changes_the_next_one(policy_class, cfg):
    policy, worker = make(policy_class, cfg)
    ctl = worker.adaptive_controller
    for b in (1, 7, 200):  # default table: the server's initial step everywhere, no switch
        worker.activate_step_by_batch(b)
        assert worker.speculative_num_steps == 2
    assert worker.applied == []

    ok, why = policy.dynspec.apply_update(encode_update(((4, 5), (32, 1), (None, 0)), 1))
    assert ok, why
    seen = []
    for b in (1, 4, 5, 32, 33, 256, 2):
        ctl.activate_step_by_batch(b)
        seen.append(worker.speculative_num_steps)
    assert seen == [5, 5, 1, 1, 0, 0, 5]
    assert worker.applied == [5, 1, 0, 5]


def test_verify_results_never_switch_on_their_own(policy_class, cfg):
    policy, worker = make(policy_class, cfg)
    for _ in range(200):  # far past SGLang's warmup and update interval
        worker.on_verify_complete_cpu([5, 5, 5], batch_size=3)
        worker.on_verify_complete_cpu([0, 0, 0], batch_size=3)
    assert worker.applied == [] and worker.speculative_num_steps == 2


def test_a_table_naming_an_unbuilt_arm_never_reaches_activate(policy_class, cfg, monkeypatch):
    policy, worker = make(policy_class, cfg)
    ctl = worker.adaptive_controller
    asked = []
    real_activate = ctl._activate
    monkeypatch.setattr(ctl, "_activate", lambda k: (asked.append(k), real_activate(k))[1])

    ok, why = policy.dynspec.apply_update(encode_update(((8, 7), (None, 0)), 1))
    assert not ok and "k=7 is not a built arm" in why
    for b in range(1, 300):
        ctl.activate_step_by_batch(b)
    assert asked == [] and worker.speculative_num_steps == 2
    # SGLang itself would have raised: the trap is real.
    with pytest.raises(ValueError, match="Missing adaptive runtime state for steps=7"):
        real_activate(7)


def test_a_policy_file_sets_the_first_table(policy_class, cfg, tmp_path, monkeypatch):
    pf = policyfile.PolicyFile(table=((8, 3), (None, 0)), arms=ARMS, policy_version=9)
    monkeypatch.setenv("DYNSPEC_POLICY_FILE", str(policyfile.save(pf, tmp_path / "p.json")))
    policy, worker = make(policy_class, cfg)
    assert (policy.dynspec.table, policy.dynspec.version) == (((8, 3), (None, 0)), 9)
    worker.activate_step_by_batch(8)
    worker.activate_step_by_batch(9)
    assert worker.applied == [3, 0]


def test_a_policy_file_with_an_unbuilt_arm_starts_the_default_table(
    policy_class, cfg, tmp_path, monkeypatch, caplog
):
    pf = policyfile.PolicyFile(table=((8, 7), (None, 0)), arms=[0, 7], policy_version=9)
    monkeypatch.setenv("DYNSPEC_POLICY_FILE", str(policyfile.save(pf, tmp_path / "p.json")))
    with caplog.at_level(logging.ERROR):
        policy, worker = make(policy_class, cfg)
    assert (policy.dynspec.table, policy.dynspec.version) == (((None, 2),), 0)
    assert policy.dynspec.updates_rejected == 1
    assert any("p.json" in r.getMessage() and "default table" in r.getMessage()
               for r in caplog.records)
    for b in range(1, 64):
        worker.activate_step_by_batch(b)
    assert worker.applied == []


def test_a_bad_adaptive_config_is_still_sglangs_error(policy_class, tmp_path):
    bad = write_config(tmp_path, {"1": {"candidate_steps": []}})
    with pytest.raises(ValueError, match="candidate_steps must be a list of non-negative ints"):
        policy_class(initial_steps=1, cfg_path=bad)


def test_multi_slot_config_keeps_sglangs_graph_pruning_and_warns(policy_class, caplog):
    with caplog.at_level(logging.WARNING):
        policy = policy_class(initial_steps=3, cfg_path=None)  # SGLang's default 4-slot config
    assert policy.dynspec.arms == (0, 1, 3, 5, 7)
    assert any("batch-size slots" in r.getMessage() for r in caplog.records)
    policy.set_cuda_graph_bs(GRAPH_BS)
    assert policy.cuda_graph_bs_for_step(7) == [1, 2, 4]  # only slot "1" lists step 7

"""The simulator's tree arm (tuner/sim/tree.py): node placement, acceptance, cost, and the
engine running a tree server (arms 0 and the tree) through the plugin core."""

from __future__ import annotations

import numpy as np
import pytest

from tuner.plugin.core import PluginCore
from tuner.protocol import TreeShape, encode_update
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop
from tuner.sim.oracle import expected_emitted
from tuner.sim.profiles import load_profile
from tuner.sim.tree import TreeArm, tree_expected_goodput
from tuner.sim.workloads import LengthDist, Phase, RequestClass, Workload

SEED_TREE = TreeShape(topk=4, steps=2, draft_tokens=16)  # the seed server's shape


def _workload(alpha: float, delta: float, kappa: float = 1e9) -> Workload:
    cls = RequestClass(
        name="t",
        acceptance={"eagle3-dense": (alpha, delta), "kimi-eagle3": (alpha, delta)},
        prompt=LengthDist(100, 0.0),
        output=LengthDist(200, 0.0, 1, 100_000),
    )
    return Workload(name="t", phases=(Phase(1.0, ((1.0, cls),)),), kappa=kappa)


def test_nodes_go_depth_by_depth_keeping_one_for_each_deeper_depth():
    assert TreeArm(SEED_TREE).widths() == (4, 4)
    assert TreeArm(TreeShape(4, 2, 8)).widths() == (4, 3)
    assert TreeArm(TreeShape(4, 3, 5)).widths() == (2, 1, 1)
    assert TreeArm(TreeShape(4, 3, 4)).widths() == (1, 1, 1)  # N = S + 1: the top-1 chain
    assert TreeArm(TreeShape(4, 3, 3)).widths() == (1, 1, 0)  # too few nodes to reach S


def test_acceptance_reduces_to_the_chain_and_grows_with_width():
    a, d = 0.7, 0.97
    chain = expected_emitted(a, d, 3)
    assert TreeArm(TreeShape(4, 3, 4)).expected_emitted(a, d) == pytest.approx(chain)
    assert TreeArm(TreeShape(4, 3, 16), gain=0.0).expected_emitted(a, d) == pytest.approx(chain)
    wider = [TreeArm(TreeShape(4, 3, n)).expected_emitted(a, d) for n in (4, 6, 10, 13)]
    assert wider == sorted(wider) and wider[-1] > chain + 0.2
    # The calibration anchor (EAGLE-3 Table 1: tau 6.13 on MT-bench, ~60 nodes, depth 8).
    assert TreeArm(TreeShape(10, 8, 60)).expected_emitted(0.775, 0.973) == pytest.approx(6.1,
                                                                                         abs=0.1)
    # Beta-distributed alpha: quadrature over requests, the homogeneous value as kappa grows.
    tree = TreeArm(SEED_TREE)
    assert tree.expected_emitted(0.7, 1.0, kappa=1000) == pytest.approx(
        tree.expected_emitted(0.7, 1.0), rel=2e-3)
    assert tree.expected_emitted(0.7, 1.0, kappa=5) != pytest.approx(
        tree.expected_emitted(0.7, 1.0), rel=2e-3)


def test_lift_survival_matches_the_closed_form():
    tree = TreeArm(TreeShape(4, 3, 10))
    a, d = 0.6, 0.9
    chain_rows = np.cumprod(a * d ** np.arange(3))[None, :]
    lifted = tree.lift_survival(chain_rows)[0]
    assert 1 + lifted.sum() == pytest.approx(tree.expected_emitted(a, d))
    assert np.all(np.diff(lifted) <= 0) and np.all(lifted >= chain_rows[0])


def test_tree_step_costs_its_verify_width_drafts_and_extend():
    table = load_profile("h200-llama8b")
    tree = TreeArm(TreeShape(4, 2, 8))
    assert tree.step_s(table, 16) * 1000 == pytest.approx(
        2 * table.draft_ms(16, 4) + table.target_ms(16, 8) + table.draft_ms(16, 8))
    param = load_profile("h100-llama8b")
    b = 32
    ms = (param._fwd_ms(b * 8, b, verify=True) + param.v_o + 2 * (param.d_o + param.d_n * b * 4)
          + param.e_o + param.e_n * b * 8)  # fmt: skip
    assert tree.step_s(param, b) * 1000 == pytest.approx(ms)
    # Verifying 8 tokens per request costs more than the 3 of a depth-2 chain.
    assert tree.step_s(param, b) > param.step_s(b, 2)
    with pytest.raises(ValueError, match="top-k gain"):
        TreeArm(SEED_TREE, gain=1.5)


def test_a_tree_pays_at_small_batches_and_not_at_large_ones():
    prof = load_profile("h100-llama8b")
    tree = TreeArm(TreeShape(4, 2, 8))
    small = tree_expected_goodput(prof, tree, 1, 0.775, 0.973, kappa=20)
    large = tree_expected_goodput(prof, tree, 64, 0.775, 0.973, kappa=20)
    assert small[2] > 1.5 * small[0] and large[0] > 1.2 * large[2]


def _tree_engine(table, workload, conc=8, **kw):
    core = PluginCore([0, 2], started_at=0.0, tree=SEED_TREE)
    core.install(table, 1)
    return Engine(core=core, profile="h100-llama8b", workload=workload,
                  load=ClosedLoop([(1e9, conc)]), **kw)  # fmt: skip


def test_engine_accepts_and_costs_the_tree_arm():
    wl = _workload(0.7, 1.0)
    eng = _tree_engine(((None, 2),), wl, conc=8, seed=3)
    eng.run_until(60.0)
    c = eng.counters
    assert c.request_steps > 20_000
    assert c.decode_tokens / c.request_steps == pytest.approx(
        TreeArm(SEED_TREE).expected_emitted(0.7, 1.0), rel=0.01)
    rows = eng.core.state().counters
    assert {r.k for r in rows} == {2}
    for r in rows:  # drafted counts depth (2 per request), so accepted / drafted <= 1
        assert r.drafted_tokens == 2 * r.b * r.decode_steps
        assert r.accepted_drafts <= r.drafted_tokens
        padded = eng.padded(r.b)
        assert r.busy_s / r.decode_steps == pytest.approx(
            TreeArm(SEED_TREE).step_s(eng.profile, padded), rel=1e-6)


def test_engine_switches_the_tree_off_by_batch_size_from_the_table():
    eng = _tree_engine(((4, 2), (None, 0)), _workload(0.7, 1.0, kappa=20), conc=0, seed=5)
    eng.attach_load(ClosedLoop([(5.0, 2), (5.0, 16)]))
    eng.run_until(10.0)
    rows = eng.core.state().counters
    assert {r.k for r in rows if r.b <= 4} == {2} and {r.k for r in rows if r.b > 4} == {0}
    assert all(r.accepted_drafts == 0 for r in rows if r.k == 0)
    ok, why = eng.core.apply_update(encode_update(((None, 1),), 2))
    assert not ok and "not a built arm" in why


@pytest.mark.parametrize("workload", ["mixed", "shift"])
def test_workload_emitted_of_a_one_wide_tree_is_the_chains(workload):
    from tuner.sim.oracle import workload_emitted
    from tuner.sim.tree import tree_workload_emitted

    chain_like = TreeArm(TreeShape(4, 2, 3))  # N = S + 1: the top-1 chain
    assert tree_workload_emitted(workload, "eagle3-dense", chain_like) == pytest.approx(
        workload_emitted(workload, "eagle3-dense", 2), rel=1e-6)
    assert tree_workload_emitted(workload, "eagle3-dense", TreeArm(SEED_TREE)) > (
        workload_emitted(workload, "eagle3-dense", 2) + 0.1)


def test_engine_agrees_with_the_tree_oracle_under_a_heterogeneous_workload():
    from tuner.sim.tree import tree_workload_emitted

    eng = _tree_engine(((None, 2),), "mixed", conc=48, seed=11)
    eng.run_until(60.0)
    c = eng.counters
    assert c.decode_tokens / c.request_steps == pytest.approx(
        tree_workload_emitted("mixed", eng.profile.acceptance, TreeArm(SEED_TREE)), rel=0.015)


def test_tree_oracle_table_turns_the_tree_off_where_it_stops_paying():
    from tuner.sim.tree import tree_oracle_table

    table = tree_oracle_table(load_profile("h100-llama8b"), "chat", TreeArm(TreeShape(4, 2, 8)),
                              range(1, 65))  # fmt: skip
    assert table[0][1] == 2 and table[-1] == (None, 0) and len(table) == 2
    wider = tree_oracle_table(load_profile("h100-llama8b"), "chat", TreeArm(SEED_TREE),
                              range(1, 65))  # fmt: skip
    assert wider[0][0] < table[0][0]  # a 16-token verify stops paying at smaller batches

"""The bench scores a tree server: arms 0 and the tree, the tree's own acceptance and cost in the
engine and in the oracle alike (``bench --tree KxSxN``)."""

from __future__ import annotations

import pytest

from tuner.bench import BenchConfig, run_bench, run_one
from tuner.cli import main
from tuner.errors import ConfigError
from tuner.protocol import TreeShape
from tuner.sim.oracle import expected_goodput
from tuner.sim.profiles import load_profile
from tuner.sim.tree import TreeArm, parse_tree, tree_goodput, tree_oracle_table

# The seed server's shape; on h100-llama8b it pays up to 8 requests and not above.
TREE = TreeShape(topk=4, steps=2, draft_tokens=16)
PROFILE = "h100-llama8b"
LOAD = "40:1,40:64"


def run(policy: str, tree: TreeShape | None = TREE):
    return run_one(profile=PROFILE, workload="chat", load=LOAD, policy=policy, seed=1,
                   arms=(0, TREE.steps), warmup_s=10.0, tree=tree)  # fmt: skip


def test_the_oracle_the_bench_scores_against_is_the_trees():
    prof = load_profile(PROFILE)
    assert tree_oracle_table(prof, "chat", TreeArm(TREE), [1, 64]) == ((1, 2), (None, 0))
    # The tree's goodput is not the chain's of the same depth: at 16 requests its verify of
    # 16 tokens per request costs it more than it accepts, where the chain still pays.
    off = expected_goodput(prof, "chat", 16, 0)
    assert tree_goodput(prof, "chat", TreeArm(TREE), 16) < off
    assert expected_goodput(prof, "chat", 16, TREE.steps) > off


def test_a_threshold_on_the_tree_scores_as_the_oracle_and_never_loses_the_small_batches():
    # threshold switches the tree (k defaults to its steps) up to 5 requests, as the seed did:
    # here that is the oracle's table, so it scores 100 % in both phases.
    thr = run("threshold")
    assert [round(p.pct_oracle, 1) for p in thr.phases] == [100.0, 100.0]
    never = run("never")
    assert never.phases[0].pct_oracle < 70 and never.phases[1].pct_oracle == pytest.approx(100)
    # Scored as a chain of depth 2 instead, the chain would still pay at 64 requests and
    # "never" would lose there: the bench's tree figures come from the tree model.
    assert run("never", tree=None).phases[1].pct_oracle < 90


def test_a_bandit_learns_to_switch_the_tree_off_at_64_requests():
    r = run("thompson")
    assert r.final_table[-1][1] == 0 and r.phases[1].pct_oracle > 95


def test_the_default_policy_learns_to_switch_the_tree_off_at_64_requests():
    # The model prices the tree's arm at its 16 verified tokens (set_verify_tokens); priced
    # as a 2-deep chain it held the tree at 64 requests (49.5 % of oracle).
    r = run("model")
    assert r.final_table[-1][1] == 0 and r.phases[1].pct_oracle > 95


def test_sglangs_own_policies_are_skipped_on_a_tree_server_saying_why():
    cfg = BenchConfig(profiles=(PROFILE,), workloads=("chat",), load="10:1",
                      policies=("never", "sglang-default", "sglang-real"), arms=(0, 2),
                      tree=TREE, jobs=1, warmup_s=0.0)  # fmt: skip
    result = run_bench(cfg)
    assert [r.policy for r in result.runs] == ["never"]
    assert any(s.startswith("sglang-default: ") for s in result.skipped)
    assert any("top-k > 1" in s for s in result.skipped)


def test_a_tree_needs_arms_zero_and_its_steps():
    with pytest.raises(ConfigError, match="arms are 0 and its steps 2"):
        BenchConfig(profiles=(PROFILE,), arms=(0, 1, 3), tree=TREE)


@pytest.mark.parametrize("text", ["4x16", "4x2x", "ax2x16", "1x2x3"])
def test_parse_tree_refuses_what_is_not_a_tree(text):
    with pytest.raises(ConfigError, match="tree"):
        parse_tree(text)


def test_bench_cli_scores_a_tree(capsys):
    assert parse_tree("4X2x16") == TREE
    rc = main(["bench", "--tree", "4x2x16", "--profiles", PROFILE, "--workloads", "chat",
               "--policies", "threshold", "--load", "20:1", "--warmup", "5", "--jobs", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "h100-llama8b (tree 4x2x16) / chat" in out
    with pytest.raises(SystemExit):  # argparse: a bad shape is a usage error
        main(["bench", "--tree", "4x16"])
    assert "TOPKxSTEPSxTOKENS" in capsys.readouterr().err

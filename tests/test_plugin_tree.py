"""Tree servers (top-k > 1) in the plugin's pure parts: the config rule, the readout's tree
descriptor and the width -> arm mapping of the telemetry."""

from __future__ import annotations

import json

import pytest

from tuner.plugin._tree import tree_refusal
from tuner.plugin.core import PluginCore
from tuner.protocol import DynspecState, ProtocolError, TreeShape

TREE = TreeShape(topk=4, steps=2, draft_tokens=16)


def test_tree_rule_accepts_only_off_against_the_configured_tree():
    assert tree_refusal(4, 2, 16, [0, 2]) is None
    assert tree_refusal(4, None, 16, [2, 0]) is None  # SGLang picks the middle candidate: 2
    assert tree_refusal(1, 3, 4, [0, 1, 3, 5]) is None  # chains are not ours to judge
    assert "[0, 1, 2]" in tree_refusal(4, 2, 16, [0, 1, 2])
    assert "candidate_steps must be [0, S]" in tree_refusal(4, 3, 16, [0, 2])
    assert "candidate_steps must be [0, S]" in tree_refusal(4, 0, 16, [0])
    assert "--speculative-num-draft-tokens" in tree_refusal(4, 2, None, [0, 2])


def test_readout_carries_the_tree_and_round_trips():
    core = PluginCore([0, 2], started_at=1.0, tree=TREE)
    core.record_decode(4, core.arm_of_width(16), 9, 5, 10.0, 1)
    core.record_decode(4, core.arm_of_width(1), 4, 0, 10.1, 2)
    core.record_forward(10.2, 3)
    out = json.loads(json.dumps(core.readout()))
    assert out["tree"] == {"topk": 4, "steps": 2, "draft_tokens": 16}
    state = DynspecState.from_json(out)
    assert state.tree == TREE
    # drafted counts depth (2 per request), so accepted / drafted stays a rate in [0, 1].
    assert [(c.k, c.accepted_drafts, c.drafted_tokens) for c in state.counters] == [
        (0, 0, 0), (2, 5, 8)]
    assert "tree" not in PluginCore([0, 1, 3], started_at=1.0).readout()  # chains: as before


def test_width_maps_to_arm_for_chains_and_trees():
    chain = PluginCore([0, 1, 3], started_at=1.0)
    assert [chain.arm_of_width(w) for w in (1, 2, 4)] == [0, 1, 3]
    tree = PluginCore([0, 2], started_at=1.0, tree=TreeShape(4, 2, 3))  # width = steps + 1
    assert [tree.arm_of_width(w) for w in (1, 3)] == [0, 2]


def test_a_tree_core_refuses_other_arms():
    with pytest.raises(ValueError, match="arms are 0 and its depth 2"):
        PluginCore([0, 1, 2], started_at=1.0, tree=TREE)


@pytest.mark.parametrize(
    "tree, match",
    [
        ({"topk": 1, "steps": 2, "draft_tokens": 3}, "topk must be >= 2"),
        ({"topk": 4, "steps": 0, "draft_tokens": 3}, "steps must be >= 1"),
        ({"topk": 4, "steps": 2, "draft_tokens": 1}, "draft_tokens must be >= 2"),
        ({"topk": 4, "steps": 2}, "lacks field 'draft_tokens'"),
        ({"topk": True, "steps": 2, "draft_tokens": 8}, "must be an integer"),
        ([4, 2, 8], "tree must be an object"),
        ({"topk": 4, "steps": 3, "draft_tokens": 8}, "tree steps 3 is not among arms"),
    ],
)
def test_a_malformed_tree_descriptor_is_refused(tree, match):
    out = PluginCore([0, 2], started_at=1.0, tree=TREE).readout()
    out["tree"] = tree
    with pytest.raises(ProtocolError, match=match):
        DynspecState.from_json(out)


def test_sglang_flags_for_a_tree_server():
    from tuner.plugin.launch import sglang_flags

    flags = sglang_flags(config_path="a.json", arms=[0, 2], topk=4, draft_tokens=16)
    assert flags[:8] == ["--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "4",
                         "--speculative-adaptive", "--speculative-adaptive-config", "a.json",
                         "--speculative-num-steps"]
    assert flags[8:12] == ["2", "--speculative-num-draft-tokens", "16", "--max-running-requests"]
    assert "--speculative-num-draft-tokens" not in sglang_flags(config_path="a.json", arms=[0, 1])


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(arms=[0, 1, 2], topk=4, draft_tokens=16), "two arms, 0 and its depth"),
        (dict(arms=[2], topk=4, draft_tokens=16), "two arms, 0 and its depth"),
        (dict(arms=[0, 2], topk=4), "draft-token count"),
        (dict(arms=[0, 2], topk=4, draft_tokens=22), "verifies 2..21 draft tokens"),
        (dict(arms=[0, 2], topk=4, draft_tokens=8, initial_steps=0), "starts on its depth 2"),
        (dict(arms=[0, 1, 3], draft_tokens=4), "draft tokens are a tree's"),
        (dict(arms=[0, 1], topk=0), "top-k must be >= 1"),
    ],
)
def test_sglang_flags_refuse_an_unswitchable_tree(kw, match):
    from tuner.plugin.launch import sglang_flags

    with pytest.raises(ValueError, match=match):
        sglang_flags(config_path="a.json", **kw)


def test_sglang_args_cli_for_a_tree(tmp_path, capsys):
    from tuner.cli import main

    out = tmp_path / "tree.json"
    assert main(["sglang-args", "--arms", "0,2", "--topk", "4", "--draft-tokens", "16",
                 "--out", str(out)]) == 0  # fmt: skip
    assert json.loads(out.read_text()) == {"1": {"candidate_steps": [0, 2]}}
    printed = capsys.readouterr().out
    assert "--speculative-eagle-topk 4" in printed
    assert "--speculative-num-draft-tokens 16" in printed
    assert main(["sglang-args", "--arms", "0,1,2", "--topk", "4", "--draft-tokens", "16",
                 "--out", str(tmp_path / "bad.json")]) == 2  # fmt: skip
    assert "two arms" in capsys.readouterr().err

"""The kernel stand-in's extend attention honours SGLang's CPU tree mask (QLEN_ONLY layout:
``extend_len x extend_len`` per request), checked per node against attention over the prefix
plus the node's ancestors and itself; and the all-True, oversized mask of SGLang's one-node
verify (``steps = 0``) is plain causal attention."""

from __future__ import annotations

import importlib
import sys

import pytest
from _reference import softmax_attention
from _server import STAND_IN, need_server_env

need_server_env()
import torch  # noqa: E402

sys.path.insert(0, str(STAND_IN))
sgl_kernel = importlib.import_module("sgl_kernel")
sys.path.remove(str(STAND_IN))

H, HKV, D, SLOTS = 4, 2, 8, 96
# Request 0: root 0, children 1 and 2, grandchild 3 under 1. Request 1: root with four
# children (top-k 4, one step), then 5 under 2. Siblings never see each other.
PARENTS = [
    {0: [], 1: [0], 2: [0], 3: [0, 1]},
    {0: [], 1: [0], 2: [0], 3: [0], 4: [0], 5: [0, 2]},
]


def _case(prefix=(6, 3), seed=3):
    g = torch.Generator().manual_seed(seed)
    ext = [len(p) for p in PARENTS]
    n = sum(ext)
    return dict(
        k_buf=torch.randn(SLOTS, HKV, D, generator=g),
        v_buf=torch.randn(SLOTS, HKV, D, generator=g),
        req_to_token=(torch.arange(2 * 48, dtype=torch.int32).reshape(2, 48) * 7) % SLOTS,
        prefix=list(prefix), ext=ext,
        q=torch.randn(n, H, D, generator=g),
        k_ext=torch.randn(n, HKV, D, generator=g), v_ext=torch.randn(n, HKV, D, generator=g),
    )  # fmt: skip


def _run(c, custom_mask):
    out = torch.empty_like(c["q"])
    seq_lens = torch.tensor([p + e for p, e in zip(c["prefix"], c["ext"])])
    sgl_kernel.extend_attention_cpu(
        c["q"], c["k_ext"], c["v_ext"], out, c["k_buf"], c["v_buf"], 1.0, 1.0,
        c["req_to_token"], torch.tensor([0, 1]), seq_lens, torch.tensor(c["ext"]),
        torch.tensor([0, c["ext"][0]]), max(c["ext"]), 0.5, 0.0, False, 0, None, None,
        custom_mask, True,
    )  # fmt: skip
    return out


def _per_node(c, sees):
    outs, start = [], 0
    for r, (p, e) in enumerate(zip(c["prefix"], c["ext"])):
        slots = c["req_to_token"][r, :p].long()
        for i in range(e):
            own = [start + j for j in range(e) if sees(r, i, j)]
            keys = torch.cat([c["k_buf"][slots], c["k_ext"][own]])
            values = torch.cat([c["v_buf"][slots], c["v_ext"][own]])
            outs.append(softmax_attention(c["q"][start + i], keys, values, 0.5))
        start += e
    return torch.stack(outs)


def _qlen_mask(parents) -> torch.Tensor:
    masks = []
    for tree in parents:
        e = len(tree)
        rows = torch.zeros(e, e, dtype=torch.bool)
        for i, anc in tree.items():
            rows[i, [*anc, i]] = True
        masks.append(rows.reshape(-1))
    return torch.cat(masks)


def test_qlen_only_tree_mask_is_prefix_plus_ancestors_per_node():
    c = _case()
    out = _run(c, _qlen_mask(PARENTS))
    ref = _per_node(c, lambda r, i, j: j == i or j in PARENTS[r][i])
    assert torch.allclose(out, ref, atol=1e-5)
    causal = _per_node(c, lambda r, i, j: j <= i)
    assert not torch.allclose(out, causal, atol=1e-3)  # the tree differs from a chain here


def test_the_one_node_verify_mask_may_be_oversized_and_all_true():
    c = _case()
    c["ext"] = [1, 1]
    c["q"], c["k_ext"], c["v_ext"] = c["q"][:2], c["k_ext"][:2], c["v_ext"][:2]
    ref = _per_node(c, lambda r, i, j: True)
    # SGLang: torch.ones(seq_lens_sum + bs) (exactly the full layout), or a larger buffer.
    for size in (sum(c["prefix"]) + 2, 4096):
        assert torch.allclose(_run(c, torch.ones(size, dtype=torch.bool)), ref, atol=1e-5)


def test_a_mask_too_short_for_the_tree_is_refused():
    c = _case()
    with pytest.raises(RuntimeError, match="custom_mask has 10 entries"):
        _run(c, torch.ones(10, dtype=torch.bool))

"""The sgl_kernel stand-in and the sampled-verify port against plain reference computations."""

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
sampled_verify = importlib.import_module("sampled_verify")
sys.path.remove(str(STAND_IN))

H, HKV, D = 4, 2, 8  # grouped-query heads, as the tier's tiny Llama has


def _pool(num_slots=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(num_slots, HKV, D, generator=g)
    v_buf = torch.randn(num_slots, HKV, D, generator=g)
    return g, k_buf, v_buf


def test_decode_attention_matches_per_token_softmax_and_stores_the_new_kv():
    g, k_buf, v_buf = _pool()
    req_to_token = torch.zeros(3, 32, dtype=torch.int32)
    req_to_token[1, :6] = torch.tensor([9, 3, 40, 41, 7, 12], dtype=torch.int32)
    req_to_token[2, :3] = torch.tensor([20, 21, 22], dtype=torch.int32)
    seq_lens = torch.tensor([6, 3])
    q = torch.randn(2, H, D, generator=g)
    new_k, new_v = torch.randn(2, HKV, D, generator=g), torch.randn(2, HKV, D, generator=g)
    out = torch.empty(2, H, D)
    sgl_kernel.decode_attention_cpu(
        q, k_buf, v_buf, 1.0, 1.0, out, new_k, new_v, torch.tensor([12, 22]),
        torch.zeros(2, H, 8, D + 1), req_to_token, torch.tensor([1, 2]), seq_lens,
        0.3, 0.0, False, 0, None, None,
    )  # fmt: skip
    assert torch.equal(k_buf[12], new_k[0]) and torch.equal(v_buf[22], new_v[1])
    for i, rpi in enumerate((1, 2)):
        slots = req_to_token[rpi, : seq_lens[i]].long()
        ref = softmax_attention(q[i], k_buf[slots], v_buf[slots], 0.3)
        assert torch.allclose(out[i], ref, atol=1e-5)


def _extend_case(seed=1):
    g, k_buf, v_buf = _pool(seed=seed)
    req_to_token = torch.arange(2 * 40, dtype=torch.int32).reshape(2, 40) % 64
    prefix, ext = [5, 2], [3, 4]
    seq_lens = torch.tensor([p + e for p, e in zip(prefix, ext)])
    n = sum(ext)
    q = torch.randn(n, H, D, generator=g)
    k_ext, v_ext = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    return k_buf, v_buf, req_to_token, prefix, ext, seq_lens, q, k_ext, v_ext


def _run_extend(case, custom_mask=None):
    k_buf, v_buf, req_to_token, prefix, ext, seq_lens, q, k_ext, v_ext = case
    out = torch.empty_like(q)
    sgl_kernel.extend_attention_cpu(
        q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, req_to_token, torch.tensor([0, 1]),
        seq_lens, torch.tensor(ext), torch.tensor([0, ext[0]]), max(ext), 0.5, 0.0, False, 0,
        None, None, custom_mask, True,
    )  # fmt: skip
    return out


def _reference_extend(case, sees):
    """Per query token: attention over the prefix plus the extend tokens ``sees(i, j)``."""
    k_buf, v_buf, req_to_token, prefix, ext, _seq, q, k_ext, v_ext = case
    outs, start = [], 0
    for r, (p, e) in enumerate(zip(prefix, ext)):
        slots = req_to_token[r, :p].long()
        for i in range(e):
            own = [start + j for j in range(e) if sees(r, i, j)]
            keys = torch.cat([k_buf[slots], k_ext[own]])
            values = torch.cat([v_buf[slots], v_ext[own]])
            outs.append(softmax_attention(q[start + i], keys, values, 0.5))
        start += e
    return torch.stack(outs)


def test_extend_attention_is_causal_over_prefix_and_extend():
    case = _extend_case()
    ref = _reference_extend(case, lambda r, i, j: j <= i)
    assert torch.allclose(_run_extend(case), ref, atol=1e-5)


def test_extend_attention_follows_a_tree_mask_per_node():
    # Request 0: root 0 with children 1 and 2 (siblings do not see each other). Request 1:
    # a chain 0-1 and a second child 2 of the root with child 3.
    parents = [{0: [], 1: [0], 2: [0]}, {0: [], 1: [0], 2: [0], 3: [0, 2]}]
    case = _extend_case(seed=2)
    prefix, ext = case[3], case[4]
    masks = []
    for r, (p, e) in enumerate(zip(prefix, ext)):
        rows = torch.zeros(e, p + e, dtype=torch.bool)
        rows[:, :p] = True
        for i in range(e):
            for j in [*parents[r][i], i]:
                rows[i, p + j] = True
        masks.append(rows.reshape(-1))
    ref = _reference_extend(case, lambda r, i, j: j == i or j in parents[r][i])
    out = _run_extend(case, custom_mask=torch.cat(masks))
    assert torch.allclose(out, ref, atol=1e-5)
    assert not torch.allclose(out, _run_extend(case), atol=1e-3)  # the mask mattered


def test_chain_tree_and_greedy_verify_accept_the_matching_prefix():
    # top-k 1, 3 steps: a chain of 4 verify tokens per request.
    bs, n, steps = 2, 4, 3
    tree_mask = torch.zeros(bs * n * n, dtype=torch.bool)
    positions = torch.zeros(bs * n, dtype=torch.int64)
    ri = torch.zeros(bs, n, dtype=torch.int64)
    rnt = torch.full((bs, n), -1, dtype=torch.int64)
    rns = torch.full((bs, n), -1, dtype=torch.int64)
    parent_list = torch.tensor([[-1, 0, 1], [-1, 0, 1]])
    selected = torch.tensor([[0, 1, 2], [0, 1, 2]])
    sgl_kernel.build_tree_kernel_efficient_cpu(
        parent_list, selected, torch.tensor([7, 10]), tree_mask, positions, ri, rnt, rns,
        1, steps, n, 1,
    )  # fmt: skip
    assert positions.tolist() == [7, 8, 9, 10, 10, 11, 12, 13]
    assert rnt.tolist() == [[1, 2, 3, -1], [1, 2, 3, -1]]
    assert tree_mask.reshape(bs, n, n)[0].tolist() == torch.ones(n, n).tril().bool().tolist()
    candidates = torch.tensor([[5, 11, 12, 13], [5, 21, 22, 23]])
    # Request 0: the target agrees with the first two drafts; request 1 with none.
    target = torch.tensor([[11, 12, 99, 98], [77, 22, 23, 24]])
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accepted = torch.zeros(bs, dtype=torch.int32)
    sgl_kernel.verify_tree_greedy_cpu(
        predicts, accept_index, accepted, candidates, ri, rnt, rns, target
    )
    assert accepted.tolist() == [2, 0]
    assert accept_index.tolist() == [[0, 1, 2, -1], [4, -1, -1, -1]]
    assert predicts[[0, 1, 2]].tolist() == [11, 12, 99] and int(predicts[4]) == 77
    bonus = torch.zeros(bs, dtype=torch.int32)
    accept_tokens = torch.tensor([[11, 12, 99, 0], [77, 0, 0, 0]], dtype=torch.int32)
    sgl_kernel.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([3, 1], dtype=torch.int32),
                                     bonus, n)  # fmt: skip
    assert bonus.tolist() == [99, 77]


def test_cache_location_ops_round_trip():
    req_to_token = torch.zeros(3, 16, dtype=torch.int32)
    sgl_kernel.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 4]), torch.tensor([4, 6]),
        torch.tensor([30, 31, 32, 40, 41]), 16,
    )  # fmt: skip
    assert req_to_token[2, 1:4].tolist() == [30, 31, 32] and req_to_token[0, 4:6].tolist() == [40, 41]
    out = torch.empty(5, dtype=torch.int64)
    sgl_kernel.assign_extend_cache_locs_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 4]), torch.tensor([4, 6]), out, 16
    )
    assert out.tolist() == [30, 31, 32, 40, 41]
    drafts = torch.empty(4, dtype=torch.int64)
    sgl_kernel.assign_draft_cache_locs_contiguous_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([2, 4]), drafts, 16, 1, 2
    )
    assert drafts.tolist() == [31, 32, 40, 41]
    expanded = sgl_kernel.build_draft_decode_metadata_cpu(
        req_to_token, torch.tensor([2]), torch.tensor([2]), 1, 2, 16
    )
    assert expanded[0, :4].tolist() == [0, 30, 31, 32]
    accept_out = torch.zeros(3, dtype=torch.int64)
    sgl_kernel.fill_accept_out_cache_loc_cpu(
        torch.tensor([0, -1, 2, 3]), torch.tensor([50, 51, 52, 53]), accept_out
    )
    assert accept_out.tolist() == [50, 52, 53]


def test_copy_all_layer_kv_cache_stages_overlapping_rows():
    bufs = [torch.arange(12, dtype=torch.float32).reshape(6, 2) + 100 * i for i in range(2)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    before = [b.clone() for b in bufs]
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 2]), torch.tensor([0, 1]))
    for b, old in zip(bufs, before):
        assert torch.equal(b[1], old[0]) and torch.equal(b[2], old[1])  # not old[0] twice
        assert torch.equal(b[3:], old[3:])


def test_a_missing_op_raises_naming_itself():
    from sgl_kernel import rotate_input_ids_cpu

    with pytest.raises(NotImplementedError, match="rotate_input_ids_cpu"):
        rotate_input_ids_cpu(torch.zeros(1))


def _sample(target, candidates, threshold_acc, coins, final_coin):
    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accepted = torch.zeros(bs, dtype=torch.int32)
    ri = torch.arange(bs * n).reshape(bs, n)
    rnt = torch.tensor([[1, 2, 3, -1]] * bs)
    rns = torch.full((bs, n), -1)
    sampled_verify.tree_speculative_sampling_target_only(
        predicts, accept_index, accepted, candidates, ri, rnt, rns, coins,
        torch.full((bs,), final_coin), target, torch.zeros_like(target), 1.0, threshold_acc,
    )  # fmt: skip
    return predicts, accept_index, accepted


def test_sampled_verify_accepts_when_the_coin_is_below_p_over_threshold():
    vocab = 10
    target = torch.full((1, 4, vocab), 1.0 / vocab)
    candidates = torch.tensor([[0, 3, 4, 5]])
    # p = 0.1 and threshold 0.2: accept iff coin < 0.5. Coins of nodes 0 and 1 pass, node 2's
    # does not, so two drafts are accepted and the third rejected.
    coins = torch.tensor([[0.4, 0.3, 0.7, 0.1]])
    predicts, accept_index, accepted = _sample(target, candidates, 0.2, coins, 0.35)
    assert accepted.tolist() == [2]
    assert accept_index[0, :3].tolist() == [0, 1, 2]
    assert predicts[:2].tolist() == [3, 4]
    # The bonus comes from relu(target - draft) at node 2, where token 5's mass was moved into
    # the draft: 9 tokens of 0.1 left, coin 0.35 of 0.9 lands in the 4th (index 3).
    assert int(predicts[2]) == 3


def test_sampled_verify_acceptance_rate_is_one_over_v_t():
    vocab, n, bs = 50, 4, 4000
    torch.manual_seed(0)
    target = torch.full((bs, n, vocab), 1.0 / vocab)
    candidates = torch.randint(0, vocab, (bs, n))
    threshold = 1.0 / (vocab * 0.3)  # per-position acceptance 0.3
    _p, _a, accepted = _sample(target, candidates, threshold, torch.rand(bs, n), 0.5)
    first = (accepted >= 1).float().mean().item()
    assert abs(first - 0.3) < 0.03


def test_verify_uses_greedy_only_when_all_requests_are_greedy():
    assert sampled_verify.verify_uses_greedy(is_all_greedy=True, is_cpu=True) is True
    assert sampled_verify.verify_uses_greedy(is_all_greedy=False, is_cpu=True) is False


def test_top_k_and_top_p_renormalisation_keep_the_likeliest_tokens():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    top_k = sampled_verify.top_k_renorm_prob(probs, torch.tensor([2, 1]))
    assert torch.allclose(top_k[0], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    assert torch.allclose(top_k[1], torch.full((4,), 0.25))  # every tie at the pivot kept
    top_p = sampled_verify.top_p_renorm_prob(probs[:1], 0.65)
    # Ascending 0.1, 0.2 | 0.3, 0.4: the first two hold 0.3 < 1 - 0.65, so they go.
    assert torch.allclose(top_p[0], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))

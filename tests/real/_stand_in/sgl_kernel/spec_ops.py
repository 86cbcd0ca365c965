"""Pure-torch ports of sgl-kernel's CPU index kernels for speculative decoding.

Each op keeps the upstream C++ signature (SGLang 0.5.23 calls them positionally or by these
keyword names) and writes its outputs in place exactly where the C++ kernel does. Loops run
over the batch in Python: the tier's batches are a handful of requests.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """``req_to_token[rpi[i], start[i]:end[i]] = out_cache_loc[prefix[i]:prefix[i+1]]``.

    Upstream: ``sgl-kernel/csrc/cpu/spec.cpp`` (``assign_req_to_token_pool_cpu``).
    """
    assert req_to_token.dtype == torch.int32 and out_cache_loc.dtype == torch.int64
    assert req_to_token.shape[1] == pool_len
    offset = 0
    for rpi, start, end in zip(
        _ints(req_pool_indices), _ints(start_offset), _ints(end_offset), strict=True
    ):
        n = end - start
        req_to_token[rpi, start:end] = out_cache_loc[offset : offset + n].to(torch.int32)
        offset += n


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """Gather each request's slots ``[start, end)`` out of ``req_to_token`` into a dense int64
    vector (verify/extend cache locations).

    Upstream: ``sgl-kernel/csrc/cpu/spec.cpp`` (``assign_extend_cache_locs_cpu``).
    """
    assert out_cache_loc.dtype == torch.int64
    assert req_to_token.shape[1] == pool_len
    offset = 0
    for rpi, start, end in zip(
        _ints(req_pool_indices), _ints(start_offset), _ints(end_offset), strict=True
    ):
        n = end - start
        out_cache_loc[offset : offset + n] = req_to_token[rpi, start:end].to(torch.int64)
        offset += n


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
) -> None:
    """Read back the ``topk * num_steps`` draft slots reserved after each request's prefix.

    Upstream: ``sgl-kernel/csrc/cpu/spec.cpp`` (``assign_draft_cache_locs_contiguous_cpu``).
    """
    assert out_cache_loc.dtype == torch.int64
    assert out_cache_loc.numel() == req_pool_indices.numel() * topk * num_steps
    assert req_to_token.shape[1] == pool_len
    width = topk * num_steps
    for i, (rpi, start) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens), strict=True)):
        out_cache_loc[i * width : (i + 1) * width] = req_to_token[rpi, start : start + width]


def build_draft_decode_metadata_cpu(
    req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
) -> torch.Tensor:
    """``req_to_token`` expanded for multi-step draft decode: row ``b*topk+tk`` is request b's
    prefix followed by candidate tk's ``num_steps`` draft slots (laid out at
    ``seq_len + tk*num_steps``). Entries past ``seq_len + num_steps`` are undefined (zero here).

    Upstream: ``sgl-kernel/csrc/cpu/spec.cpp`` (``build_draft_decode_metadata_cpu``).
    """
    assert req_to_token.dtype == torch.int32
    rows = req_pool_indices.numel() * topk
    out = torch.zeros((rows, pool_len), dtype=req_to_token.dtype)
    for b, (rpi, sl) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens), strict=True)):
        src = req_to_token[rpi]
        for tk in range(topk):
            dst = out[b * topk + tk]
            dst[:sl] = src[:sl]
            start = sl + tk * num_steps
            dst[sl : sl + num_steps] = src[start : start + num_steps]
    return out


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
) -> None:
    """The draft tree for target verify: tree mask, positions and the retrieval linkage
    (index / first child / next sibling) ``verify_tree_greedy_cpu`` walks. ``retrive_next_*``
    arrive filled with -1. Mode 0 = FULL_MASK (rows span prefix + drafts), 1 = QLEN_ONLY.

    Upstream: ``sgl-kernel/csrc/cpu/spec.cpp`` (``build_tree_kernel_efficient_cpu``).
    """
    if tree_mask_mode == 2:
        raise RuntimeError(
            "build_tree_kernel_efficient_cpu: QLEN_ONLY_BITPACKING is not supported on CPU"
        )
    n = draft_token_num
    parents = parent_list.reshape(parent_list.shape[0], -1).tolist()
    selected = selected_index.reshape(selected_index.shape[0], -1).tolist()
    seq_lens = _ints(verified_seq_len)
    ri, rnt, rns = (t.view(-1) for t in (retrive_index, retrive_next_token, retrive_next_sibling))
    mask_base = 0
    for bid, seq_len in enumerate(seq_lens):
        sel, par = selected[bid], parents[bid]
        off = bid * n
        positions[off] = seq_len
        ri[off] = off
        for i in range(n - 1, 0, -1):
            ri[off + i] = off + i
            parent_tb_idx = sel[i - 1] // topk
            parent_position = 0
            if parent_tb_idx > 0:
                parent_token_idx = par[parent_tb_idx]
                while parent_position < n:
                    if sel[parent_position] == parent_token_idx:
                        parent_position += 1
                        break
                    parent_position += 1
            if parent_position == n:
                continue  # an invalid parent, skipped as upstream does
            origin = int(rnt[off + parent_position])
            rnt[off + parent_position] = i
            if origin != -1:
                rns[off + i] = origin
        # Mask rows: QLEN_ONLY rows are n wide; FULL_MASK rows also cover the prefix.
        row_width = n if tree_mask_mode == 1 else seq_len + n
        col0 = 0 if tree_mask_mode == 1 else seq_len
        base = off * n if tree_mask_mode == 1 else mask_base
        for tid in range(n):
            row = base + row_width * tid + col0
            tree_mask[row] = True  # every node sees the root (column 0)
            tree_mask[row + 1 : row + n] = False
            if tid == 0:
                continue
            position, cur = 0, tid - 1
            while True:
                position += 1
                tree_mask[row + cur + 1] = True
                ptb = sel[cur] // topk
                if ptb == 0:
                    break
                tok_idx = par[ptb]
                cur = next((c for c in range(len(sel)) if sel[c] == tok_idx), None)
                if cur is None:
                    raise RuntimeError(f"build_tree_kernel_efficient_cpu: node {tok_idx} is no draft")
            positions[off + tid] = position + seq_len
        mask_base += (seq_len + n) * n


def walk_tree(bx, steps, accept_index, retrive_index, next_token, next_sibling, accept_node):
    """Request ``bx``'s verify walk, as upstream's greedy and sampled kernels both do it: from
    the root, level by level, try the children in sibling order and follow the first that
    ``accept_node(cur, last)`` takes (``last``: the pool index of the last accepted node); stop
    at a level where none is taken. Fills ``accept_index[bx]``; returns ``(accepted, last)``.
    """
    ri, rnt, rns = retrive_index[bx], next_token[bx], next_sibling[bx]
    last = ri[0]
    accept_index[bx, 0] = last
    accepted, cur = 0, 0
    for _ in range(1, steps):
        cur = rnt[cur]
        while cur != -1:
            if accept_node(cur, last):
                accepted += 1
                accept_index[bx, accepted] = ri[cur]
                last = ri[cur]
                break
            cur = rns[cur]
        if cur == -1:
            break
    return accepted, last


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """Greedy verify: per request, walk the tree accepting the child whose draft token equals
    the target's argmax at the last accepted node; the target's token there is the bonus.

    Upstream: ``sgl-kernel/csrc/cpu/spec.cpp`` (``verify_tree_greedy_cpu``).
    """
    assert predicts.dtype == accept_index.dtype == accept_token_num.dtype == torch.int32
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, ri, rnt, rns = (t.tolist() for t in (candidates, retrive_index, retrive_next_token,
                                               retrive_next_sibling))  # fmt: skip
    target = target_predict.reshape(-1).tolist()
    for bx in range(bs):

        def matches(cur: int, last: int, row=cand[bx]) -> bool:
            if row[cur] != target[last]:
                return False
            predicts[last] = target[last]
            return True

        accepted, last = walk_tree(bx, steps, accept_index, ri, rnt, rns, matches)
        accept_token_num[bx] = accepted
        predicts[last] = target[last]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """Each request's last accepted token (the bonus) into ``bonus_tokens``.

    Upstream: ``sgl-kernel/csrc/cpu/spec.cpp`` (``fill_bonus_tokens_cpu``).
    """
    flat = accept_tokens.reshape(-1)
    for pid, n in enumerate(_ints(accept_lens)):
        bonus_tokens[pid] = flat[accept_stride * pid + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc, size=None):
    """Compact the accepted tokens' KV slots: ``out_cache_loc`` at every index that is not -1.

    Upstream: ``sgl-kernel/csrc/cpu/spec.cpp`` (``fill_accept_out_cache_loc_cpu``; SGLang
    0.5.23 calls it without ``size``, which is then the whole of ``accept_index``).
    """
    idx = accept_index.reshape(-1)[: size if size is not None else None]
    kept = idx[idx > -1].to(torch.int64)
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept]


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every K/V buffer b (a raw base address and a row size in bytes):
    ``buf_b[tgt_loc[i]] = buf_b[src_loc[i]]``, all sources staged before any write so
    overlapping locations copy as upstream does.

    Upstream: ``sgl-kernel/csrc/cpu/kvcache.cpp`` (``copy_all_layer_kv_cache_cpu``).
    """
    assert data_ptrs.dtype == torch.uint64 and strides.dtype == torch.int64
    tgt, src = _ints(tgt_loc), _ints(src_loc)
    assert len(tgt) == len(src)
    for base, stride in zip(_ints(data_ptrs), _ints(strides), strict=True):
        staging = ctypes.create_string_buffer(len(src) * stride)
        for i, s in enumerate(src):
            ctypes.memmove(ctypes.addressof(staging) + i * stride, base + s * stride, stride)
        for i, t in enumerate(tgt):
            ctypes.memmove(base + t * stride, ctypes.addressof(staging) + i * stride, stride)

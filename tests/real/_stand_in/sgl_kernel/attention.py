"""Pure-torch ports of sgl-kernel's CPU paged attention (``torch.ops.sgl_kernel.*_cpu``).

Both ops read keys and values through ``req_to_token[req_pool_indices[i], :len]`` into the
K/V buffers, compute plain softmax attention per request in float32 and write ``output`` in
place. What the tiny Llama on the tier never uses (sliding windows, attention sinks, cross
attention, fp8 KV buffers) is refused by name rather than approximated.

Extend attention decides which keys each query sees in one place, :func:`extend_visibility`:
causal by default, or SGLang's tree mask for speculative verify with top-k > 1.
"""

from __future__ import annotations

import torch

__all__ = ["decode_attention_cpu", "extend_attention_cpu", "extend_visibility"]


def _refuse_unported(op: str, *, sliding_window, sinks, is_cross_attn, encoder_lens) -> None:
    if sliding_window is not None and int(sliding_window) > 0:
        raise NotImplementedError(f"sgl_kernel stand-in: {op} has no sliding window port")
    if sinks is not None:
        raise NotImplementedError(f"sgl_kernel stand-in: {op} has no attention-sink port")
    if is_cross_attn or encoder_lens is not None:
        raise NotImplementedError(f"sgl_kernel stand-in: {op} has no cross-attention port")


def _dequant(rows: torch.Tensor, scale, op: str) -> torch.Tensor:
    if rows.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise NotImplementedError(f"sgl_kernel stand-in: {op} has no fp8 KV-cache port")
    if isinstance(scale, torch.Tensor):
        raise NotImplementedError(f"sgl_kernel stand-in: {op} has no per-token KV scale port")
    return rows.float() * (1.0 if scale is None else float(scale))


def _attend(q, keys, values, visible, sm_scale: float, logit_cap: float) -> torch.Tensor:
    """Softmax attention. q [M, H, D], keys [N, Hkv, D], values [N, Hkv, Dv], visible [M, N]
    bool. Returns [M, H, Dv] float32. Grouped-query heads share their KV head."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), keys) * sm_scale
    if logit_cap > 0:  # upstream: cap * tanh(x / cap) after scaling
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(scores, dim=-1), values)


def decode_attention_cpu(
    query,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    output,
    key,
    value,
    loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    logit_cap,
    is_cross_attn=False,
    sliding_window=None,
    encoder_lens=None,
    sinks=None,
) -> None:
    """One query token per request against its whole KV history. When ``key``/``value`` are
    given they are first stored at ``loc`` (the kernel writes the new token's KV itself).
    ``attn_logits`` (the kernel's split-K scratch) is not needed here and left as it is.

    Upstream: ``sgl-kernel/csrc/cpu/decode.cpp`` (``decode_attention_cpu``).
    """
    op = "decode_attention_cpu"
    _refuse_unported(op, sliding_window=sliding_window, sinks=sinks,
                     is_cross_attn=is_cross_attn, encoder_lens=encoder_lens)  # fmt: skip
    if key is not None:
        k_buffer[loc] = key.to(k_buffer.dtype)
        v_buffer[loc] = value.to(v_buffer.dtype)
    for i, (rpi, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[rpi, :seq_len].long()
        keys = _dequant(k_buffer[slots], k_scale, op)
        values = _dequant(v_buffer[slots], v_scale, op)
        visible = torch.ones((1, seq_len), dtype=torch.bool)
        out = _attend(query[i : i + 1], keys, values, visible, sm_scale, logit_cap)
        output[i] = out[0].to(output.dtype)


def extend_visibility(
    prefix_len: int, extend_len: int, *, is_causal: bool = True, mask_rows=None
) -> torch.Tensor:
    """Which keys each extend query sees: bool [extend_len, prefix_len + extend_len].

    The committed prefix is always visible. Among the extend tokens the rule is causal
    (``is_causal``), all-visible (encoder-only layers), or, when ``mask_rows`` is given, that
    mask: SGLang's speculative tree mask for this request, flat, either ``extend_len`` rows of
    ``extend_len`` draft-token columns (``TreeMaskMode.QLEN_ONLY``, what SGLang builds on CPU:
    ``speculative/eagle_utils.py``, ``default_tree_mask_mode``) or ``extend_len`` rows of
    ``prefix_len + extend_len`` columns (``FULL_MASK``, the Triton custom-mask convention); the
    kernel reads only the draft-token columns of each row.
    """
    total = prefix_len + extend_len
    if mask_rows is not None:
        width = total if mask_rows.numel() == extend_len * total else extend_len
        rows = mask_rows.reshape(extend_len, width).bool()
        visible = torch.ones((extend_len, total), dtype=torch.bool)
        visible[:, prefix_len:] = rows[:, width - extend_len :]
        return visible
    if not is_causal:
        return torch.ones((extend_len, total), dtype=torch.bool)
    q_pos = torch.arange(extend_len).unsqueeze(1) + prefix_len
    return torch.arange(total).unsqueeze(0) <= q_pos


def extend_attention_cpu(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    sm_scale,
    logit_cap,
    is_cross_attn=False,
    sliding_window=None,
    encoder_lens=None,
    sinks=None,
    custom_mask=None,
    is_causal=True,
) -> None:
    """Prefill / target-verify attention: request i's extend tokens
    ``[extend_start_loc[i], +extend_seq_lens[i])`` attend to its prefix (read from the KV
    buffers, ``seq_len - extend_len`` tokens) and to the extend tokens themselves (from
    ``k_extend``/``v_extend``) as :func:`extend_visibility` allows. ``custom_mask`` is the
    flat tree mask of every request concatenated, ``extend_len * seq_len`` entries each
    (full layout) or ``extend_len ** 2`` (SGLang's CPU layout, QLEN_ONLY); a mask longer than
    the QLEN_ONLY layout needs and not exactly the full one is read as QLEN_ONLY from its
    start (SGLang's one-node verify at steps = 0 hands an all-True, oversized buffer).

    Upstream: ``sgl-kernel/csrc/cpu/extend.cpp`` (``extend_attention_cpu``; its stored version
    has no mask parameter, so the mask layout follows SGLang's Triton extend kernel).
    """
    op = "extend_attention_cpu"
    _refuse_unported(op, sliding_window=sliding_window, sinks=sinks,
                     is_cross_attn=is_cross_attn, encoder_lens=encoder_lens)  # fmt: skip
    if k_extend is None or v_extend is None:
        raise NotImplementedError(f"sgl_kernel stand-in: {op} has no KV-shared-layer port")
    full_layout = custom_mask is not None and custom_mask.numel() == int(
        (extend_seq_lens.long() * seq_lens.long()).sum()
    )
    if custom_mask is not None and not full_layout:
        need = int((extend_seq_lens.long() ** 2).sum())
        if custom_mask.numel() < need:
            raise RuntimeError(f"{op}: custom_mask has {custom_mask.numel()} entries, the "
                               f"tree needs {need}")  # fmt: skip
    mask_offset = 0
    for i, (rpi, seq_len, ext_len, start) in enumerate(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(),
            extend_start_loc.tolist())  # fmt: skip
    ):
        prefix_len = seq_len - ext_len
        if prefix_len < 0:
            raise RuntimeError(f"{op}: prefix len < 0 for request {i}")
        slots = req_to_token[rpi, :prefix_len].long()
        rows = slice(start, start + ext_len)
        keys = torch.cat([_dequant(k_buffer[slots], k_scale, op), k_extend[rows].float()])
        values = torch.cat([_dequant(v_buffer[slots], v_scale, op), v_extend[rows].float()])
        mask_rows = None
        if custom_mask is not None:
            size = ext_len * (seq_len if full_layout else ext_len)
            mask_rows = custom_mask[mask_offset : mask_offset + size]
            mask_offset += size
        visible = extend_visibility(prefix_len, ext_len, is_causal=is_causal, mask_rows=mask_rows)
        out = _attend(q_extend[rows], keys, values, visible, sm_scale, logit_cap)
        o_extend[rows] = out.to(o_extend.dtype)

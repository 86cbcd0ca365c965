"""Plain reference computations the kernel stand-in is checked against (no torch import:
the tensors bring their own)."""

from __future__ import annotations

import math


def softmax_attention(q, keys, values, scale):
    """One query token [H, D] over keys/values [N, HKV, D], head by head, with math.exp;
    grouped-query heads: head h reads kv head h // (H // HKV)."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    out = q.new_zeros(q.shape)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        logits = [float(q[h] @ keys[n, kv]) * scale for n in range(keys.shape[0])]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        for n, w in enumerate(weights):
            out[h] += w / total * values[n, kv]
    return out

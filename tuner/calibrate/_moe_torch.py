"""The mixture-of-experts block of the random-weight target that ``calibrate`` times.

torch is handed in by :mod:`tuner.calibrate.gpu` (the package's only torch importer), never
imported here. Routed experts are stored stacked, ``[experts, in, out]``, so the experts a
forward touches, the first ``D`` of them under the fixed dispatch of
:func:`tuner.calibrate._moe.balanced_routing`, are one contiguous slice and each projection is
one batched GEMM that reads exactly those ``D`` experts' weights, the way a grouped-GEMM MoE
kernel reads only the experts with tokens. The router still runs (GEMM, softmax, top-k) and
its top-k weights scale the experts' outputs, so its cost is in the forward; which experts the
tokens go to is the fixed dispatch (the module docstring of ``_moe`` says why).
"""

from __future__ import annotations

from typing import Any

from tuner.calibrate._moe import balanced_routing, layer_split
from tuner.calibrate._shapes import ModelShape

__all__ = ["layer_routes", "moe_forward", "moe_weights", "routing_tensors"]


def moe_weights(
    torch: Any, shape: ModelShape, dtype: Any, dev: Any, gen: Any, std: float
) -> dict[str, Any]:
    """One layer's router, stacked routed experts and (fused) shared experts."""
    s = shape

    def w(*dims: int) -> Any:
        return torch.empty(dims, dtype=dtype, device=dev).normal_(0.0, std, generator=gen)

    def stacked(rows: int, cols: int) -> Any:
        # One expert drawn, copied to the rest: values do not change GEMM time, and drawing
        # 34 GB of normals per Kimi-sized layer would take longer than timing it.
        t = torch.empty((s.experts, rows, cols), dtype=dtype, device=dev)
        t[0].normal_(0.0, std, generator=gen)
        if s.experts > 1:
            t[1:].copy_(t[:1].expand(s.experts - 1, rows, cols))
        return t

    L = {
        "router": w(s.hidden, s.experts),
        "w_gu": stacked(s.hidden, 2 * s.moe_inter),
        "w_down": stacked(s.moe_inter, s.hidden),
    }
    if s.shared_experts:
        # Shared experts run on every token; serving engines fuse them into one MLP.
        width = s.shared_inter * s.shared_experts
        L["s_gu"] = w(s.hidden, 2 * width)
        L["s_down"] = w(width, s.hidden)
    return L


def routing_tensors(
    torch: Any, shape: ModelShape, tokens: int, dev: Any, touched: int | None = None
) -> dict[str, Any]:
    """The fixed dispatch of ``tokens`` tokens as device index tensors (built before capture)."""
    r = balanced_routing(shape.experts, shape.experts_per_tok, tokens, touched)
    return {
        "touched": r.experts,
        "per_expert": r.per_expert,
        "token_of": torch.tensor(r.token_of, dtype=torch.long, device=dev),
        "choice_of": torch.tensor(r.choice_of, dtype=torch.long, device=dev),
    }


def layer_routes(
    torch: Any, shape: ModelShape, tokens: int, layers: int, dev: Any
) -> list[dict[str, Any]]:
    """One dispatch per built layer, :func:`layer_split`'s touched counts (two distinct ones
    at most, so two sets of tensors shared between layers)."""
    split = layer_split(shape.experts, shape.experts_per_tok, tokens, layers)
    made = {d: routing_tensors(torch, shape, tokens, dev, d) for d in set(split)}
    return [made[d] for d in split]


def moe_forward(
    torch: Any, shape: ModelShape, h: Any, L: dict[str, Any], route: dict[str, Any]
) -> Any:
    """Router, dispatch to the touched experts, their SwiGLU MLPs, weighted combine, plus the
    shared experts. ``h``: ``[tokens, hidden]``."""
    F = torch.nn.functional
    d, per, hidden = route["touched"], route["per_expert"], shape.hidden
    probs = torch.softmax((h @ L["router"]).float(), dim=-1)
    top_w = torch.topk(probs, shape.experts_per_tok, dim=-1).values
    top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(h.dtype)
    # Padding slots index the appended zero, so they add nothing to any token.
    slot_w = torch.cat([top_w.reshape(-1), top_w.new_zeros(1)])[route["choice_of"]]
    xs = h.index_select(0, route["token_of"]).view(d, per, hidden)
    gate, up = torch.bmm(xs, L["w_gu"][:d]).chunk(2, dim=-1)
    ys = torch.bmm(F.silu(gate) * up, L["w_down"][:d]).view(d * per, hidden)
    out = torch.zeros_like(h).index_add_(0, route["token_of"], ys * slot_w.unsqueeze(-1))
    if "s_gu" in L:
        sg, su = (h @ L["s_gu"]).chunk(2, dim=-1)
        out = out + (F.silu(sg) * su) @ L["s_down"]
    return out

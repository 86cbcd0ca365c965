"""Which routed experts a mixture-of-experts forward touches, and how its tokens reach them.

Pure: no torch. A decode forward of ``n`` tokens under top-``k`` routing over ``E`` experts
reads the weights of every expert at least one token picked. With routing uniform and
independent per token, each expert is missed by one token with probability ``1 − k/E``, so

    E[distinct experts] = E · (1 − (1 − k/E)^n)

which is what the verify pass of ``k_draft + 1`` tokens per request pays for at small batch:
one request at ``k_draft = 7`` touches ~52 of 128 experts where its plain decode touches 8.

``calibrate`` times that count with a deterministic assignment (:func:`balanced_routing`): the
``n·k`` (token, slot) pairs go round-robin over the first ``D`` experts, so each token still has
``k`` distinct experts, each touched expert gets ``⌈n·k/D⌉`` slots or one fewer, and one batched
GEMM over the first ``D`` experts' weights does the work. A layer can only touch whole experts:
:func:`layer_split` gives a share of the layers ``⌈E[D]⌉`` and the rest ``⌊E[D]⌋`` so the
forward's mean over layers is the expected count (to one layer's share), and a table of few
experts (Mixtral's 8) is not a staircase in ``n``.

Why not random routing: a CUDA graph needs fixed shapes, a random draw moves the count from one
capture to the next (the timing would measure the draw), and random weights say nothing about
a trained router's skew anyway. Not modelled: that skew (hot experts), and a routed token
count that varies across expert-parallel GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Routing", "balanced_routing", "expected_experts", "layer_split", "touched_experts"]


def _check(experts: int, top_k: int, tokens: int) -> None:
    for name, v in (("experts", experts), ("top_k", top_k), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if top_k > experts:
        raise ValueError(f"top_k {top_k} exceeds the {experts} experts")


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts ``tokens`` tokens touch under uniform top-k routing.

    Raises:
        ValueError: a non-positive count, or ``top_k > experts``.
    """
    _check(experts, top_k, tokens)
    if top_k == experts:
        return float(experts)
    return experts * -math.expm1(tokens * math.log1p(-top_k / experts))


def touched_experts(experts: int, top_k: int, tokens: int) -> int:
    """:func:`expected_experts` rounded to the nearest whole expert, within what is possible
    (at least ``top_k``, at most ``min(experts, tokens · top_k)``)."""
    d = math.floor(expected_experts(experts, top_k, tokens) + 0.5)
    return max(top_k, min(d, experts, tokens * top_k))


@dataclass(frozen=True)
class Routing:
    """A fixed dispatch of ``tokens`` tokens to the first ``experts`` experts.

    ``token_of[e * per_expert + j]`` is the token in slot ``j`` of expert ``e`` and
    ``choice_of`` the same slot's index into the router's ``[tokens, top_k]`` weights
    (flattened); padding slots (an expert with one slot fewer) use token 0 and index
    ``tokens * top_k``, which points at an extra zero weight, so they add nothing.
    """

    tokens: int
    top_k: int
    experts: int
    per_expert: int
    token_of: tuple[int, ...]
    choice_of: tuple[int, ...]

    @property
    def padding(self) -> int:
        return self.experts * self.per_expert - self.tokens * self.top_k


def layer_split(experts: int, top_k: int, tokens: int, layers: int) -> tuple[int, ...]:
    """Experts each of ``layers`` layers touches: the leading ``round(frac · layers)`` layers
    ``⌈E[D]⌉``, the rest ``⌊E[D]⌋``, both within what is possible (:func:`touched_experts`)."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a positive integer, got {layers!r}")
    mean = expected_experts(experts, top_k, tokens)
    hi_max = min(experts, tokens * top_k)
    lo = max(top_k, min(math.floor(mean), hi_max))
    hi = max(top_k, min(math.ceil(mean), hi_max))
    n_hi = math.floor((mean - lo) * layers + 0.5) if hi > lo else 0
    return (hi,) * n_hi + (lo,) * (layers - n_hi)


def balanced_routing(experts: int, top_k: int, tokens: int, touched: int | None = None) -> Routing:
    """Round-robin dispatch of every (token, slot) over ``touched`` experts (default
    :func:`touched_experts`).

    Slot ``s = token·top_k + j`` goes to expert ``s mod D``: ``top_k`` consecutive slots of a
    token land on ``top_k`` different experts since ``D ≥ top_k``.

    Raises:
        ValueError: ``touched`` outside ``top_k..min(experts, tokens · top_k)``.
    """
    d = touched_experts(experts, top_k, tokens) if touched is None else touched
    if not top_k <= d <= min(experts, tokens * top_k):
        raise ValueError(
            f"touched must be in {top_k}..{min(experts, tokens * top_k)} for {tokens} tokens, "
            f"got {d}"
        )
    slots = tokens * top_k
    per = -(-slots // d)
    token_of = [0] * (d * per)
    choice_of = [slots] * (d * per)
    fill = [0] * d
    for s in range(slots):
        e = s % d
        i = e * per + fill[e]
        token_of[i] = s // top_k
        choice_of[i] = s
        fill[e] += 1
    return Routing(
        tokens=tokens,
        top_k=top_k,
        experts=d,
        per_expert=per,
        token_of=tuple(token_of),
        choice_of=tuple(choice_of),
    )

"""SGLang's CUDA-graph batch sizes for speculative decode, and padding to them.

A decode batch runs in the smallest captured graph that holds it, so it costs what the padded
batch costs; a batch above the largest captured size runs eagerly at its own size. The default
capture list (``arg_groups/cuda_graph_hook.py`` in SGLang 0.5.23) is 1..8, 10..32 step 2,
40..64 step 4, 72..256 step 8, then step 16, cut at the largest batch the server can run.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

__all__ = ["DEFAULT_GRAPH_MAX_BS", "cuda_graph_bs", "pad_batch_size"]

DEFAULT_GRAPH_MAX_BS = 512


def cuda_graph_bs(max_bs: int = DEFAULT_GRAPH_MAX_BS) -> tuple[int, ...]:
    """SGLang's default captured decode batch sizes up to ``max_bs``."""
    sizes = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
    sizes += list(range(72, 257, 8)) + list(range(272, max(max_bs, 272) + 1, 16))
    return tuple(s for s in sizes if s <= max_bs)


def pad_batch_size(b: int, graph_bs: Sequence[int]) -> int:
    """The batch size a decode of ``b`` requests runs at (``b`` itself beyond the graphs)."""
    i = bisect_left(graph_bs, b)
    return graph_bs[i] if i < len(graph_bs) else b

"""Chain acceptance arithmetic (``anchors.md`` §3.3), shared by the static SGLang baseline and
the model-based policy.

A request accepts draft position ``i`` with probability ``α·δ^(i−1)`` given the positions
before it were accepted, so ``P(A ≥ i) = α^i·δ^(i(i−1)/2)`` and a step at arm ``k`` emits
``1 + Σ_{i≤k} P(A ≥ i)`` tokens on average (the bonus token included).
"""

from __future__ import annotations

__all__ = ["expected_accepted", "expected_emitted"]


def expected_accepted(alpha: float, delta: float, k: int) -> float:
    """Mean accepted drafts per request-step at arm ``k`` (bonus token excluded)."""
    if not (0.0 <= alpha <= 1.0 and 0.0 <= delta <= 1.0):
        raise ValueError(f"alpha and delta must be in [0, 1], got {alpha}, {delta}")
    total, p = 0.0, 1.0
    for i in range(1, k + 1):
        p *= alpha * delta ** (i - 1)
        total += p
    return total


def expected_emitted(alpha: float, delta: float, k: int) -> float:
    """Mean emitted tokens per request-step at arm ``k`` (bonus token included)."""
    return 1.0 + expected_accepted(alpha, delta, k)

"""A tree arm in the simulator: EAGLE drafts of top-k ``K``, depth ``S`` and ``N`` draft tokens.

A tree server (``--speculative-eagle-topk K --speculative-num-steps S
--speculative-num-draft-tokens N``) under the plugin has two arms, ``0`` and the tree, named
by its depth ``S`` (``tuner.protocol.TreeShape``). This module gives the tree's acceptance and
its step cost; the engine uses them for the arm ``S`` when its plugin core carries a tree.

**Acceptance** (a simple model; ``[I]``). The chain model of ``anchors.md`` §3.3 gives the
conditional acceptance ``p_i = α·δ^(i−1)`` of the draft's top-1 token at depth ``i``. A tree
keeps ``w_i`` candidates at depth ``i`` under the path accepted so far; each candidate beyond
the first catches a top-1 miss with probability ``g`` (the *top-k gain*), independently, so

    p'_i = 1 − (1 − p_i)·(1 − g)^(w_i − 1),        E[emitted] = 1 + Σ_{i≤S} Π_{j≤i} p'_j.

The ``N − 1`` nodes are placed depth by depth as EAGLE-2's reranking favours the likely path:
``w_i = min(K, max(1, r_i − (S − i)))`` of the ``r_i`` nodes left, keeping one for each deeper
depth (none left: the tree stops there). ``N = S + 1`` is the top-1 chain. The default
``g = 0.12`` is inferred from ``anchors.md`` §3.3: EAGLE-3's tree acceptance (Table 1,
τ 6–7.5 with about 60 nodes) is a per-depth acceptance of about 0.89 where the chain gives
0.775, i.e. the miss rate falls from 0.225 to about 0.105 with about 7 candidates per depth:
``(1 − g)^6 ≈ 0.47``. No published per-rank hit rate was available to pin it further.

**Cost.** The target verifies ``b·N`` tokens; each of the ``S`` draft steps runs ``b·K``
tokens; SGLang's draft extend after a tree verify runs over ``N`` tokens per request
(``speculative/eagle_worker_v2.py``, ``_draft_extend_for_decode``). With a measured table:
``S·draft(b, K) + target(b, N) + draft(b, N)``; with the parametric model of ``anchors.md``
§3.1: ``fwd(b·N, b, verify) + v_o + S·(d_o + d_n·b·K) + e_o + e_n·b·N``. The off arm costs
what ``k = 0`` costs for a chain server.

**Oracle.** :func:`tree_workload_emitted` takes the tree's tokens per request-step over a
workload as ``tuner.sim.oracle.workload_emitted`` does for chains, and
:func:`tree_oracle_table` picks 0 or the tree per batch size from exact expectations: what a
bench scenario of a tree server scores its policies against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tuner.protocol import TreeShape
from tuner.sim.acceptance import AcceptanceShape, beta_nodes
from tuner.sim.graphs import cuda_graph_bs, pad_batch_size
from tuner.sim.profiles import CostProfile, ParametricProfile, TableProfile
from tuner.sim.workloads import Workload, get_workload

__all__ = [
    "DEFAULT_TOPK_GAIN",
    "TreeArm",
    "parse_tree",
    "tree_expected_goodput",
    "tree_goodput",
    "tree_oracle_table",
    "tree_workload_emitted",
]

DEFAULT_TOPK_GAIN = 0.12


@dataclass(frozen=True)
class TreeArm:
    """A tree's shape and the top-k gain ``g`` of its acceptance model."""

    shape: TreeShape
    gain: float = DEFAULT_TOPK_GAIN

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gain) and 0.0 <= self.gain <= 1.0):
            raise ValueError(f"top-k gain must be in [0, 1], got {self.gain!r}")

    @property
    def steps(self) -> int:
        return self.shape.steps

    def widths(self) -> tuple[int, ...]:
        """Candidates under the accepted path at depths ``1..S``."""
        s, k = self.shape.steps, self.shape.topk
        left = self.shape.draft_tokens - 1
        out = []
        for i in range(1, s + 1):
            w = min(k, max(1, left - (s - i))) if left > 0 else 0
            out.append(w)
            left -= w
        return tuple(out)

    def lift(self, conditional: np.ndarray) -> np.ndarray:
        """Tree conditional acceptance per depth from the chain's (trailing axis: depths)."""
        w = np.asarray(self.widths(), dtype=np.float64)
        miss = (1.0 - np.clip(conditional, 0.0, 1.0)) * (1.0 - self.gain) ** np.maximum(w - 1, 0)
        return np.where(w > 0, 1.0 - miss, 0.0)

    def lift_survival(self, survival: np.ndarray) -> np.ndarray:
        """Tree ``P(A ≥ i)`` from chain survival rows ``P(A ≥ i)``, ``i = 1..S`` (last axis)."""
        surv = np.asarray(survival, dtype=np.float64)[..., : self.steps]
        prev = np.concatenate([np.ones_like(surv[..., :1]), surv[..., :-1]], axis=-1)
        cond = np.divide(surv, prev, out=np.zeros_like(surv), where=prev > 0)
        return np.cumprod(self.lift(cond), axis=-1)

    def expected_emitted(self, alpha: float, delta: float = 1.0, *,
                         kappa: float | None = None, shape: AcceptanceShape | None = None,
                         inverse: bool = False) -> float:  # fmt: skip
        """Expected tokens a request emits per tree step (bonus included), or ``E[1/emitted]``
        with ``inverse``, for first-position acceptance ``alpha`` (Beta with concentration
        ``kappa`` when given) under the chain ``alpha·delta^(i−1)`` or a class's ``shape``
        (its drift is not modelled here: taken at mid-request)."""
        if kappa is None:
            x, w = np.array([alpha]), np.array([1.0])
        else:
            x, w = beta_nodes(alpha, kappa)
        if shape is not None:
            cond = shape.conditional(x, self.steps)
        else:
            cond = x[:, None] * delta ** np.arange(self.steps, dtype=np.float64)[None, :]
        em = 1.0 + np.cumprod(self.lift(cond), axis=-1).sum(axis=-1)
        return float((w / em).sum() if inverse else (w * em).sum())

    def step_s(self, profile: CostProfile, b: int) -> float:
        """Seconds of one tree step of ``b`` requests (``b`` after graph padding)."""
        if b < 1:
            raise ValueError(f"batch size must be >= 1, got {b}")
        k, s, n = self.shape.topk, self.shape.steps, self.shape.draft_tokens
        if isinstance(profile, TableProfile):
            ms = s * profile.draft_ms(b, k) + profile.target_ms(b, n) + profile.draft_ms(b, n)
        elif isinstance(profile, ParametricProfile):
            p = profile
            ms = (
                p._fwd_ms(b * n, b, verify=True)
                + p.v_o
                + s * (p.d_o + p.d_n * b * k)
                + p.e_o
                + p.e_n * b * n
            )
        else:
            raise TypeError(f"no tree cost for a {type(profile).__name__}")
        return ms / 1000.0


def tree_expected_goodput(
    profile: CostProfile,
    tree: TreeArm,
    b: int,
    alpha: float,
    delta: float = 1.0,
    *,
    kappa: float | None = None,
    graph_bs: Sequence[int] | None = None,
) -> dict[int, float]:
    """Expected emitted tokens per busy second of ``b`` requests on each arm of a tree server:
    ``{0: off, S: tree}`` (the off arm with SGLang's default draft extend)."""
    padded = pad_batch_size(b, cuda_graph_bs() if graph_bs is None else graph_bs)
    return {
        0: b / profile.step_s(padded, 0),
        tree.steps: b * tree.expected_emitted(alpha, delta, kappa=kappa) / tree.step_s(profile,
                                                                                       padded),
    }


def tree_workload_emitted(
    workload: Workload | str,
    family: str,
    tree: TreeArm,
    *,
    t: float | None = None,
    heterogeneous: bool = True,
) -> float:
    """Tokens per request per tree step under a workload, weighted per request-step as
    ``tuner.sim.oracle.workload_emitted`` weights chains (``Σ tokens / Σ steps``): the mix in
    force at virtual time ``t``, or with ``t`` None the phases averaged by duration."""
    from tuner.sim.oracle import _decode_tokens_mean

    wl = get_workload(workload) if isinstance(workload, str) else workload
    kappa = wl.kappa if heterogeneous else None
    parts, start = [], 0.0
    if t is not None or wl.stationary:
        parts.append((1.0, wl.mix_at(0.0 if t is None else t)))
    else:
        for ph in wl.phases:
            parts.append((ph.duration_s / wl.period_s, wl.mix_at(start)))
            start += ph.duration_s
    total = 0.0
    for pw, mix in parts:
        tokens = steps = 0.0
        for w, cls in mix:
            alpha, delta = cls.alpha_delta(family)
            d = w * _decode_tokens_mean(cls.output)
            tokens += d
            steps += d * tree.expected_emitted(alpha, delta, kappa=kappa, shape=cls.shape,
                                               inverse=True)  # fmt: skip
        total += pw * tokens / steps
    return total


def tree_goodput(
    profile: CostProfile,
    workload: Workload | str,
    tree: TreeArm,
    b: int,
    *,
    t: float | None = None,
    graph_bs: Sequence[int] | None = None,
) -> float:
    """Expected emitted tokens per busy second of tree steps of ``b`` requests under a
    workload: the tree's counterpart of ``tuner.sim.oracle.expected_goodput`` (the bench scores
    a tree server's arm ``S`` with it)."""
    padded = pad_batch_size(b, cuda_graph_bs() if graph_bs is None else graph_bs)
    em = tree_workload_emitted(workload, profile.acceptance, tree, t=t)
    return b * em / tree.step_s(profile, padded)


def parse_tree(text: str) -> TreeShape:
    """``"KxSxN"`` (top-k, steps, draft tokens; SGLang's ``--speculative-eagle-topk``,
    ``--speculative-num-steps``, ``--speculative-num-draft-tokens``) -> a :class:`TreeShape`.

    Raises:
        ConfigError: not three integers joined by ``x``, or not a tree.
    """
    from tuner.errors import ConfigError
    from tuner.protocol import ProtocolError

    parts = text.strip().lower().split("x")
    try:
        topk, steps, tokens = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(
            f"tree {text!r}: give TOPKxSTEPSxTOKENS, e.g. 4x2x16 (top-k 4, 2 steps, "
            f"16 draft tokens)"
        ) from None
    try:
        return TreeShape(topk=topk, steps=steps, draft_tokens=tokens)
    except ProtocolError as exc:
        raise ConfigError(f"tree {text!r}: {exc}") from None


def tree_oracle_table(
    profile: CostProfile,
    workload: Workload | str,
    tree: TreeArm,
    batch_sizes: Sequence[int],
    *,
    graph_bs: Sequence[int] | None = None,
) -> tuple[tuple[int | None, int], ...]:
    """The best arm, 0 or the tree, per batch size of a tree server (exact expectations), as a
    policy table over ``batch_sizes`` (sorted; the last row unbounded)."""
    from tuner.sim.oracle import workload_emitted

    graphs = cuda_graph_bs() if graph_bs is None else graph_bs
    em_tree = tree_workload_emitted(workload, profile.acceptance, tree)
    em_off = workload_emitted(workload, profile.acceptance, 0)
    rows: list[tuple[int | None, int]] = []
    for b in sorted(set(batch_sizes)):
        pb = pad_batch_size(b, graphs)
        on = em_tree / tree.step_s(profile, pb)
        off = em_off / profile.step_s(pb, 0)
        k = tree.steps if on > off else 0
        if rows and rows[-1][1] == k:
            rows[-1] = (b, k)
        else:
            rows.append((b, k))
    rows[-1] = (None, rows[-1][1])
    return tuple(rows)

"""Sampled speculative verify for SGLang's CPU engine (a test fixture of tests/real).

SGLang 0.5.23 verifies greedily on CPU whatever the request asks (``_verify_uses_greedy``
returns true when ``is_cpu()``), and ``tree_speculative_sampling_target_only`` is None there.
With weightless models greedy acceptance is 0, so the tier installs, in the server process
only, CUDA's behaviour: sampled requests take the sampled verify, with this pure-torch port
of the kernel. ``--speculative-accept-threshold-acc t`` then sets the per-position
acceptance to min(1, 1/(V*t)) on a near-uniform target.
"""

from __future__ import annotations

import torch
from sgl_kernel.spec_ops import walk_tree

__all__ = [
    "top_k_renorm_prob",
    "top_p_renorm_prob",
    "tree_speculative_sampling_target_only",
    "verify_uses_greedy",
]


def verify_uses_greedy(*, is_all_greedy: bool, **_platform: bool) -> bool:
    """``_verify_uses_greedy`` as on CUDA: greedy only when every request is greedy."""
    return is_all_greedy


def tree_speculative_sampling_target_only(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Walk each request's draft tree; a child's draft token x is accepted when
    ``coin < p_acc(x) / threshold_acc`` or ``p(x) >= threshold_single`` (``p_acc`` sums the
    target mass of the siblings tried at this level, reset on acceptance; each accepted node
    brings its own coin). A rejected token's target mass is copied into ``draft_probs``; the
    token after the last accepted node is sampled from ``relu(target - draft)`` (no draft
    term when every level was accepted) with the final coin, by inverse CDF.

    Upstream: ``TreeSpeculativeSamplingTargetOnly`` in
    ``sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh`` (shipped in the wheel).
    """
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    vocab = target_probs.shape[-1]
    target = target_probs.reshape(bs * n, vocab)
    draft = draft_probs.reshape(bs * n, vocab)
    cand, ri, rnt, rns = (t.tolist() for t in (candidates, retrive_index, retrive_next_token,
                                               retrive_next_sibling))  # fmt: skip
    coins = uniform_samples.reshape(bs, n).tolist()
    final_coins = uniform_samples_for_final_sampling.reshape(-1).tolist()
    for bx in range(bs):
        prob_acc = 0.0
        row = bx * n  # the target distribution after the last accepted node
        coin = coins[bx][0]

        def coin_accepts(cur: int, last: int) -> bool:
            nonlocal prob_acc, row, coin
            token = cand[bx][cur]
            p = float(target[row, token])
            prob_acc += p
            if p > 0 and (coin < prob_acc / threshold_acc or p >= threshold_single):
                prob_acc = 0.0
                row = bx * n + cur
                coin = coins[bx][cur]
                predicts[last] = token
                return True
            draft[row, token] = target[row, token]
            return False

        accepted, last = walk_tree(bx, steps, accept_index, ri, rnt, rns, coin_accepts)
        accept_token_num[bx] = accepted
        q = target[row].float()
        if accepted != steps - 1:  # there are no draft probs for the bonus position
            q = (q - draft[row].float()).clamp(min=0)
        cdf = torch.cumsum(q, 0)
        u = final_coins[bx] * float(cdf[-1])
        hit = int(torch.searchsorted(cdf, torch.tensor([u]), right=True)[0])
        if hit >= vocab:  # u at the very top: the last token with mass, as upstream
            nonzero = torch.nonzero(q > 0)
            hit = int(nonzero[-1]) if nonzero.numel() else vocab - 1
        predicts[last] = hit


def _per_row(value, rows: int, dtype) -> torch.Tensor:
    t = value.reshape(-1).to(dtype) if isinstance(value, torch.Tensor) else torch.tensor([value])
    return t.to(dtype).expand(rows) if t.numel() == 1 else t


def _renorm_from_pivots(probs: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    kept = torch.where(probs >= pivots.unsqueeze(1), probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=1, keepdim=True)


def top_k_renorm_prob(probs: torch.Tensor, top_k) -> torch.Tensor:
    """Keep each row's k highest probabilities (and every tie at the k-th), renormalised.

    Upstream: ``top_k_renorm_probs_triton`` in ``sglang/kernels/ops/sampling/renorm_triton.py``
    (FlashInfer's ``top_k_renorm_probs`` semantics, what SGLang calls on CUDA).
    """
    probs = probs.float()
    rows, vocab = probs.shape
    top_ks = _per_row(top_k, rows, torch.int64)
    ordered = torch.sort(probs, dim=-1, descending=True).values
    cutoff = (top_ks - 1).clamp(min=0, max=vocab - 1)
    return _renorm_from_pivots(probs, ordered.gather(1, cutoff.unsqueeze(1)).squeeze(1))


def top_p_renorm_prob(probs: torch.Tensor, top_p) -> torch.Tensor:
    """Drop each row's least likely tokens whose total mass stays below 1 - p (ties at the
    pivot kept), renormalised.

    Upstream: ``top_p_renorm_probs_triton`` in ``sglang/kernels/ops/sampling/renorm_triton.py``
    (FlashInfer's ``top_p_renorm_probs`` semantics).
    """
    probs = probs.float()
    rows, vocab = probs.shape
    top_ps = _per_row(top_p, rows, torch.float32)
    ordered = torch.sort(probs, dim=-1).values
    cdf = torch.cumsum(ordered, dim=-1)
    cutoff = torch.searchsorted(cdf, (1.0 - top_ps).unsqueeze(1), right=False).squeeze(1)
    cutoff = cutoff.clamp(max=vocab - 1)
    return _renorm_from_pivots(probs, ordered.gather(1, cutoff.unsqueeze(1)).squeeze(1))

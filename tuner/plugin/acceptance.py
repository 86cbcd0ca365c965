"""The running per-position acceptance estimate of the current batch (pure; builtins only).

The plugin's hook and the simulator's engine both fold every decode step's verify result in
through :meth:`AcceptanceEstimate.observe`; the table lookup then reads :attr:`band`.

**What it estimates.** The per-position acceptance ``alpha``: the chance that a drafted token
is accepted given that every token before it was. A chain that drafted ``k`` and accepted
``a`` tried ``min(a + 1, k)`` positions and succeeded at ``a`` of them; the sums of both over
the batch, each an exponential moving average over steps (weight ``1 - DECAY`` per step, like
SGLang's own adaptive EMA with twice its memory), give ``alpha = successes / trials``. For
positions that accept independently with probability ``alpha`` this is the maximum-likelihood
estimate of the truncated geometric, so it does not depend on the arm that ran
(``accepted / drafted`` would: it falls as ``k`` grows). A tree step counts by its depth
(``k`` = its steps), as its counters do.

**Rank consistency.** Every TP rank's scheduler processes the same decode results in the
same order (results are processed in launch order, and every rank launches the same batches),
and each result carries the same per-request accepted counts on every rank (the verify runs
on the target model's gathered logits; SGLang's own adaptive EMA relies on the same fact).
The estimate uses nothing else: no clock, no randomness, no rank-local value, and the same
float operations in the same order give the same bits. So every rank holds the same band
before every launch, and every rank looks up the same ``k``.

**No evidence.** Steps with ``k = 0`` draft nothing and leave the estimate as it was; after
:data:`STALE_STEPS` of them in a row the band becomes :data:`UNKNOWN_BAND` and the sums are
cleared. The table's unknown-band ``k`` then applies, and protocol v2 requires it to be > 0
in every row where a known band drafts: the next step at such a batch size drafts, measures,
and puts the band back. Speculation therefore cannot lock off through a stale band; at most
one step in ``STALE_STEPS`` is a probe while the known band says ``k = 0`` (two under the
overlap scheduler, which looks the next arm up before the probe's result is folded in).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

from tuner.protocol import BAND_EDGES, UNKNOWN_BAND

__all__ = ["DECAY", "STALE_STEPS", "AcceptanceEstimate"]

# Per-step weight kept by the moving sums: a memory of about ten steps. A band is 0.15 wide,
# and placing a batch in it takes ~20 trials (sd of alpha <= 0.1); at k = 1 a step of one
# request is one trial. SGLang's own adaptive EMA keeps 0.8, half the memory: at one request
# that put the batch in the wrong band often enough to cost 1-1.5 % of goodput (bench, seeds
# 1-2, `diverse` and `chat`), while switching bands after a change takes ~7 steps, not ~3.
DECAY = 0.9
# Decode steps without drafting after which the estimate no longer describes the batch.
STALE_STEPS = 32


class AcceptanceEstimate:
    """Per-position acceptance of the running batch, and its band (see the module doc)."""

    __slots__ = ("successes", "trials", "band", "idle_steps", "decay", "stale_steps")

    def __init__(self, decay: float = DECAY, stale_steps: int = STALE_STEPS) -> None:
        if not 0.0 <= decay < 1.0 or stale_steps < 1:
            raise ValueError(f"decay must be in [0, 1) and stale_steps >= 1, got "
                             f"{decay}, {stale_steps}")
        self.decay = decay
        self.stale_steps = stale_steps
        self.successes = 0.0
        self.trials = 0.0
        self.band = UNKNOWN_BAND
        self.idle_steps = 0

    @property
    def alpha(self) -> float | None:
        """The estimate, or None while the band is unknown."""
        return self.successes / self.trials if self.band != UNKNOWN_BAND else None

    def observe(self, k: int, accepted_per_req: Sequence[int]) -> int:
        """Fold in one step that drafted ``k`` per request and accepted ``accepted_per_req``.

        Returns the band *before* this step (the band the step itself is counted in, so a
        step never selects its own band).
        """
        band = self.band
        if k <= 0 or not accepted_per_req:
            idle = self.idle_steps = self.idle_steps + 1
            if idle >= self.stale_steps and band != UNKNOWN_BAND:
                self.band = UNKNOWN_BAND
                self.successes = self.trials = 0.0
            return band
        self.idle_steps = 0
        s = sum(accepted_per_req)
        # sum of min(a + 1, k): one more than accepted, except where all k were accepted.
        t = s + len(accepted_per_req) - accepted_per_req.count(k)
        decay = self.decay
        self.successes = succ = self.successes * decay + s
        self.trials = trials = self.trials * decay + t
        self.band = 1 + bisect_right(BAND_EDGES, succ / trials)
        return band

    def observe_totals(
        self, k: int, requests: int, accepted: int, full: float | None = None,
        _band: Callable[[Sequence[float], float], int] = bisect_right,
        _edges: tuple[float, ...] = BAND_EDGES,
    ) -> int:
        """As :meth:`observe` from totals: ``accepted`` drafts over ``requests`` requests,
        ``full`` of which accepted all ``k`` (for callers that keep no per-request list).

        ``full`` None: not counted (the plugin counts it only on batches of up to
        ``FULL_SAMPLE`` requests, since a count over the whole list is the largest part of
        the per-step cost on large batches). It is then taken at its expectation
        ``requests * alpha**k`` under the estimate so far (the per-drafted ratio before
        there is one), an EM step whose fixed point is the maximum-likelihood alpha given
        the batch's total; deterministic, so every TP rank takes the same value.
        """
        band = self.band
        if k <= 0 or requests <= 0:
            return self.observe(0, ())
        self.idle_steps = 0
        decay = self.decay
        if full is None:
            if accepted <= 0:
                full = 0
            elif accepted >= requests * k:
                full = requests
            else:
                alpha = (self.successes / self.trials if self.trials > 0.0
                         else accepted / (requests * k))
                full = requests * alpha**k
        self.successes = succ = self.successes * decay + accepted
        self.trials = trials = self.trials * decay + accepted + requests - full
        self.band = 1 + _band(_edges, succ / trials)
        return band

"""The machine's speed now: a time effect shared by every arm, taken out of the step times.

A loaded CPU server's step times drift by 1.5-2x over minutes, other tenants come and go,
clocks throttle. Every arm running at a time meets the same machine, so the drift says
nothing about which arm is better, but a policy comparing an arm timed in a slow minute
with one timed in a fast one reads it as a difference between the arms, and is sure of it:
the arm with the unlucky minute is not tried again.

:class:`MachineSpeed` estimates the machine's log speed offset from the readings themselves:
each ``(b, k)`` keeps a long-memory mean of its (corrected) log step time, and a reading's
residual against its key's mean, weighted by the busy seconds it covers and by how well its
key is known, goes into a short-memory average, the offset. Only relative speed is known
(a machine slow for all of its history looks like slow arms): what it buys is that arms
timed at different moments are compared as if timed at the same one.

The offset is applied only where the machine is seen to drift: per ``(b, k)``, readings'
spread within windows of busy time against the difference between windows (a
random-effects analysis of variance, pooled over every key) must show a variance a window
adds, clearly above zero. Where step times do not drift (a GPU server, the simulator, whose
noise is independent per step) readings pass unchanged, so the policy is what it was.
"""

from __future__ import annotations

import math
from dataclasses import replace

from policies._base import Observation

__all__ = ["MachineSpeed"]

# Prior weight of "the machine is as it was", in busy seconds of readings at residual zero.
_PRIOR_S = 0.5
# Drift is measured between windows of this many busy seconds, and counts only once this many
# window pairs stand behind it and it is _Z_ON standard errors above zero; then until it
# falls below _Z_OFF (a gate that does not flicker at its threshold).
_WINDOW_S = 5.0
_MIN_PAIRS = 4.0
_Z_ON, _Z_OFF = 3.0, 1.0
_MEMORY_PAIRS = 200.0


class MachineSpeed:
    """Log speed offset of the machine now (see the module doc).

    Args:
        memory_s: busy seconds over which the offset averages residuals (how fast the
            machine is assumed to move).
        key_memory_s: busy seconds over which a ``(b, k)``'s own mean forgets (what the
            residuals are measured against).
    """

    def __init__(self, memory_s: float, key_memory_s: float) -> None:
        self._memory_s = memory_s
        self._key_memory_s = key_memory_s
        self._clock = 0.0
        self._num = self._den = 0.0
        # (b, k) -> [busy seconds behind the mean (aged), mean corrected log step time, clock]
        self._keys: dict[tuple[int, int], list[float]] = {}
        self.offset = 0.0
        # Whether the machine drifts at all: per (b, k), raw readings' spread within windows
        # of busy time against the difference between windows (random-effects ANOVA).
        self._window = 0
        self._open: dict[tuple[int, int], list[float]] = {}  # readings, Σ log t, Σ log t²
        self._last: dict[tuple[int, int], tuple[float, float]] = {}  # mean, readings
        self._pairs = [0.0] * 6  # discounted count, d², h, d⁴, d²·h, h²
        self._within = [0.0, 0.0]  # discounted squared residuals, degrees of freedom
        self._drift_var = 0.0  # as of the last reading the gate judged (0: shut)

    def correct(self, obs: Observation) -> Observation:
        """``obs`` with the machine's offset taken out of its busy time (as read on the
        machine's average speed); an observation without steps or time passes unchanged."""
        busy, steps = obs.busy_s, obs.decode_steps
        if not (busy > 0 and steps > 0 and math.isfinite(busy)):
            return obs
        log_t = math.log(busy / steps)
        self._clock += busy
        self._track_drift(obs.b, obs.k, log_t)
        keep = math.exp(-busy / self._memory_s)
        self._num *= keep
        self._den *= keep
        key = self._keys.get((obs.b, obs.k))
        if key is not None:
            key[0] *= math.exp(-(self._clock - key[2]) / self._key_memory_s)
            known = key[0] / (key[0] + busy)  # a key read once says little of its mean
            self._num += busy * known * (log_t - key[1])
            self._den += busy * known
        self.offset = self._num / (self._den + _PRIOR_S)
        corrected = log_t - self.offset
        if key is None:
            self._keys[(obs.b, obs.k)] = [busy, corrected, self._clock]
        else:
            key[1] += busy * (corrected - key[1]) / (key[0] + busy)
            key[0] += busy
            key[2] = self._clock
        if self.offset == 0.0 or self._judge_drift() == 0.0:
            return obs
        return replace(obs, busy_s=busy * math.exp(-self.offset))

    def _track_drift(self, b: int, k: int, log_t: float) -> None:
        window = int(self._clock // _WINDOW_S)
        if window != self._window:
            keep = 1.0 - 1.0 / _MEMORY_PAIRS
            for key, (n, s, s2) in self._open.items():
                mean, prev = s / n, self._last.get(key)
                self._last[key] = (mean, n)
                if n > 1:
                    self._within[0] = self._within[0] * keep + max(s2 - s * mean, 0.0)
                    self._within[1] = self._within[1] * keep + n - 1.0
                if prev is not None:
                    d2, h = (mean - prev[0]) ** 2, 1.0 / n + 1.0 / prev[1]
                    for i, x in enumerate((1.0, d2, h, d2 * d2, d2 * h, h * h)):
                        self._pairs[i] = self._pairs[i] * keep + x
            self._open, self._window = {}, window
        acc = self._open.setdefault((b, k), [0.0, 0.0, 0.0])
        acc[0] += 1.0
        acc[1] += log_t
        acc[2] += log_t * log_t

    def drift_var(self) -> float:
        """The variance a window of busy time adds to a reading beyond the readings' own
        spread within windows, as last judged; 0 unless clearly positive (then the offset is
        applied)."""
        return self._drift_var

    def _judge_drift(self) -> float:
        """:meth:`drift_var` judged anew from the window pairs (the gate moves here only)."""
        n, d2, h, d4, d2h, h2 = self._pairs
        ss, dof = self._within
        if n < _MIN_PAIRS or dof < _MIN_PAIRS:
            self._drift_var = 0.0
            return 0.0
        v = ss / dof
        mean = (d2 - v * h) / n
        second = (d4 - 2 * v * d2h + v * v * h2) / n
        se = math.sqrt(max(second - mean * mean, 0.0) / n)
        drifting = mean > (_Z_OFF if self._drift_var > 0 else _Z_ON) * se
        # Each of the two windows carries its own drift: the pair's difference holds two.
        self._drift_var = mean / 2 if drifting else 0.0
        return self._drift_var

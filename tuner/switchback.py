"""The switchback experiment (``run --holdout``): when the server runs its baseline table,
and what that measures. Pure: no I/O, no clock.

Design. Time from the experiment's start is cut into windows of ``window_s``; windows form
blocks of ``B = round(1 / fraction)``. In every block one adjacent pair of windows is drawn
at random (its position, and which of the two runs the baseline), seeded, so the baseline
runs ``1/B`` of the time at places the load cannot anticipate. The pair's other window runs
the tuned table as usual (the *control*); every other window is ordinary tuning.

Estimate. A pair compares the two adjacent windows within each batch-size bucket both saw
(goodput = emitted tokens per busy second in that bucket and window), weighting a bucket by
the pair's busy seconds in it: ``A_i = Σ_j w_ij·g_control`` and ``B_i = Σ_j w_ij·g_base``.
The gain is the ratio estimate ``Σ A / Σ B − 1``. Its 95 % interval comes from the pairs as
units (delta method, Student t with ``n − 1`` degrees of freedom): load and acceptance drift
slowly, so steps and seconds within a window are strongly autocorrelated, adjacent windows
share most of that drift, and pairs drawn in different blocks are close to independent.
Randomising which window of a pair is the baseline keeps drift inside a pair from biasing it.

Cost: the goodput the baseline windows did not make, as a share of what the experiment's span
(from its start to the end of the last pair's block) would have made on the tuned table:
``R·T_base / (T_all + R·T_base)`` with ``T`` tokens emitted. That is at most ``fraction × R``
whenever ``T_base <= fraction × T_all``, which a share of *time* does not ensure: a baseline
window on a busy stretch carries more than its share of the tokens. So a :class:`Budget` keeps
the baseline's share of the *tokens* at most ``fraction`` by construction: a drawn pair runs
only when the tokens already banked (``fraction × T_all − T_base``) cover a window like the
last one, and a baseline window ends early when the next interval could overdraw them. Both
decisions read only the past, never the pair's own outcome, so the pairs stay unbiased; a
skipped pair is recorded (``holdout_skip``), a cut window still pairs with its control.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "ROLES",
    "Budget",
    "Pair",
    "Schedule",
    "SwitchbackGain",
    "Window",
    "estimate",
    "parse_fraction",
    "t975",
]

ROLES = ("tuned", "base", "control")  # the schedule's; the budget adds "cut"
MAX_FRACTION = 0.5  # one window in two: every window is then in a pair

# Student t, 97.5 % quantile, for 1..10 degrees of freedom (above: the Cornish-Fisher series,
# within 1e-4 of the exact value from 10 on).
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281)
_Z975 = 1.959964


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (``inf`` below 1)."""
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = _Z975, float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def parse_fraction(text: str | float) -> float:
    """``"5%"``, ``"0.05"`` or ``0.05`` -> 0.05. Raises ValueError naming the range."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"expected a share of the time such as 5% or 0.05, got {raw!r}") from None
    if not (0 < value <= MAX_FRACTION) or not math.isfinite(value):
        raise ValueError(f"must be above 0 and at most {MAX_FRACTION:.0%}, got {raw!r}")
    return value


@dataclass(frozen=True)
class Schedule:
    """Which window runs what, from seconds since the experiment started."""

    fraction: float
    window_s: float
    seed: int = 0

    def __post_init__(self) -> None:
        parse_fraction(self.fraction)
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ValueError(f"window must be positive seconds, got {self.window_s!r}")

    @property
    def block(self) -> int:
        """Windows per block (one pair each)."""
        return max(2, round(1 / self.fraction))

    def block_span(self, n: int) -> tuple[float, float]:
        """Block ``n``'s ``[start, end)`` in seconds since the experiment started."""
        length = self.block * self.window_s
        return n * length, (n + 1) * length

    @property
    def share(self) -> float:
        """The share of time the baseline runs (``1 / block``, close to ``fraction``)."""
        return 1 / self.block

    def pair_in_block(self, n: int) -> tuple[int, bool]:
        """Block ``n``'s pair: the first window's position, and whether it is the baseline."""
        rng = random.Random(f"dynspec-switchback/{self.seed}/{n}")
        return rng.randrange(self.block - 1), rng.random() < 0.5

    def at(self, elapsed: float) -> tuple[int, str]:
        """``(block, role)`` at ``elapsed`` seconds; role is one of :data:`ROLES`."""
        w = math.floor(max(0.0, elapsed) / self.window_s + 1e-9)
        n, i = divmod(w, self.block)
        pos, base_first = self.pair_in_block(n)
        if i == pos:
            return n, "base" if base_first else "control"
        if i == pos + 1:
            return n, "control" if base_first else "base"
        return n, "tuned"


@dataclass
class Budget:
    """The baseline's tokens against its allowance, ``fraction`` of all tokens since the start.

    Tokens enter at every reading (``add``); ``banked`` is what the baseline may still emit.
    A baseline interval of ``x`` tokens lowers it by ``(1 − fraction)·x`` (its tokens count
    in both), a tuned one raises it by ``fraction·x``."""

    fraction: float
    tokens: float = 0.0
    base_tokens: float = 0.0
    base_busy_s: float = 0.0
    skipped: int | None = None  # the last block whose pair it could not pay for
    cut: int | None = None  # the last block whose baseline window it ended early

    def add(self, tokens: float, busy_s: float, *, base: bool) -> None:
        self.tokens += tokens
        if base:
            self.base_tokens += tokens
            self.base_busy_s += busy_s

    @property
    def banked(self) -> float:
        return self.fraction * self.tokens - self.base_tokens

    def affords(self, tokens: float) -> bool:
        """Whether the baseline may emit ``tokens`` more and stay within its share."""
        return self.banked >= (1 - self.fraction) * max(0.0, tokens)

    def admit(self, block: int, drawn: str, *, pair_open: bool, window_forecast: float,
              tick_forecast: float) -> str:
        """The role the next interval runs: ``drawn`` (the schedule's), ``tuned`` for a pair
        skipped when its first window would start (``pair_open`` False) without the tokens
        for a window of ``window_forecast``, or ``cut`` (the tuned table, in neither window)
        for the rest of a baseline window once an interval of ``tick_forecast`` could
        overdraw. The forecasts are past readings' (no forecast yet: ``inf``)."""
        if drawn == "tuned" or self.skipped == block:
            return "tuned"
        if not pair_open and not self.affords(window_forecast):
            self.skipped = block
            return "tuned"
        if drawn != "base":
            return drawn
        if self.cut != block and not self.affords(tick_forecast):
            self.cut = block
        return "cut" if self.cut == block else "base"


@dataclass
class Window:
    """Emitted tokens and busy seconds per stratum (batch-size bucket) in one window."""

    sums: dict[str, list[float]] = field(default_factory=dict)
    start: float | None = None
    end: float | None = None

    def add(self, stratum: str, emitted: float, busy_s: float) -> None:
        row = self.sums.setdefault(stratum, [0.0, 0.0])
        row[0] += emitted
        row[1] += busy_s

    @property
    def tokens(self) -> float:
        return sum(e for e, _ in self.sums.values())

    @property
    def busy_s(self) -> float:
        return sum(b for _, b in self.sums.values())


@dataclass(frozen=True)
class Pair:
    """One baseline window and its adjacent control window."""

    block: int
    base: Mapping[str, Sequence[float]]  # stratum -> (emitted, busy_s)
    control: Mapping[str, Sequence[float]]
    base_span: tuple[float, float]
    control_span: tuple[float, float]
    base_table: str = ""  # protocol.format_table of the baseline
    block_span: tuple[float, float] | None = None  # the block's [start, end): the cost's span

    def terms(self) -> tuple[float, float] | None:
        """``(A, B)``: busy-weighted control and baseline goodputs over the shared strata."""
        a = b = 0.0
        for key, (eb, sb) in self.base.items():
            if key not in self.control:
                continue
            ec, sc = self.control[key]
            if sb <= 0 or sc <= 0:
                continue
            w = sb + sc
            a += w * ec / sc
            b += w * eb / sb
        return (a, b) if b > 0 else None

    def to_json(self) -> str:
        def r(x: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
            return {k: [round(v[0], 3), round(v[1], 6)] for k, v in x.items()}

        return json.dumps({"block": self.block, "base": r(self.base), "control": r(self.control),
                           "base_span": list(self.base_span),
                           "control_span": list(self.control_span),
                           "base_table": self.base_table,
                           "block_span": list(self.block_span) if self.block_span else None},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Pair:
        d = json.loads(text)
        return cls(int(d["block"]), {k: tuple(v) for k, v in d["base"].items()},
                   {k: tuple(v) for k, v in d["control"].items()},
                   tuple(d["base_span"]), tuple(d["control_span"]), d.get("base_table", ""),
                   tuple(d["block_span"]) if d.get("block_span") else None)


@dataclass(frozen=True)
class SwitchbackGain:
    """The measured gain of the tuned table over the baseline, and what measuring cost."""

    ratio: float
    low: float
    high: float
    pairs: int
    base_share: float  # of busy time on the baseline, over the experiment's span
    cost: float  # goodput not made, as a share of the span's goodput on the tuned table
    cost_high: float  # the same at the interval's upper end

    def as_dict(self) -> dict[str, float | int | None]:
        def f(x: float) -> float | None:
            return round(x, 5) if math.isfinite(x) else None

        return {"ratio": f(self.ratio), "ci95": [f(self.low), f(self.high)], "pairs": self.pairs,
                "base_share": f(self.base_share), "cost": f(self.cost),
                "cost_high": f(self.cost_high)}


def _cost(r: float, base_tokens: float, all_tokens: float) -> float:
    if not math.isfinite(r) or all_tokens <= 0:
        return math.nan
    lost = max(0.0, r) * base_tokens
    return lost / (all_tokens + lost)


def estimate(pairs: Sequence[Pair], *, all_tokens: float, all_busy_s: float,
             base_tokens: float | None = None,
             base_busy_s: float | None = None) -> SwitchbackGain | None:
    """The gain over the pairs with a shared stratum (None without one); ``all_*``: tokens and
    busy seconds over the experiment's span, for the cost and the baseline's share;
    ``base_*``: the same in every baseline window of the span (those of void pairs too),
    else the usable pairs' baseline sums."""
    terms = [t for t in (p.terms() for p in pairs) if t is not None]
    if not terms:
        return None
    n = len(terms)
    sa = sum(a for a, _ in terms)
    sb = sum(b for _, b in terms)
    r = sa / sb - 1
    if n >= 2:
        resid = [a - (1 + r) * b for a, b in terms]
        se = math.sqrt(sum(e * e for e in resid) / (n * (n - 1))) / (sb / n)
        half = t975(n - 1) * se
    else:
        half = math.inf
    if base_tokens is None:
        base_tokens = sum(v[0] for p in pairs for v in p.base.values())
    base_busy = (sum(v[1] for p in pairs for v in p.base.values()) if base_busy_s is None
                 else base_busy_s)
    share = base_busy / all_busy_s if all_busy_s > 0 else math.nan
    return SwitchbackGain(r, r - half, r + half, n, share, _cost(r, base_tokens, all_tokens),
                          _cost(r + half, base_tokens, all_tokens))

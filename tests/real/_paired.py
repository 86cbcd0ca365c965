"""Pinned arms compared in paired rounds (imported by name; pure, no server).

A measurement runs in rounds; each round pins every arm once for one slice, in an order that
rotates from round to round. An arm's goodput is what the daemon optimises: its emitted tokens
over its busy seconds (the plugin's counters), summed over all rounds. Two arms are compared by
the log of their goodput ratio, whose standard error takes the rounds as units (delta method):
load from outside that drifts from one round to the next slows both arms of a round alike and
cancels in the pair. Unpaired errors from the spread of single slices were 15-30 % on the
shared 2-core machine, too wide to decide 2 %.

A learned arm is then, against the measured best, ``within`` the tolerance, ``worse`` (its
shortfall is over the tolerance by more than the measurement's resolution, the half-width of
the paired log ratio's 95 % interval: Student t with one degree of freedom fewer than rounds,
as a few rounds of a bursty load are all a test has), or ``unresolved`` (over the tolerance,
but not by more than the resolution: the measurement cannot tell it from an arm inside the
tolerance, and says so). The test is of "short by more than the tolerance", not of "short at
all": an arm truly 1.5 % short measures past 2 % in a good share of runs, and a verdict that
needs only the shortfall's sign resolved called it worse.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tuner.switchback import t975

__all__ = ["Tally", "Verdict", "arm_figures", "compare", "log_ratio", "own_ratio", "round_order",
           "settled"]


@dataclass(frozen=True)
class Tally:
    """One arm's counter deltas in one round (the bucket under test only)."""

    emitted: int = 0
    busy_s: float = 0.0
    steps: int = 0
    accepted: int = 0
    drafted: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.emitted + other.emitted, self.busy_s + other.busy_s,
                     self.steps + other.steps, self.accepted + other.accepted,
                     self.drafted + other.drafted)  # fmt: skip


Rounds = Sequence[Mapping[int, Tally]]  # round -> arm -> what it ran in that round's slice


def round_order(arms: Sequence[int], r: int) -> list[int]:
    """Round ``r``'s order: rotated, so that every arm takes every place in turn (the first
    slice of a round follows another arm's, and a slow start would otherwise fall on one)."""
    s = r % len(arms)
    return [*arms[s:], *arms[:s]]


def _total(rounds: Rounds, k: int) -> Tally:
    out = Tally()
    for r in rounds:
        out = out + r.get(k, Tally())
    return out


def _units(rounds: Rounds, k: int) -> list[float] | None:
    """Each round's share of ``log(goodput k)``'s linearisation: e_r/E - t_r/T."""
    tot = _total(rounds, k)
    if tot.emitted <= 0 or tot.busy_s <= 0:
        return None
    return [r.get(k, Tally()).emitted / tot.emitted - r.get(k, Tally()).busy_s / tot.busy_s
            for r in rounds]  # fmt: skip


def _se(units: list[float]) -> float:
    n = len(units)
    return math.sqrt(n / (n - 1) * sum(u * u for u in units)) if n > 1 else math.inf


def goodput(rounds: Rounds, k: int) -> float | None:
    tot = _total(rounds, k)
    return tot.emitted / tot.busy_s if tot.busy_s > 0 and tot.emitted > 0 else None


def log_ratio(rounds: Rounds, a: int, b: int) -> tuple[float, float] | None:
    """``log(goodput a / goodput b)`` and its paired standard error (None if either arm ran no
    timed step)."""
    ga, gb, ua, ub = goodput(rounds, a), goodput(rounds, b), _units(rounds, a), _units(rounds, b)
    if ga is None or gb is None or ua is None or ub is None:
        return None
    return math.log(ga / gb), _se([x - y for x, y in zip(ua, ub)])


def arm_figures(rounds: Rounds, arms: Iterable[int]) -> dict[int, dict]:
    """Per arm: goodput (tok/s of busy time), its own (unpaired) relative standard error over
    rounds, steps, mean step time and measured acceptance (accepted / drafted)."""
    out = {}
    for k in arms:
        tot, units = _total(rounds, k), _units(rounds, k)
        out[k] = {
            "goodput": goodput(rounds, k),
            "rel_se": _se(units) if units is not None else None,
            "steps": tot.steps,
            "step_ms": 1000 * tot.busy_s / tot.steps if tot.steps else None,
            "acceptance": tot.accepted / tot.drafted if tot.drafted else None,
        }
    return out


@dataclass(frozen=True)
class Verdict:
    best: int
    chosen: int
    gap: float  # 1 - goodput(chosen) / goodput(best): 0 when the learned arm is the best
    se: float  # paired standard error of log(goodput chosen / goodput best); 0 when the same
    rounds: int
    verdict: str  # "within" | "unresolved" | "worse"

    @property
    def resolution(self) -> float:
        """The smallest shortfall this measurement tells from none (95 %, Student t)."""
        return 1 - math.exp(-t975(self.rounds - 1) * self.se) if self.se else 0.0

    @property
    def ok(self) -> bool:
        return self.verdict != "worse"


def compare(rounds: Rounds, arms: Sequence[int], chosen: int, tolerance: float) -> Verdict:
    """The arm with the highest goodput against ``chosen``."""
    figures = {k: goodput(rounds, k) for k in arms}
    missing = [k for k, g in figures.items() if g is None]
    if missing:
        raise ValueError(f"arms {missing} ran no timed step in the bucket")
    best = max(arms, key=lambda k: figures[k])
    if chosen == best:
        return Verdict(best, chosen, 0.0, 0.0, len(rounds), "within")
    lr = log_ratio(rounds, chosen, best)
    assert lr is not None
    value, se = lr
    gap = 1 - math.exp(value)
    if gap <= tolerance:
        verdict = "within"
    elif math.log(1 - tolerance) - value > t975(len(rounds) - 1) * se:
        verdict = "worse"
    else:
        verdict = "unresolved"
    return Verdict(best, chosen, gap, se, len(rounds), verdict)


def settled(rounds: Rounds, arms: Sequence[int], tolerance: float) -> bool:
    """Whatever arm a table picks, its verdict is known: every arm is within the tolerance of
    the measured best, or short of it by more than the resolution."""
    try:
        return all(compare(rounds, arms, k, tolerance).verdict != "unresolved" for k in arms)
    except ValueError:  # an arm not measured yet
        return False


def own_ratio(cells: Iterable[tuple[float, int, Tally]], a: int, b: int, block_s: float = 5.0,
              min_blocks: int = 2) -> tuple[float, float, int] | None:
    """``log(goodput a / goodput b)`` in a daemon's own cells (``(ts, k, tally)`` rows of one
    bucket), its standard error and the fewer of the two arms' blocks; None if either arm has
    fewer than ``min_blocks`` blocks (two at least: the error needs a spread). The arms ran at different times, so the ratio is unpaired: each
    arm's error takes its ``block_s`` blocks of busy time as units (the machine's load drifts
    over seconds, and single readings within a block move together)."""
    per_arm: dict[int, dict[int, Tally]] = {a: {}, b: {}}
    for ts, k, tally in cells:
        if k in per_arm:
            block = int(ts // block_s)
            per_arm[k][block] = per_arm[k].get(block, Tally()) + tally
    figures = []
    for k in (a, b):
        rounds = [{k: t} for t in per_arm[k].values()]
        g, units = goodput(rounds, k), _units(rounds, k)
        if g is None or units is None or len(units) < max(min_blocks, 2):
            return None
        figures.append((g, _se(units), len(units)))
    (ga, sa, na), (gb, sb, nb) = figures
    return math.log(ga / gb), math.hypot(sa, sb), min(na, nb)

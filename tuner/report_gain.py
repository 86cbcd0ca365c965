"""``report``'s "does it pay?": the gain of the table in effect over the server's starting
table, k = 0 and always-speculate, with 95 % intervals (:mod:`tuner.gain`).

Weights: each bucket's share of the server's busy time in the window (how long the load kept
it there). Goodputs: the report's own ratio estimates where the arm was measured in that
bucket with an interval (two or more intervals), else the model policy's estimate fed with
the window's per-(b, k) sums (``model``: shares strength across batch sizes and arms through
acceptance and a smooth step time). The starting table is the one the daemon read before its
first push (``initial_table`` events); without one, SGLang's startup step is assumed.

Intervals. The delta method (:mod:`tuner.gain`) treats every sampling interval as independent,
but a server's load, batch-size mix and acceptance drift slowly, so neighbouring intervals
share most of their error and that interval is too narrow (on the simulator it held the true
gain in 2 of 4 runs). Given the report's time-binned sums, the interval is instead a
delete-a-group jackknife over ``JACKKNIFE_GROUPS`` contiguous stretches of time: the estimate
(measured goodputs and weights) is recomputed without each stretch in turn, and the half-width
is ``t(G−1)`` times the jackknife's standard error, or the delta method's where that is wider.
Stretches many intervals long carry the autocorrelation inside them, which is what makes the
error honest. The model is refitted without a stretch only when leaving it out turns a
measured goodput the gain uses into a modelled one (the model policy recomputes its
posterior on every observation: about a second per fit); otherwise the fill-ins keep the
whole window's values, so a mostly modelled gain (often "over k=0") has the model's own
interval.
"""

from __future__ import annotations

import logging
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from policies import Buckets, Observation, make_policy, sum_by_arm
from tuner.gain import Z95, ArmValue, BucketValues, Gain, as_ran, estimate_gain, table_arm
from tuner.protocol import sglang_start_arm
from tuner.report import ServerReport, always_arm, summarize
from tuner.switchback import t975

if TYPE_CHECKING:
    from storage import Storage

__all__ = ["BASELINE_LABELS", "ReportGain", "parse_table_text", "server_gains"]

log = logging.getLogger(__name__)

BASELINE_LABELS = {"start": "the server's starting table", "k0": "k=0 (no speculation)",
                   "always": "always-speculate"}
# Under banded tables a bucket's arms each ran only in the acceptance bands that chose them
# (an arm run in high-acceptance bands alone looks far better than it would on all traffic),
# so the table is valued as it ran: every arm's goodput weighed by its busy time, the
# pseudo-arm below. k = 0 yields the same whatever the acceptance, so the gain over it stays
# honest; a drafting baseline's cell does not.
AS_RAN = -1
BANDED_NOTE = ("gain over the starting table and always-speculate: not estimated, since "
               "under banded tables each arm ran only in the acceptance bands that chose it "
               "(--holdout measures it); the gain over k=0 takes the rows as they ran, "
               "exploration included")
# A banded row (``k3/1,3,3,5``) reads as its unknown band's arm, the band-agnostic one.
_ROW = re.compile(r"^(?:b<=(\d+)|rest):k(\d+)(?:/[\d,]+)?$")
# Contiguous stretches of time the jackknife leaves out in turn (fixed in advance, not fitted).
JACKKNIFE_GROUPS = 8


@dataclass(frozen=True, slots=True)
class ReportGain:
    gain: Gain
    base_table: tuple[tuple[int | None, int], ...]
    assumed: bool  # the starting table was not recorded: SGLang's startup step assumed
    banded: bool = False  # the table in effect is banded: valued as it ran (AS_RAN)


def parse_table_text(text: str) -> tuple[tuple[int | None, int], ...] | None:
    """``b<=8:k5 rest:k1`` (protocol.format_table) back to a table; None if it is not one."""
    rows: list[tuple[int | None, int]] = []
    for tok in text.split():
        m = _ROW.match(tok)
        if m is None:
            return None
        rows.append((int(m.group(1)) if m.group(1) else None, int(m.group(2))))
    return tuple(rows) if rows and rows[-1][0] is None else None


def _start_table(storage: Storage, server: str, until: float | None):
    events = [e for e in storage.events(server=server, kinds=["initial_table"])
              if until is None or e.ts < until]
    for e in reversed(events):
        table = parse_table_text(e.detail.partition(" ")[2])
        if table is not None:
            return table
    return None


def _model_values(sums, s: ServerReport, buckets: Buckets):  # noqa: ANN001
    """The model policy's estimate per (bucket, arm) from per-(b, k) sums (``aggregate``
    rows, or moments summed over time)."""
    try:
        policy = make_policy("model", arms=s.arms, buckets=buckets)
    except ValueError as exc:
        log.debug("%s: no model for the gain: %s", s.server, exc)
        return {}
    for a in sums:
        if a.k in s.arms and a.decode_steps > 0:
            policy.update(Observation(a.b, a.k, a.decode_steps, a.emitted_tokens,
                                      a.accepted_drafts, a.drafted_tokens, a.busy_s))
    return {(e.bucket, e.arm): ArmValue(e.estimate, e.std, False)
            for e in policy.snapshot().estimates
            if math.isfinite(e.estimate) and math.isfinite(e.std) and e.estimate > 0}


def _values(s: ServerReport, model, banded: bool = False) -> list[BucketValues]:  # noqa: ANN001
    """Per bucket, every arm's goodput: measured with an interval, else the model's; with
    ``banded``, also the bucket as it ran (:data:`AS_RAN`)."""
    values = []
    for bk in s.buckets:
        arms = {}
        for a in bk.arms:
            if a.ci_low is not None and a.ci_high is not None and math.isfinite(a.goodput):
                arms[a.arm] = ArmValue(a.goodput, (a.ci_high - a.ci_low) / (2 * Z95), True)
        for (i, k), v in model.items():
            if i == bk.index and k not in arms:
                arms[k] = v
        ran = as_ran((a.busy_s, arms[a.arm]) for a in bk.arms
                     if a.arm in arms and arms[a.arm].measured) if banded else None
        if ran is not None:
            arms[AS_RAN] = ran
        values.append(BucketValues(sum(a.busy_s for a in bk.arms),
                                   bk.high if bk.high is not None else bk.low, arms))
    return values


def _jackknife(s: ServerReport, moments, buckets: Buckets, table, bases, always,  # noqa: ANN001
               model, banded: bool = False) -> dict[str, list[float]]:
    """Per baseline, the gains recomputed without each contiguous stretch of time (the
    model refitted only where a used measurement drops out; see the module docstring)."""
    bins = sorted({m.bin for m in moments})
    if len(bins) < JACKKNIFE_GROUPS:
        return {}
    group = {b: i * JACKKNIFE_GROUPS // len(bins) for i, b in enumerate(bins)}
    # Every field is additive: one row per (stretch, b, k) folds the same sums 8 times over
    # far fewer rows than the report's time bins.
    stretches = _by_stretch(moments, group)
    out: dict[str, list[float]] = {name: [] for name in bases}
    for g in range(JACKKNIFE_GROUPS):
        kept = [m for m in stretches if m.bin != g]
        rs = summarize(server=s.server, arms=s.arms, moments=kept, buckets=buckets,
                       always=always)
        values = _values(rs, model, banded)
        if _lost_measurement(_values(s, model, banded), values, table, bases):
            values = _values(rs, _model_values(sum_by_arm(kept), rs, buckets), banded)
        for name, base in bases.items():
            rg = estimate_gain(name, values, table, base)
            if rg is not None and math.isfinite(rg.ratio):
                out[name].append(rg.ratio)
    return out


def _by_stretch(moments, group: dict[int, int]) -> list:  # noqa: ANN001
    """The moments summed per (stretch, b, k), the stretch as the bin."""
    merged: dict[tuple[int, int, int], object] = {}
    for m in moments:
        key = (group[m.bin], m.b, m.k)
        acc = merged.get(key)
        merged[key] = replace(m, bin=key[0]) if acc is None else replace(
            acc, rows=acc.rows + m.rows, decode_steps=acc.decode_steps + m.decode_steps,
            emitted_tokens=acc.emitted_tokens + m.emitted_tokens,
            accepted_drafts=acc.accepted_drafts + m.accepted_drafts,
            drafted_tokens=acc.drafted_tokens + m.drafted_tokens, busy_s=acc.busy_s + m.busy_s,
            emitted_sq=acc.emitted_sq + m.emitted_sq,
            emitted_busy=acc.emitted_busy + m.emitted_busy, busy_sq=acc.busy_sq + m.busy_sq,
            first_ts=min(acc.first_ts, m.first_ts), last_ts=max(acc.last_ts, m.last_ts))
    return list(merged.values())


def _lost_measurement(full: Sequence[BucketValues], part: Sequence[BucketValues], table,
                      bases) -> bool:  # noqa: ANN001
    """A goodput the gains use (the table's arm or a baseline's, per bucket) is measured on
    the whole window but not without the stretch."""
    for f, p in zip(full, part, strict=True):
        if f.weight <= 0:
            continue
        for arm in {table_arm(table, f.high), *(table_arm(b, f.high) for b in bases.values())}:
            was, now = f.arms.get(arm), p.arms.get(arm)
            if was is not None and was.measured and (now is None or not now.measured):
                return True
    return False


def _widen(g: Gain, replicates: Sequence[float]) -> Gain:
    """The jackknife's interval around ``g`` (the delta method's where that is wider)."""
    n = len(replicates)
    if n < 3:
        return g
    mean = sum(replicates) / n
    se = math.sqrt((n - 1) / n * sum((x - mean) ** 2 for x in replicates))
    half = max(t975(n - 1) * se, (g.high - g.low) / 2)
    return Gain(g.baseline, g.ratio, g.ratio - half, g.ratio + half, g.measured_share,
                g.covered_share)


def server_gains(
    storage: Storage,
    s: ServerReport,
    buckets: Buckets,
    *,
    since: float | None = None,
    until: float | None = None,
    moments: Sequence | None = None,
) -> tuple[ReportGain, ...]:
    """The gains for one server of a report (empty without data or a decided table).
    ``moments``: the report's time-binned sums of this server, for the jackknife's interval
    (without them: the delta method's, which is too narrow; see the module docstring)."""
    if not s.arms or not any(bk.arms for bk in s.buckets):
        return ()
    chosen = [bk.chosen for bk in s.buckets]
    banded = s.table is not None and s.table.bands is not None
    if banded:
        table: Sequence[tuple[int | None, int]] = ((None, AS_RAN),)
    elif s.table is not None:
        table = s.table.table
    elif all(k is not None for k in chosen):
        table = buckets.table(chosen)  # type: ignore[arg-type]
    else:
        return ()
    sums = (sum_by_arm(moments) if moments is not None
            else storage.aggregate(server=s.server, since=since, until=until))
    model = _model_values(sums, s, buckets)
    values = _values(s, model, banded)
    start = _start_table(storage, s.server, until)
    assumed = start is None
    if start is None:  # SGLang's startup step everywhere
        start = ((None, sglang_start_arm(s.arms)),)
    bases = {"start": start}
    if 0 in s.arms:
        bases["k0"] = ((None, 0),)
    always = s.always_arm if s.always_arm is not None else always_arm(s.arms)
    if always is not None:
        bases["always"] = ((None, always),)
    if banded:  # only a baseline whose goodput the bands did not select (see AS_RAN)
        bases = {name: base for name, base in bases.items() if name == "k0"}
    jack = (_jackknife(s, moments, buckets, table, bases, s.always_arm, model, banded)
            if moments is not None else {})
    out = []
    for name, base in bases.items():
        g = estimate_gain(name, values, table, base)
        if g is not None:
            g = _widen(g, jack.get(name, ()))
            out.append(ReportGain(g, tuple(base), assumed and name == "start", banded))
    return tuple(out)


def _fmt_table(table) -> str:  # noqa: ANN001
    return " ".join(f"b<={b}:k{k}" if b is not None else f"rest:k{k}" for b, k in table)


def gain_lines(gains: Sequence[ReportGain]) -> list[str]:
    """One line per baseline for the text and HTML reports."""
    out = []
    for rg in gains:
        g = rg.gain
        what = BASELINE_LABELS[g.baseline]
        if g.baseline == "start":
            what += f" ({_fmt_table(rg.base_table)}{', assumed' if rg.assumed else ''})"
        elif g.baseline == "always":
            what += f" (k{rg.base_table[0][1]})"
        cover = "" if g.covered_share >= 0.999 else f", {g.covered_share:.0%} of the time covered"
        src = {"measured": "measured", "model": "modelled"}.get(
            g.source, f"{int(g.measured_share * 100)}% measured, rest modelled")
        if rg.banded:
            src += ", as the banded tables ran"
        out.append(f"gain over {what}: {g.ratio:+.1%} [{g.low:+.1%}, {g.high:+.1%}] "
                   f"({src}{cover})")
    if any(rg.banded for rg in gains):
        out.extend(textwrap.wrap(BANDED_NOTE, 96, subsequent_indent="  "))
    return out


def gains_json(gains: Sequence[ReportGain]) -> list[dict]:
    def f(x: float) -> float | None:
        return round(x, 5) if math.isfinite(x) else None

    return [{"baseline": rg.gain.baseline, "baseline_table": [list(r) for r in rg.base_table],
             "assumed": rg.assumed, "ratio": f(rg.gain.ratio),
             "ci95": [f(rg.gain.low), f(rg.gain.high)], "source": rg.gain.source,
             "measured_share": f(rg.gain.measured_share),
             "covered_share": f(rg.gain.covered_share), "banded": rg.banded} for rg in gains]

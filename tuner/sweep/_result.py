"""A sweep's answer (:class:`SweepResult`) and its writers: text, PNG, JSON and a policy
file.
"""

from __future__ import annotations

import json
import math
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.protocol import Table, format_table, table_to_json
from tuner.sweep._config import DEFAULT_TOLERANCE, TABLE_ARM, Cell, _arm_label
from tuner.sweep._measure import CellEstimate, Measurement
from tuner.sweep._plan import Planner


@dataclass(frozen=True)
class SweepResult:
    """The sweep's answer: pooled tokens/s per cell, best arm per level, the learned table."""

    levels: tuple[int, ...]
    arms: tuple[int, ...]
    cells: dict[Cell, CellEstimate]
    best: dict[int, int]
    skipped: dict[Cell, str]
    table: Table | None
    crossover: str
    study_name: str
    notes: tuple[str, ...] = ()
    interrupted: bool = False
    trials_run: int = 0
    windows: int = 0
    elapsed_s: float = 0.0
    measured_s: float = 0.0
    pinnable: bool = True
    tolerance: float = DEFAULT_TOLERANCE
    server_arms: tuple[int, ...] = ()  # every arm the server built (the sweep may use fewer)

    @classmethod
    def build(cls, planner: Planner, ms: Sequence[Measurement], **kw: Any) -> SweepResult:
        est = planner.estimates(ms)
        best = {
            lv: a for lv in planner.levels if (a := planner.best_arm(est, lv)) is not None
        }
        skipped: dict[Cell, str] = {}
        for lv in planner.levels:
            for arm, why in planner.skipped(est, lv).items():
                skipped[(lv, arm)] = why
        notes = tuple(kw.pop("notes", ())) + _starved_levels(est, best)
        return cls(
            notes=notes,
            levels=planner.levels,
            arms=planner.arms,
            cells=est,
            best=best,
            skipped=skipped,
            table=planner.learned_table(est),
            crossover=crossover_text(best, planner.arms),
            windows=len(ms),
            measured_s=sum(m.window_s for m in ms),
            tolerance=planner.config.tolerance,
            **kw,
        )

    @property
    def grid_cells(self) -> int:
        return len(self.levels) * len(self.arms)

    def to_json(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return round(x, 6) if math.isfinite(x) else None

        cells = []
        for (lv, arm), e in sorted(self.cells.items()):
            m = e.last
            cells.append(
                {
                    "concurrency": lv,
                    "arm": "table" if arm == TABLE_ARM else arm,
                    "tok_s": num(e.mean),
                    "tok_s_se": num(e.se),
                    "windows": e.windows,
                    "window_s": num(e.window_s),
                    "pruned": e.pruned,
                    "best": self.best.get(lv) == arm,
                    "tpot_p50_ms": num(m.tpot_p50_ms),
                    "tpot_p99_ms": num(m.tpot_p99_ms),
                    "server": None
                    if e.server is None
                    else {
                        "goodput_tok_s": num(e.server.goodput),
                        "mean_batch": num(e.server.mean_batch),
                        "accept_rate": num(e.server.accept_rate),
                        **e.server.to_json(),
                    },
                }
            )
        return {
            "study": self.study_name,
            "levels": list(self.levels),
            "arms": list(self.arms),
            "pinnable": self.pinnable,
            "cells": cells,
            "skipped": [
                {"concurrency": lv, "arm": arm, "why": why}
                for (lv, arm), why in sorted(self.skipped.items())
            ],
            "best": {str(lv): arm for lv, arm in sorted(self.best.items())},
            "table": None if self.table is None else table_to_json(self.table),
            "crossover": self.crossover,
            "grid_cells": self.grid_cells,
            "windows": self.windows,
            "trials_run": self.trials_run,
            "measured_s": num(self.measured_s),
            "elapsed_s": num(self.elapsed_s),
            "interrupted": self.interrupted,
            "notes": list(self.notes),
        }


# A level whose server-side decode batch stays below this share of what it should be is
# flagged: the requests are not reaching the server as fast as the level asks.
_STARVED_BATCH_SHARE = 0.7


def _starved_levels(est: Mapping[Cell, CellEstimate], best: Mapping[int, int]) -> tuple[str, ...]:
    batches = {
        lv: w.mean_batch
        for lv, arm in best.items()
        if (w := est[(lv, arm)].server) is not None and math.isfinite(w.mean_batch)
    }
    if not batches:
        return ()
    cap = max(batches.values())  # the running-request cap, or the largest level
    out = []
    for lv, b in sorted(batches.items()):
        expected = min(lv, cap)
        if b < _STARVED_BATCH_SHARE * expected:
            out.append(
                f"concurrency {lv}: the server's decode batch averaged {b:.1f}, not "
                f"~{expected:.0f}: requests are not reaching it as fast as the level asks "
                "(a client too slow for the load, or a prefill-bound server); its numbers are "
                "not that level's"
            )
    return tuple(out)


def crossover_text(best: Mapping[int, int], arms: Sequence[int]) -> str:
    """Name where the best arm changes, and where speculation stops paying (arm 0 wins)."""
    if not best:
        return "nothing measured yet"
    levels = sorted(best)
    runs: list[tuple[int, int, int]] = []  # (first level, last level, arm)
    for lv in levels:
        if runs and runs[-1][2] == best[lv]:
            runs[-1] = (runs[-1][0], lv, best[lv])
        else:
            runs.append((lv, lv, best[lv]))
    parts = [
        f"k={arm} at {a}" if a == b else f"k={arm} at {a}-{b}" for a, b, arm in runs
    ]
    text = "best arm: " + ", ".join(parts)
    if 0 in arms:
        off = [lv for lv in levels if best[lv] == 0]
        if not off:
            text += "; speculation pays at every level measured"
        elif all(best[lv] == 0 for lv in levels if lv >= off[0]):
            text += (
                "; speculation stops paying at concurrency "
                f"{off[0]}" + (" (at every level measured)" if off[0] == levels[0] else "")
            )
        else:
            text += f"; no drafting wins at {', '.join(map(str, off))} (not monotone: re-measure)"
    return text


def _fmt(x: float, spec: str) -> str:
    return format(x, spec) if math.isfinite(x) else ""


def render_text(result: SweepResult, *, header: str | None = None) -> str:
    """The table people draw by hand: tokens/s per level for each arm and the learned table.

    ``*`` marks the best arm, ``~`` an arm within ``tolerance`` of it, ``<`` a window the
    pruner cut short (clearly behind), ``-`` a skipped cell (ruled out by another level).
    """
    cols = [*result.arms] + ([TABLE_ARM] if any(a == TABLE_ARM for _, a in result.cells) else [])
    head = ["conc"] + [_arm_label(a) for a in cols] + [
        "best", "vs k=0", "TPOT p50/p99 ms", "server busy tok/s", "batch", "accept"
    ]
    rows = []
    for lv in result.levels:
        best = result.best.get(lv)
        best_e = result.cells.get((lv, best)) if best is not None else None
        row = [str(lv)]
        for arm in cols:
            e = result.cells.get((lv, arm))
            if e is None:
                row.append("-" if (lv, arm) in result.skipped else "")
                continue
            mark = ""
            if arm == best:
                mark = "*"
            elif e.pruned:
                mark = "<"
            elif (
                best_e is not None and arm >= 0 and e.mean >= best_e.mean * (1 - result.tolerance)
            ):
                mark = "~"
            row.append(f"{e.mean:,.1f}{mark}")
        zero = result.cells.get((lv, 0))
        row.append("" if best is None else f"k={best}")
        row.append(
            f"{best_e.mean / zero.mean:.2f}x" if best_e is not None and zero is not None else ""
        )
        if best_e is not None:
            m, w = best_e.last, best_e.server
            row.append(f"{m.tpot_p50_ms:.1f} / {m.tpot_p99_ms:.1f}")
            row.append("" if w is None else _fmt(w.goodput, ",.0f"))
            row.append("" if w is None else _fmt(w.mean_batch, ".1f"))
            row.append("" if w is None else _fmt(w.accept_rate, ".2f"))
        else:
            row += ["", "", "", ""]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = []
    if header:
        lines.append(header)
    lines.append("output tokens/s by concurrency (* best, ~ within "
                 f"{result.tolerance:.0%}, < pruned early, - skipped); for the best arm: "
                 "client TPOT, and the server's goodput, batch and acceptance (its counters)")
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    lines.append("")
    lines.append(result.crossover)
    if result.table is not None:
        lines.append(f"learned table: {format_table(result.table)}")
        lines.extend(f"note: {n}" for n in table_notes(result))
    measured = sum(1 for (_, a) in result.cells if a >= 0)
    lines.append(
        f"measured {measured} of {result.grid_cells} (level, arm) cells in {result.windows} "
        f"windows ({result.measured_s:.0f} s measured, {result.elapsed_s:.0f} s elapsed)"
    )
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot_png(result: SweepResult, path: str | Path, *, title: str | None = None) -> Path:
    """Tokens/s against concurrency, one line per arm, the learned table dashed, best points
    ringed and the crossover marked; written with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    try:
        for arm in [*result.arms, TABLE_ARM]:
            pts = sorted((lv, e.mean) for (lv, a), e in result.cells.items() if a == arm)
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            style = {"linestyle": "--", "color": "black"} if arm == TABLE_ARM else {}
            ax.plot(xs, ys, marker="o", label=_arm_label(arm), **style)
        best_pts = [(lv, result.cells[(lv, a)].mean) for lv, a in result.best.items()]
        if best_pts:
            xs, ys = zip(*best_pts, strict=True)
            ax.scatter(xs, ys, s=160, facecolors="none", edgecolors="red", label="best arm")
        off = sorted(lv for lv, a in result.best.items() if a == 0)
        if off and off[0] != min(result.best):
            ax.axvline(off[0], color="grey", linestyle=":")
            ax.annotate(f"k=0 wins from {off[0]}", (off[0], ax.get_ylim()[1]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(result.levels), [str(lv) for lv in result.levels])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("output tokens/s")
        # Wrapped: a server address and study name do not fit one line of a 7-inch figure.
        ax.set_title(textwrap.fill(title or "dynspec-tuner sweep", 70), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def write_json(result: SweepResult, path: str | Path, **extra: Any) -> Path:
    """The result as JSON (plus ``extra`` top-level keys, e.g. the server)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**extra, **result.to_json()}, indent=2) + "\n", encoding="utf-8")
    return path


def write_policy_file(
    result: SweepResult, path: str | Path, *, server: str, now: float | None = None
) -> Path | None:
    """The learned table as the plugin's versioned policy file (``DYNSPEC_POLICY_FILE`` at
    server start, or ``export``), via :mod:`tuner.policyfile`; None when there is no table.

    Provenance: policy ``"sweep"``, the levels as bucket edges, and per (level, arm) the
    server's goodput (emitted tokens per busy second) where the plugin reported counters.
    """
    if result.table is None:
        return None
    from tuner import __version__, policyfile

    estimates = []
    for (level, arm), e in sorted(result.cells.items()):
        w = e.server
        if arm < 0 or w is None or not math.isfinite(w.goodput):
            continue
        rel = e.se_or_fallback() / e.mean if e.mean > 0 else 0.0
        estimates.append(policyfile.Estimate(
            result.levels.index(level), arm, w.goodput, w.goodput * rel, w.decode_steps
        ))
    doc = policyfile.PolicyFile(
        table=result.table,
        arms=result.server_arms or result.arms,
        policy_version=1,
        provenance=policyfile.Provenance(
            server=server,
            created_at=time.time() if now is None else now,
            tool_version=__version__,
            policy="sweep",
            buckets=result.levels,
            data_window=policyfile.DataWindow(observations=result.windows),
            estimates=tuple(estimates),
            notes=table_notes(result),
        ),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return policyfile.save(doc, path)


def table_notes(result: SweepResult) -> tuple[str, ...]:
    """What the policy file's table covers without a measurement: levels where no arm was
    measured (merged into the next measured level's row) and every batch above the largest
    measured level (the table stops there and keeps that level's arm)."""
    if result.table is None:
        return ()
    measured = sorted({lv for (lv, a) in result.cells if a >= 0})
    if not measured:
        return ()
    notes = []
    gaps = [lv for lv in result.levels if lv < measured[-1] and lv not in measured]
    if gaps:
        notes.append(f"no arm measured at concurrency {', '.join(map(str, gaps))}: those "
                     "batch sizes run the next measured level's arm")
    notes.append(f"nothing measured above concurrency {measured[-1]}: the table stops there "
                 f"and runs k{result.table[-1][1]} for every larger batch")
    return tuple(notes)

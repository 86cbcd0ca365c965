"""The PNG plots of one server (matplotlib, Agg backend)."""

from __future__ import annotations

import io
import math

from tuner.report._aggregate import _table_arm
from tuner.report._model import ServerReport
from tuner.report._text import _iso


# --- plots --------------------------------------------------------------------------------------

PLOT_NAMES = ("goodput-vs-batch", "chosen-arm-over-time", "goodput-over-time")


def make_plots(s: ServerReport) -> dict[str, bytes]:
    """The three PNG plots of one server (matplotlib, Agg backend, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    def png(fig: Figure) -> bytes:
        FigureCanvasAgg(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return buf.getvalue()

    arms = sorted({p.k for p in s.curve} | set(s.arms))
    colors = {k: f"C{i % 10}" for i, k in enumerate(arms)}
    out: dict[str, bytes] = {}

    # 1. goodput vs batch size per arm, learned decisions and crossover marked.
    # Fixed margins instead of a layout engine: constrained layout draws every figure twice.
    fig = Figure(figsize=(9, 5))
    fig.subplots_adjust(left=0.09, right=0.86, bottom=0.11, top=0.92)
    ax = fig.add_subplot()
    for k in arms:
        pts = [p for p in s.curve if p.k == k]
        if pts:
            ax.plot([p.b for p in pts], [p.goodput for p in pts], marker="o", ms=3,
                    color=colors[k], label=f"k={k}")
    if s.curve:
        ax.set_xscale("log", base=2)
        # Batch sizes as plain numbers (1 2 4 ... 64): the default 2^n labels are mathtext,
        # whose parser alone costs a report a third of a second.
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        top = max(p.goodput for p in s.curve)
        prev = None
        for bk in s.buckets:
            if bk.chosen is None:
                continue
            if prev is not None and bk.chosen != prev:
                ax.axvline(bk.low - 0.5, color="0.6", lw=0.8, ls=":")
            prev = bk.chosen
            hi = bk.high if bk.high is not None else max(p.b for p in s.curve)
            if bk.arms and hi >= bk.low:
                mid = math.sqrt(bk.low * max(hi, bk.low))
                ax.text(mid, top * 1.02, f"k{bk.chosen}", ha="center", va="bottom", fontsize=7,
                        color=colors.get(bk.chosen, "k"))
        if s.crossover_b is not None:
            ax.axvline(s.crossover_b - 0.5, color="crimson", lw=1.5)
            ax.axvspan(s.crossover_b - 0.5, max(p.b for p in s.curve) * 1.5,
                       color="crimson", alpha=0.06)
            ax.text(s.crossover_b, top * 0.05, f" speculation off from b={s.crossover_b}",
                    color="crimson", fontsize=8)
        ax.set_ylim(0, top * 1.12)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    else:
        ax.text(0.5, 0.5, "no observations", ha="center", transform=ax.transAxes)
    ax.set_xlabel("batch size (running requests)")
    ax.set_ylabel("goodput (emitted tokens / busy s)")
    ax.set_title(f"{s.server}: goodput vs batch size per arm (labels: learned arm per bucket)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    out["goodput-vs-batch"] = png(fig)

    # 2. chosen arm per bucket over time, from the recorded tables.
    fig = Figure(figsize=(9, 4))
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.13, top=0.91)
    ax = fig.add_subplot()
    applied = [v for v in s.versions if v.outcome in ("applied", "dry_run")]
    if s.table is not None and (not applied or s.table.ts < applied[0].ts):
        applied.insert(0, s.table)
    if applied:
        import numpy as np
        from matplotlib.colors import BoundaryNorm, ListedColormap

        end = max(v.ts for v in applied)
        if s.data_span is not None:
            end = max(end, s.data_span[1])
        times = [v.ts for v in applied] + [end if end > applied[-1].ts else applied[-1].ts + 1]
        nb = len(s.buckets)
        # One column per run of versions that choose the same arms (thousands of versions
        # repeat a few tables): the same picture from far fewer cells.
        columns: dict[tuple, list[int]] = {}
        runs: list[list[int]] = []
        edges: list[float] = []
        for v, t in zip(applied, times, strict=False):
            col = columns.get(v.table)
            if col is None:
                col = columns[v.table] = [
                    _table_arm(v.table, bk.high if bk.high is not None else bk.low)
                    for bk in s.buckets
                ]
            if not runs or col != runs[-1]:
                runs.append(col)
                edges.append(t)
        times = edges + [times[-1]]
        grid = np.array(runs, dtype=float).T
        cmap = ListedColormap([colors.get(k, "0.5") for k in arms])
        norm = BoundaryNorm([a - 0.5 for a in arms] + [arms[-1] + 0.5], cmap.N)
        t0 = times[0]
        x = [(t - t0) / 60.0 for t in times]
        mesh = ax.pcolormesh(x, np.arange(nb + 1), grid, cmap=cmap, norm=norm, shading="flat")
        cbar = fig.colorbar(mesh, ax=ax, ticks=arms)
        cbar.set_label("arm k")
        ax.set_yticks(np.arange(nb) + 0.5)
        ax.set_yticklabels([bk.label for bk in s.buckets], fontsize=7)
        ax.set_xlabel(f"minutes since {_iso(t0)}")
        ax.set_ylabel("batch-size bucket")
    else:
        ax.text(0.5, 0.5, "no policy versions recorded", ha="center", transform=ax.transAxes)
    ax.set_title(f"{s.server}: chosen arm per bucket over time", fontsize=10)
    out["chosen-arm-over-time"] = png(fig)

    # 3. goodput over time (all arms together, and per arm).
    fig = Figure(figsize=(9, 4))
    fig.subplots_adjust(left=0.09, right=0.86, bottom=0.13, top=0.91)
    ax = fig.add_subplot()
    if s.timeline:
        t0 = min(p.t for p in s.timeline)
        half = (s.bin_s or 0.0) / 2
        allp = [p for p in s.timeline if p.k is None]
        ax.plot([(p.t + half - t0) / 60 for p in allp], [p.goodput for p in allp], color="k",
                lw=2, label="all arms")
        for k in arms:
            pts = [p for p in s.timeline if p.k == k]
            if pts:
                # Markers only: an arm runs in some bins and not others; a line would
                # draw goodput where the arm never ran.
                ax.plot([(p.t + half - t0) / 60 for p in pts], [p.goodput for p in pts],
                        color=colors[k], ls="none", marker="o", ms=3, label=f"k={k}")
        ax.set_xlabel(f"minutes since {_iso(t0)}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.set_ylim(bottom=0)
    else:
        ax.text(0.5, 0.5, "no observations", ha="center", transform=ax.transAxes)
    ax.set_ylabel("goodput (tokens / busy s)")
    ax.set_title(f"{s.server}: goodput over time", fontsize=10)
    ax.grid(alpha=0.3)
    out["goodput-over-time"] = png(fig)
    return out

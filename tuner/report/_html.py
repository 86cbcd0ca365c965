"""The self-contained HTML report, plots embedded."""

from __future__ import annotations

import base64
import html

from tuner.report._model import Report
from tuner.report._plots import PLOT_NAMES
from tuner.report._text import _iso, _num, _pct, _version_str


# --- HTML ---------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{padding:2px 8px;text-align:right}
th{background:#eee}td.l,th.l{text-align:left}tr.bucket td{border-top:1px solid #bbb}
.chosen{font-weight:bold}.muted{color:#777}img{max-width:100%;display:block;margin:1em 0}
"""


def render_html(report: Report, plots: dict[str, dict[str, bytes]] | None = None) -> str:
    """A self-contained HTML page; ``plots`` (server -> name -> PNG) are embedded as base64."""
    e = html.escape
    plots = plots or {}
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>dynspec-tuner report {e(_iso(report.generated_at))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>dynspec-tuner report</h1>",
        f"<p class='muted'>generated {e(_iso(report.generated_at))} &middot; database "
        f"{e(report.database)} &middot; window {e(_iso(report.since))} .. "
        f"{e(_iso(report.until) if report.until else 'now')}</p>",
    ]
    if not report.servers:
        parts.append("<p>No servers recorded in this database.</p>")
    for s in report.servers:
        model = f" <small>{e(s.model)}</small>" if s.model else ""
        parts.append(f"<h2>{e(s.server)}{model}</h2>")
        parts.append(
            f"<p>arms {e(', '.join(map(str, s.arms)))} &middot; always-speculate arm "
            f"{'k' + str(s.always_arm) if s.always_arm is not None else '-'} &middot; "
            f"{s.observations:,} observations, {s.decode_steps:,} decode steps</p>"
        )
        if s.table is not None:
            parts.append(
                f"<p>Table in effect: <b>v{s.table.version}</b> ({e(s.table.policy)}, "
                f"{e(s.table.outcome)} {e(_iso(s.table.ts))}): "
                f"<code>{e(_version_str(s.table))}</code></p>"
            )
        if s.metrics_only:
            parts.append("<p>Metrics-only mode (no dynspec plugin): coarse per-interval "
                         "observations of the arm the server ran; nothing was pushed.</p>")
        if s.crossover_b is not None:
            parts.append(
                f"<p><b>Speculation stops paying from batch size {s.crossover_b}.</b></p>"
            )
        c = s.counts
        parts.append(
            f"<p>pushes {c['pushes']} &middot; rejected updates {c['rejected_updates']} "
            f"&middot; outages {c['outages']} &middot; restarts {c['restarts']}</p>"
        )
        from tuner.report_gain import gain_lines

        parts.extend(f"<p>{html.escape(line)}</p>" for line in gain_lines(s.gains))
        if s.switchback is not None:
            from tuner.report_switchback import switchback_lines

            parts.append(f"<p>{html.escape(' '.join(switchback_lines(s.switchback)))}</p>")
        for name in PLOT_NAMES:
            data = plots.get(s.server, {}).get(name)
            if data is not None:
                b64 = base64.b64encode(data).decode()
                parts.append(f"<img alt='{e(name)}' src='data:image/png;base64,{b64}'>")
        always = f"k{s.always_arm}" if s.always_arm is not None else "always"
        parts.append(
            "<table><tr><th class='l'>bucket</th><th>chosen</th><th>best</th><th>b_ref</th>"
            f"<th>vs k0</th><th>vs {e(always)}</th><th class='l'>arm</th><th>goodput tok/s</th>"
            "<th>95% interval</th><th>steps</th><th>intervals</th><th>acc/step</th>"
            "<th>acc rate</th></tr>"
        )
        for bk in s.buckets:
            if not bk.arms:
                continue
            for j, a in enumerate(bk.arms):
                cls = " class='chosen'" if a.arm == bk.chosen else ""
                lead = (
                    f"<td class='l'>{e(bk.label)}</td><td>k{bk.chosen}</td><td>k{bk.best}</td>"
                    f"<td>{_num(bk.b_ref, 0).strip()}</td><td>{_pct(bk.gain_vs_off)}</td>"
                    f"<td>{_pct(bk.gain_vs_always)}</td>"
                    if j == 0
                    else "<td></td>" * 6
                )
                ci = (
                    f"{_num(a.ci_low, 0).strip()} – {_num(a.ci_high, 0).strip()}"
                    if a.ci_low is not None
                    else "-"
                )
                rate = "-" if a.acceptance_rate is None else f"{a.acceptance_rate * 100:.1f}%"
                parts.append(
                    f"<tr{' class=bucket' if j == 0 else ''}>{lead}<td class='l'>"
                    f"<span{cls}>k{a.arm}</span></td><td>{_num(a.goodput, 0).strip()}</td>"
                    f"<td>{ci}</td><td>{a.decode_steps:,}</td><td>{a.intervals:,}</td>"
                    f"<td>{_num(a.accepted_per_step, 0, 2).strip()}</td><td>{rate}</td></tr>"
                )
        parts.append("</table>")
        if s.versions:
            parts.append("<h3>Policy versions</h3><table><tr><th>version</th><th class='l'>"
                         "time</th><th class='l'>outcome</th><th class='l'>table</th>"
                         "<th class='l'>policy: reason</th></tr>")
            for v in s.versions:
                parts.append(
                    f"<tr><td>v{v.version}</td><td class='l'>{e(_iso(v.ts))}</td>"
                    f"<td class='l'>{e(v.outcome)}</td><td class='l'><code>"
                    f"{e(_version_str(v))}</code></td><td class='l'>{e(v.policy)}: "
                    f"{e(v.reason)}</td></tr>"
                )
            parts.append("</table>")
        if s.events:
            parts.append("<h3>Events</h3><table><tr><th class='l'>time</th><th class='l'>kind"
                         "</th><th class='l'>detail</th></tr>")
            for ev in s.events:
                parts.append(
                    f"<tr><td class='l'>{e(_iso(ev.ts))}</td><td class='l'>{e(ev.kind)}</td>"
                    f"<td class='l'>{e(ev.detail)}</td></tr>"
                )
            parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)

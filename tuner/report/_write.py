"""Rendering a report in a format and writing it (and its plots) to files."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from tuner._atomic import write_atomic
from tuner.errors import ConfigError
from tuner.report._html import render_html
from tuner.report._json import render_json
from tuner.report._model import FORMATS, Report, ServerReport
from tuner.report._plots import make_plots
from tuner.report._text import render_text


# --- writing ------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "server"


def write_report(
    report: Report, *, fmt: str, out: Path | None, plots: bool = True
) -> tuple[str | None, list[Path]]:
    """Render ``report``; write it (and the plots) when ``out`` is given.

    HTML embeds the plots. Text and JSON written to ``out`` get the plots as PNG files
    beside it (``<out stem>-<server>-<plot>.png``), listed in the report. Without ``out``
    nothing is written and the rendered text is returned for the caller to print.

    Returns:
        ``(rendered text or None when written, files written)``.

    Raises:
        ConfigError: unknown format, or ``out`` cannot be written (named).
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if out is not None:
        from tuner.outfiles import check_out

        out = check_out(out)
    written: list[Path] = []
    pngs: dict[str, dict[str, bytes]] = {}
    if plots and (fmt == "html" or out is not None):
        pngs = {s.server: make_plots(s) for s in report.servers}
    if fmt != "html" and out is not None and pngs:
        servers = []
        for s in report.servers:
            files = {}
            for name, data in pngs[s.server].items():
                path = out.with_name(f"{out.stem}-{_slug(s.server)}-{name}.png")
                _write_bytes(path, data)
                written.append(path)
                files[name] = str(path)
            servers.append(_with_plots(s, files))
        report = Report(report.generated_at, report.database, report.since, report.until,
                        report.bucket_edges, tuple(servers))
    if fmt == "text":
        body = render_text(report)
    elif fmt == "json":
        body = render_json(report)
    else:
        body = render_html(report, pngs)
    if out is None:
        return body, written
    _write_bytes(out, body.encode())
    written.insert(0, out)
    return None, written


def _with_plots(s: ServerReport, files: dict[str, str]) -> ServerReport:
    return replace(s, plots=files)


def _write_bytes(path: Path, data: bytes) -> None:
    try:
        write_atomic(path, data, parents=False)  # tuner.outfiles: folders are never created
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write: {exc.strerror or exc}") from exc

"""What the tuner learned, for people: aggregation into a report model, and its renderers.

:func:`build_report` reads storage (every sum is computed by the database, one grouped query
per report: :meth:`storage.Storage.moments`), :func:`summarize` is the pure fold of those
sums into a :class:`Report`, and the renderers turn a report into text (fits 100 columns),
JSON (schema ``dynspec-report/1``, documented in docs/commands.md) or a self-contained HTML page
with the plots embedded. :func:`make_plots` draws the PNGs with matplotlib's Agg backend.

Estimates. Each stored observation is one sampling interval ``i`` of one ``(b, k)`` with
emitted tokens ``e_i`` and busy seconds ``t_i``. Per bucket and arm the report estimates the
per-request rate ``r = Σe / Σ(b·t)`` (a ratio estimator with the interval as the sampling unit)
and shows ``goodput = r · b_ref``, the goodput at the bucket's reference batch size ``b_ref``
(the step-weighted mean batch size of everything seen in the bucket). Arms observed at somewhat
different batch sizes inside one bucket therefore compare fairly, and in a bucket holding a
single batch size ``goodput`` is exactly ``Σe / Σt``. The 95 % interval is the delta-method
interval of the ratio, ``r ± t₀.₉₇₅,ₙ₋₁ · sqrt(n Σ(e − r·b·t)² / ((n − 1) (Σ b·t)²))``.

The package: :mod:`._model` (the records), :mod:`._aggregate` (inputs and aggregation),
:mod:`._text`, :mod:`._json`, :mod:`._html` and :mod:`._plots` (renderers, pure functions of
a :class:`Report`) and :mod:`._write` (formats and files).
"""

from __future__ import annotations

from tuner.report import _model
from tuner.report._aggregate import always_arm, build_report, open_history, parse_since, summarize
from tuner.report._html import render_html
from tuner.report._json import render_json, report_to_json
from tuner.report._model import *  # noqa: F403  (the report's records, listed in _model)
from tuner.report._model import _t975  # noqa: F401  (the t quantiles are tested on their own)
from tuner.report._plots import make_plots
from tuner.report._text import render_text
from tuner.report._write import write_report

__all__ = [
    "always_arm",
    "build_report",
    "make_plots",
    "open_history",
    "parse_since",
    "render_html",
    "render_json",
    "render_text",
    "report_to_json",
    "summarize",
    "write_report",
]
__all__ += _model.__all__

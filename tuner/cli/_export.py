"""Write one server's learned table. Where it comes from (--source): 'policy' = the last table
recorded for the server in the history (the last one it applied; the last dry-run decision if
nothing was applied); 'data' = re-derived now from the stored observations, the best arm per
bucket (a bucket without data takes its nearest neighbour's); 'auto' (default) = 'policy' when
a table was recorded, else 'data'. Formats: 'sglang-adaptive' = JSON for SGLang's
--speculative-adaptive --speculative-adaptive-config FILE with one candidate step per
batch-size slot (slot key = the row's lower bound, applied after CUDA-graph padding), so SGLang
follows the table; SGLang pre-builds every arm in the file (listed in it under "_dynspec").
'dynspec' = the plugin's versioned policy file (table + provenance), loaded at server start.
"""

from __future__ import annotations

import argparse

from tuner.cli._common import _buckets_arg, _command, _csv_ints, _history_option, _history_url
from tuner.cli._common import console, err_console


def _add_export(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner.export import EXPORT_FORMATS, SOURCES

    p = _command(
        sub, "export", _cmd_export, __doc__,
        help="write the learned table for stock SGLang (sglang-adaptive) or the plugin (dynspec)",
    )
    _history_option(p)
    p.add_argument("--server", metavar="HOST:PORT",
                   help="the server (may be omitted when the history holds only one)")
    p.add_argument("--format", choices=EXPORT_FORMATS, required=True)
    p.add_argument("--out", type=Path, metavar="FILE", required=True)
    p.add_argument("--source", choices=SOURCES, default="auto",
                   help="where the table comes from (see above; default auto)")
    p.add_argument("--since", metavar="WHEN",
                   help="with --source data: only observations of the last 1h/2d/... or since "
                   "an ISO time")
    p.add_argument("--buckets", type=_csv_ints, metavar="EDGES",
                   help="with --source data: bucket upper bounds (default: the daemon's)")


def _cmd_export(args: argparse.Namespace) -> int:
    import time

    from tuner.export import export
    from tuner.protocol import format_band_table, format_table
    from tuner.report import open_history, parse_since

    now = time.time()
    since = parse_since(args.since, now=now) if args.since else None
    with open_history(_history_url(args.db)) as storage:
        result = export(storage, fmt=args.format, out=args.out, server=args.server,
                        source=args.source, since=since, buckets=_buckets_arg(args.buckets),
                        now=now)
    lt = result.learned
    origin = f"policy v{lt.version} ({lt.policy})" if lt.source == "policy" else (
        "the best arm per bucket in the stored observations")
    shown = format_table(lt.table)
    if lt.bands is not None and args.format == "dynspec":  # k<unknown>/<band 1..4>
        shown = format_band_table(lt.bands)
    console.print(f"wrote {result.path}: {lt.server} {shown} from {origin}",
                  markup=False, soft_wrap=True)
    if args.format == "sglang-adaptive":
        arms = sorted({k for _, k in lt.table})
        console.print(
            f"SGLang pre-builds arms {arms}: start it with --speculative-adaptive "
            f"--speculative-adaptive-config {result.path}",
            markup=False,
            soft_wrap=True,
        )
    for warning in result.warnings:
        err_console.print(f"warning: {warning}", markup=False, soft_wrap=True)
    return 0

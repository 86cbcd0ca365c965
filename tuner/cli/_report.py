"""Per server and batch-size bucket: each arm's goodput with a 95% interval and its sample
counts, the chosen arm (from the table in effect; the best arm by the data when no table was
recorded) and its gain over k=0 and over the always-speculate arm, acceptance per arm; the
policy's version history with reasons; outages, restarts and rejected updates. Plots: goodput
vs batch size per arm with the crossover marked, the chosen arm per bucket over time, goodput
over time (embedded in HTML; PNG files beside --out for text and JSON).
"""

from __future__ import annotations

import argparse

from tuner.cli._common import _buckets_arg, _command, _csv_ints, _history_option, _history_url
from tuner.cli._common import console, err_console


def _add_report(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner.report import FORMATS

    p = _command(
        sub, "report", _cmd_report, __doc__,
        help="what was learned: goodput per bucket and arm with 95%% intervals, decisions, history",
    )
    _history_option(p)
    p.add_argument("--server", metavar="HOST:PORT", help="one server (default: all)")
    p.add_argument("--since", metavar="WHEN",
                   help="only the last 90s/15m/1h/2d/1w, or since an ISO time (default: all)")
    p.add_argument("--format", choices=FORMATS, default="text",
                   help="text (fits 100 columns), json (schema dynspec-report/1) or html")
    p.add_argument("--out", type=Path, metavar="FILE", help="write here instead of stdout")
    p.add_argument("--buckets", type=_csv_ints, metavar="EDGES",
                   help="bucket upper bounds to report by (default: the daemon's default)")
    p.add_argument("--always-arm", type=int, metavar="K",
                   help="the always-speculate arm to compare with (default: the arm SGLang "
                   "starts with for the server's arm set, union[len/2])")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")


def _cmd_report(args: argparse.Namespace) -> int:
    import time

    from tuner.report import build_report, open_history, parse_since, write_report

    now = time.time()
    since = parse_since(args.since, now=now) if args.since else None
    buckets = _buckets_arg(args.buckets)
    with open_history(_history_url(args.db)) as storage:
        report = build_report(storage, server=args.server, since=since, buckets=buckets,
                              always=args.always_arm, now=now)
    body, written = write_report(report, fmt=args.format, out=args.out,
                                 plots=not args.no_plots)
    if body is not None:
        console.print(body, markup=False, emoji=False, highlight=False, soft_wrap=True, end="")
    for path in written:
        err_console.print(f"wrote {path}", markup=False)
    return 0

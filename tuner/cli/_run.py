"""Read each server's per-(batch size, arm) telemetry every interval, learn which draft depth
gives the most goodput per batch-size bucket, push a table every decision period, and record
everything in the history database. On SIGTERM or Ctrl-C each server is left on its greedy
table. The tuning flags (not --metrics-* or the simulation ones) also read DYNSPEC_*
environment variables (a flag wins).
"""

from __future__ import annotations

import argparse
import logging

from tuner.cli._common import _command, _csv_ints, console
from tuner.errors import ConfigError


def _add_run(sub: argparse._SubParsersAction) -> None:
    from policies import POLICIES
    from tuner import config as c

    p = _command(
        sub, "run", _cmd_run, __doc__,
        help="tune SGLang servers: learn per batch-size bucket and push tables (or --simulate)",
    )
    p.add_argument(
        "--server", action="append", dest="servers", metavar="HOST:PORT",
        help=f"an SGLang server; repeat for several (default {c.DEFAULT_SERVER}; "
        "DYNSPEC_SERVERS=a:1,b:2)",
    )
    p.add_argument(
        "--servers-file", metavar="F",
        help="a file listing servers, one HOST:PORT a line (# comments); adds to --server "
        "(DYNSPEC_SERVERS_FILE). Each server is read on its own with its own timeout",
    )
    p.add_argument(
        "--pool", metavar="NAME",
        help="identical replicas (same model, arms, hardware) share NAME: each learns from "
        "all their observations in the database, live and at warm start; every daemon still "
        "pushes only to its own servers (DYNSPEC_POOL)",
    )
    p.add_argument(
        "--db", dest="db_url", metavar="URL",
        help=f"history database, an SQLAlchemy URL (default {c.DEFAULT_DB_URL}; with "
        f"--simulate {c.DEFAULT_SIM_DB_URL}; DYNSPEC_DB)",
    )
    p.add_argument(
        "--policy", choices=sorted(POLICIES), metavar="NAME",
        help=f"one of {', '.join(sorted(POLICIES))} (default {c.DEFAULT_POLICY}; DYNSPEC_POLICY)",
    )
    p.add_argument("--interval", dest="interval_s", type=float, metavar="S",
                   help=f"seconds between readings (default {c.DEFAULT_INTERVAL_S:g})")
    p.add_argument("--decision-period", dest="decision_period_s", type=float, metavar="S",
                   help=f"seconds between tables (default {c.DEFAULT_DECISION_PERIOD_S:g})")
    p.add_argument("--buckets", type=_csv_ints, metavar="EDGES",
                   help="upper bounds of the batch-size buckets, e.g. 1,2,4,8,16,32,64 "
                   "(default: aligned to SGLang's CUDA-graph batch sizes)")
    p.add_argument("--api-key-file", metavar="F",
                   help="file holding SGLang's admin API key (or set DYNSPEC_API_KEY); the key "
                   "is never taken on the command line")
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="learn and record, never push a table")
    p.add_argument("--duration", dest="duration_s", type=float, metavar="S",
                   help="stop after S seconds (simulated seconds with --simulate; default: "
                   f"until stopped, {c.DEFAULT_SIM_DURATION_S:g} with --simulate)")
    p.add_argument("--timeout", dest="timeout_s", type=float, metavar="S",
                   help=f"per HTTP request (default {c.DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--seed", type=int, help="seeds the policy (and the simulator)")
    # History roll-up (storage.Storage.rollup); strings: config parses durations and "off".
    p.add_argument("--rollup-after", dest="rollup_after_s", metavar="AGE",
                   help="roll observations older than AGE up into --rollup-bin bins, about "
                   "hourly (default 7d; 12h, 3600 or off; DYNSPEC_ROLLUP_AFTER)")
    p.add_argument("--rollup-bin", dest="rollup_bin_s", metavar="BIN",
                   help="time bin of rolled-up observations (default 1h; DYNSPEC_ROLLUP_BIN)")
    p.add_argument("--holdout", metavar="SHARE",
                   help="switchback experiment: in randomised windows the server runs its "
                   "starting table for SHARE of the time (e.g. 5%%), each paired with an "
                   "adjacent tuned window, so report and /metrics give the gain *measured*, "
                   "with a 95%% interval, and what it cost (DYNSPEC_HOLDOUT)")
    p.add_argument("--holdout-window", dest="holdout_window_s", type=float, metavar="S",
                   help=f"length of a baseline window and of its tuned pair (default "
                   f"{c.DEFAULT_HOLDOUT_WINDOW_S:g}; DYNSPEC_HOLDOUT_WINDOW)")
    p.add_argument("--metrics-port", type=int, metavar="N",
                   help="serve the tuner's own Prometheus metrics on this port")
    p.add_argument("--metrics-addr", default=None, metavar="ADDR",
                   help="address for --metrics-port (default 127.0.0.1)")
    g = p.add_argument_group("simulation (no GPU, no server needed)")
    g.add_argument("--simulate", action="store_true",
                   help="start the built-in simulator on a free loopback port and tune it")
    g.add_argument("--profile", metavar="NAME|FILE",
                   help=f"cost profile (default {c.DEFAULT_SIM_PROFILE})")
    g.add_argument("--workload", metavar="W", help=f"default {c.DEFAULT_SIM_WORKLOAD}")
    g.add_argument("--load", metavar="SCHEDULE",
                   help=f"built-in traffic (default {c.DEFAULT_SIM_LOAD}: a concurrency sweep)")
    g.add_argument("--speed", type=float, metavar="X",
                   help=f"simulated seconds per wall second (default {c.DEFAULT_SIM_SPEED:g})")


def _cmd_run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tuner.config import DEFAULT_SIM_DB_URL, SimulateConfig, TunerConfig
    from tuner.status import StatusView

    sim_only = {"--profile": args.profile, "--workload": args.workload, "--load": args.load,
                "--speed": args.speed}
    if not args.simulate:
        given = [flag for flag, v in sim_only.items() if v is not None]
        if given:
            raise ConfigError(f"{given[0]} needs --simulate")
    elif args.servers or args.servers_file:
        raise ConfigError("--simulate starts its own server; drop --server")
    flags = {
        "servers": tuple(args.servers or ()),
        "servers_file": args.servers_file,
        "pool": args.pool,
        "db_url": args.db_url,
        "policy": args.policy,
        "interval_s": args.interval_s,
        "decision_period_s": args.decision_period_s,
        "buckets": args.buckets,
        "api_key_file": args.api_key_file,
        "dry_run": args.dry_run,
        "duration_s": None if args.simulate else args.duration_s,
        "timeout_s": args.timeout_s,
        "seed": args.seed,
        "rollup_after_s": args.rollup_after_s,  # history roll-up
        "rollup_bin_s": args.rollup_bin_s,
        "holdout": args.holdout,
        "holdout_window_s": args.holdout_window_s,
    }
    defaults = {"db_url": DEFAULT_SIM_DB_URL} if args.simulate else None
    config = TunerConfig.from_sources(flags, defaults=defaults)
    simcfg = None
    if args.simulate:
        given = {k: v for k, v in {"profile": args.profile, "workload": args.workload,
                                   "load": args.load, "speed": args.speed,
                                   "duration_s": args.duration_s, "seed": args.seed}.items()
                 if v is not None}
        simcfg = SimulateConfig(**given)

    live = console.is_terminal
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    if live and args.log_format == "text":  # log lines print above the live view
        from rich.logging import RichHandler

        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        root.addHandler(RichHandler(console=console, show_path=False, markup=False))

    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():  # a second Ctrl-C: stop waiting for a clean exit
            raise KeyboardInterrupt
        logging.getLogger("tuner.cli").info(
            "%s: stopping; leaving each server on its greedy table, flushing the history",
            signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    metrics = metrics_server = None
    rc = 0
    try:
        if args.metrics_port is not None:
            from tuner.tuner_metrics import DEFAULT_METRICS_ADDR, TunerMetrics

            metrics = TunerMetrics()
            metrics_server = metrics.serve(port=args.metrics_port,
                                           addr=args.metrics_addr or DEFAULT_METRICS_ADDR)
        elif args.metrics_addr is not None:
            raise ConfigError("--metrics-addr needs --metrics-port")
        with StatusView(console, live=live) as view:
            if simcfg is not None:
                from tuner.simulate import run_simulation

                summary = run_simulation(config, simcfg, stop_event=stop, on_tick=view.update,
                                         metrics=metrics)
            else:
                from storage import Storage
                from tuner.daemon import Daemon

                with Storage(config.db_url) as storage:
                    daemon = Daemon(config, storage=storage, stop_event=stop,
                                    on_tick=view.update, metrics=metrics)
                    rc = daemon.run()
                summary = None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if metrics_server is not None:
            metrics_server.close()
    if summary is not None:
        _print_simulation(summary)
    else:
        from storage import redact_url
        from tuner.status import exit_lines

        lines, never = exit_lines(view.last, daemon.unclean)
        for line in lines:
            console.print(line, markup=False, soft_wrap=True)
        console.print(f"history: {redact_url(config.db_url)}", markup=False)
        if never:  # nothing was learned from a server that never answered: not a success
            rc = max(rc, 1)
    return rc


def _fmt_table(table: object) -> str:
    from tuner.daemon._tables import show_table

    return show_table(table) if table else "?"  # type: ignore[arg-type]


def _print_simulation(s: object) -> None:
    from rich.table import Table as RichTable

    from tuner.simulate import DEFAULT_MIN_VERDICT_STEPS, DEFAULT_TOLERANCE

    t = RichTable(title=f"learned vs oracle per bucket ({s.profile}, {s.workload})",
                  header_style="bold")
    for col in ("bucket", "decode steps", "learned k", "oracle k", "goodput vs oracle", ""):
        t.add_column(col, justify="right")
    for v in s.buckets:
        judged = v.steps >= DEFAULT_MIN_VERDICT_STEPS
        mark = ("ok" if v.ok() else "MISS") if judged else "few steps"
        t.add_row(v.label, f"{v.steps:,}", v.learned, str(v.oracle_k),
                  f"{100 * v.ratio:.1f}%", mark)
    console.print(t)
    judged = s.judged()
    good = sum(v.ok() for v in judged)
    pct = lambda x: f"{100 * x / s.oracle_goodput:.1f}%"  # noqa: E731
    console.print(
        f"simulated {s.simulated_s:.0f} s in {s.wall_s:.0f} s wall; {good}/{len(judged)} "
        f"buckets with >= {DEFAULT_MIN_VERDICT_STEPS} steps on the oracle arm or within "
        f"{100 * DEFAULT_TOLERANCE:g}% of it",
        markup=False,
    )
    console.print(
        f"expected goodput over this run's batch sizes: learned table "
        f"{s.learned_goodput:,.0f} tok/s ({pct(s.learned_goodput)} of the oracle's "
        f"{s.oracle_goodput:,.0f}); the server's starting table "
        f"({_fmt_table(s.start_table)}) {s.default_goodput:,.0f} "
        f"({pct(s.default_goodput)}); measured during the run, exploration included: "
        f"{s.measured_goodput:,.0f} tok/s",
        markup=False,
    )
    console.print(
        f"server left on v{s.final_version}: {_fmt_table(s.server_table)} ({s.pushes} pushes)",
        markup=False,
    )
    if s.switchback is not None:
        from tuner.report_switchback import switchback_lines

        first, second = switchback_lines(s.switchback)
        console.print(f"{first}; true gain (oracle) {s.switchback_truth:+.1%}\n{second}",
                      markup=False)
    console.print(f"history: {s.db_url} ({s.observations:,} observations)", markup=False)

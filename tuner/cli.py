"""``dynspec-tuner``: parse, build the config, call the library. The only module that prints.

Each subcommand is a pair ``_add_<name>(subparsers)`` / ``_cmd_<name>(args) -> int``, listed
in ``_COMMANDS``. Exit codes: 0 ok, 1 a runtime failure (DynspecError), 2 a usage or
configuration error (argparse, ConfigError), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from tuner import __version__
from tuner.errors import ConfigError, DynspecError

if TYPE_CHECKING:
    from rich.progress import Progress

    from tuner.sweep import SweepEvent

__all__ = ["main"]

console = Console(stderr=False, highlight=False)
err_console = Console(stderr=True, highlight=False)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exits 2."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        # "-1,3" is a (bad) value, not an option: let it reach the flag's own check.
        self._negative_number_matcher = re.compile(r"^-\d[\d,.]*$")

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


# --- subcommands ----------------------------------------------------------------------------
# (Each command's parser and handler stay together; the library does the work.)


_COMMANDS: list[tuple[str, Callable[[argparse._SubParsersAction], None]]] = []


def _command(add: Callable[[argparse._SubParsersAction], None]):
    _COMMANDS.append((add.__name__, add))
    return add


# --- run ------------------------------------------------------------------------------------


@_command
def _add_run(sub: argparse._SubParsersAction) -> None:
    from policies import POLICIES
    from tuner import config as c

    p = sub.add_parser(
        "run",
        help="tune SGLang servers: learn per batch-size bucket and push tables (or --simulate)",
        description=(
            "Read each server's per-(batch size, arm) telemetry every interval, learn which "
            "draft depth gives the most goodput per batch-size bucket, push a table every "
            "decision period, and record everything in the history database. On SIGTERM or "
            "Ctrl-C each server is left on its greedy table. The tuning flags (not --metrics-* "
            "or the simulation ones) also read DYNSPEC_* environment variables (a flag wins)."
        ),
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
    p.set_defaults(func=_cmd_run)


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
    from tuner.protocol import format_table

    return format_table(table) if table else "?"  # type: ignore[arg-type]


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
        t.add_row(v.label, f"{v.steps:,}", str(v.learned_k), str(v.oracle_k),
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
    console.print(f"history: {s.db_url} ({s.observations:,} observations)", markup=False)


# --- sim ------------------------------------------------------------------------------------


@_command
def _add_sim(sub: argparse._SubParsersAction) -> None:
    from tuner.sim.engine import DEFAULT_ARMS, DEFAULT_MAX_RUNNING
    from tuner.sim.profiles import EXTRAPOLATE_MODES, list_profiles
    from tuner.sim.server import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SIM_LOAD
    from tuner.sim.workloads import list_workloads

    p = sub.add_parser(
        "sim",
        help="run a simulated SGLang server (no GPU) that speaks SGLang's HTTP API",
        description=(
            "Serve a simulated SGLang 0.5.23 server with EAGLE-3 speculative decoding and the "
            "dynspec plugin on loopback, on a virtual clock calibrated from a cost profile. "
            "Runs until Ctrl-C."
        ),
    )
    p.add_argument(
        "--profile",
        default="h200-llama8b",
        metavar="NAME|FILE",
        help=(
            f"cost profile: {', '.join(list_profiles())}, or a .jsonl cost table / "
            "parametric .json"
        ),
    )
    p.add_argument(
        "--workload",
        default="chat",
        metavar="W",
        help=f"{', '.join(list_workloads())}, or phases like 'chat:300,code:120' (default chat)",
    )
    p.add_argument(
        "--load",
        default=DEFAULT_SIM_LOAD,
        metavar="SCHEDULE",
        help=(
            "built-in traffic: 'SECONDS:CONCURRENCY,...' closed-loop phases (last one holds; "
            "prefix 'loop:' to cycle), 'poisson:RATE[:SECONDS]', 'trace:FILE.csv', or 'none' "
            f"(default {DEFAULT_SIM_LOAD})"
        ),
    )
    p.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})"
    )
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"0 = any free port (default {DEFAULT_PORT})",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        metavar="X",
        help="virtual seconds per real second (default 1)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        metavar="N",
        help=f"running-request cap (default: the profile's, else {DEFAULT_MAX_RUNNING})",
    )
    p.add_argument(
        "--arms",
        type=_csv_ints,
        default=DEFAULT_ARMS,
        metavar="K,K,...",
        help=f"draft-step counts the server builds (default {','.join(map(str, DEFAULT_ARMS))})",
    )
    p.add_argument(
        "--skip-zero-draft-extend",
        action="store_true",
        help=(
            "model SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 (k=0 skips the draft extend; "
            "cold recovery after)"
        ),
    )
    p.add_argument(
        "--extrapolate",
        choices=EXTRAPOLATE_MODES,
        default="refuse",
        help="beyond a cost table's measured batch sizes (default refuse)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help=(
            "inject a fault, repeatable: KIND[:PATH[,PATH]][:COUNT] with KIND refuse, stall"
            "[SECONDS], an HTTP status (503), malformed, reject, restart, protocolN or stock; "
            "e.g. "
            "503:/server_info:5. More at runtime: POST /_sim/faults"
        ),
    )
    p.add_argument(
        "--policy-file",
        metavar="F",
        help="start from an exported policy (export --format dynspec), as the plugin does with "
        "DYNSPEC_POLICY_FILE (default: that variable)",
    )
    p.set_defaults(func=_cmd_sim)


def _cmd_sim(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from tuner.sim.faults import Fault
    from tuner.sim.load import parse_load
    from tuner.sim.profiles import load_profile
    from tuner.sim.server import SimServer
    from tuner.sim.workloads import get_workload

    try:
        faults = [Fault.parse(spec) for spec in args.fault]
    except ValueError as exc:
        raise ConfigError(f"--fault: {exc}") from exc
    policy = None
    policy_path = args.policy_file or os.environ.get("DYNSPEC_POLICY_FILE") or None
    if policy_path:
        from tuner import policyfile

        try:  # the file names itself and the field in its errors
            policy = policyfile.load(policy_path)
        except policyfile.PolicyFileError as exc:
            raise ConfigError(f"policy file {exc}") from exc
    if not args.speed > 0:
        raise ConfigError(f"--speed must be > 0, got {args.speed}")
    if args.max_running is not None and not 1 <= args.max_running <= 100_000:
        raise ConfigError(f"--max-running must be in 1..100000, got {args.max_running}")
    if not args.arms or min(args.arms) < 0 or max(args.arms) > 64:
        raise ConfigError(f"--arms must be integers in 0..64, got {args.arms}")
    profile = load_profile(args.profile, extrapolate=args.extrapolate)
    workload = get_workload(args.workload)
    load = parse_load(args.load, seed=args.seed)
    try:
        server = SimServer(
            profile=profile,
            workload=workload,
            load=load,
            arms=args.arms,
            max_running=args.max_running,
            skip_zero_draft_extend=args.skip_zero_draft_extend,
            seed=args.seed,
            speed=args.speed,
            host=args.host,
            port=args.port,
        )
        for fault in faults:
            server.faults.add(fault)
        if policy is not None:
            try:
                server.core.install(policy.table, policy.policy_version)
            except ValueError as exc:  # ProtocolError: an arm this server did not build
                raise ConfigError(f"policy file {policy_path}: {exc}") from exc
        server.start()
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    except ValueError as exc:  # a setting the simulator cannot run with (named in exc)
        raise ConfigError(f"simulator: {exc}") from exc
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    eng = server.engine
    console.print(
        f"simulated SGLang {server.url}  profile {profile.name}  workload {workload.name}  "
        f"load {args.load}  arms {','.join(map(str, eng.arms))}  max_running {eng.max_running}  "
        f"speed x{args.speed:g}",
        markup=False,
    )
    console.print(f"watch it: curl {server.url}/server_info    stop: Ctrl-C", markup=False)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    snap = server.engine.snapshot()
    console.print(
        f"stopped after {snap['now']:.0f} virtual s: {snap['decode_steps']} decode steps, "
        f"{snap['requests_finished']} requests finished",
        markup=False,
    )
    return 0


# --- calibrate ------------------------------------------------------------------------------


@_command
def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    from tuner.calibrate import (
        DEFAULT_CTX,
        DEFAULT_DRAFT_RATIO,
        DEFAULT_DTYPE,
        DEFAULT_MIN_STEPS,
        DEFAULT_REPLAYS,
        DEFAULT_WARMUP,
        DTYPES,
        SHAPES,
    )
    from tuner.calibrate._grid import DEFAULT_BATCH_SIZES, DEFAULT_TOKENS_PER_SEQ

    p = sub.add_parser(
        "calibrate",
        help="measure a GPU's cost table (torch), or fit one from a server's history",
        description=(
            "Write a cost table for the simulator (JSON lines, shared/calibration format). "
            "--shape times a random-weight decoder and its EAGLE-3-style draft on this "
            "machine's CUDA GPU (needs pip install 'dynspec-tuner[gpu]'); --from-db fits one "
            "to the step times a live server reported, so the simulator replays that server."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--shape",
        metavar="NAME|FILE",
        help=f"model shape: {', '.join(SHAPES)}, or a JSON file (our fields or an HF config.json)",
    )
    src.add_argument("--from-db", metavar="URL", help="database URL of the tuner's history")
    p.add_argument("--out", required=True, metavar="FILE", help="table to write (.jsonl)")
    g = p.add_argument_group("measuring (--shape)")
    g.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="KV-cache tokens per sequence")
    g.add_argument(
        "--batch-sizes",
        type=_csv_ints,
        default=DEFAULT_BATCH_SIZES,
        metavar="B,B,...",
        help=f"default {','.join(map(str, DEFAULT_BATCH_SIZES))}",
    )
    g.add_argument(
        "--tokens-per-seq",
        type=_csv_ints,
        default=DEFAULT_TOKENS_PER_SEQ,
        metavar="Q,Q,...",
        help=f"query tokens per sequence (k+1 verifies k drafts); default "
        f"{','.join(map(str, DEFAULT_TOKENS_PER_SEQ))}",
    )
    g.add_argument("--dtype", choices=sorted(DTYPES), default=DEFAULT_DTYPE)
    g.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="graph replays before timing")
    g.add_argument("--replays", type=int, default=DEFAULT_REPLAYS, help="timed graph replays")
    g.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    g.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help="target layers to build and time, scaled up to the model's (default: all, or as "
        "many as fit in half the GPU's free memory)",
    )
    g.add_argument(
        "--draft-timing",
        choices=("before", "after"),
        default="before",
        help="time each point's draft before its target (default: the target's replays heat "
        "the GPU, and a draft timed right after them reads 5-20%% slow at large batch)",
    )
    f = p.add_argument_group("fitting (--from-db)")
    f.add_argument("--server", metavar="ADDR", help="the server whose history to fit (host:port)")
    f.add_argument(
        "--draft-ratio",
        type=float,
        default=DEFAULT_DRAFT_RATIO,
        help="draft forward time as a share of the target's (step times cannot separate them)",
    )
    f.add_argument(
        "--skip-zero-draft-extend",
        action="store_true",
        help="the server ran with SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1",
    )
    f.add_argument(
        "--graph-max-bs",
        type=int,
        metavar="N",
        help="the server's largest CUDA-graph batch size (default: SGLang's); batch sizes pad "
        "to SGLang's capture list up to it",
    )
    f.add_argument(
        "--no-graph-padding", action="store_true", help="do not pad batch sizes to graph sizes"
    )
    f.add_argument(
        "--min-steps",
        type=int,
        default=DEFAULT_MIN_STEPS,
        help="decode steps a (b, k) needs to count as measured",
    )
    f.add_argument("--since", type=float, metavar="UNIX_TS", help="only observations from then on")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.from_db is not None:
        return _calibrate_from_db(args)
    return _calibrate_gpu(args)


def _calibrate_gpu(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from tuner.calibrate import (
        CalibrationGrid,
        CalibrationSettings,
        gpu,
        resolve_shape,
        write_table,
    )

    if args.server is not None:
        raise ConfigError("--server goes with --from-db, not --shape")
    shape = resolve_shape(args.shape)
    try:
        grid = CalibrationGrid(batch_sizes=args.batch_sizes, tokens_per_seq=args.tokens_per_seq)
        settings = CalibrationSettings(
            ctx=args.ctx,
            dtype=args.dtype,
            warmup=args.warmup,
            replays=args.replays,
            seed=args.seed,
            layers=args.layers,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    problem = gpu.cuda_problem()
    if problem is not None:
        raise ConfigError(f"--shape times forwards on a CUDA GPU: {problem}")
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(f"{shape.name} ctx {settings.ctx}", total=len(grid))

        def on_point(p: gpu.Progress) -> None:
            last = f"b={p.b} q={p.q}"
            if p.row is not None:
                last += f" target {p.row.target_ms:.2f} ms draft {p.row.draft_ms:.3f} ms"
            bar.update(task, completed=p.done, description=f"{shape.name} {last}")

        result = gpu.measure(
            shape, grid, settings, progress=on_point, draft_first=args.draft_timing == "before"
        )
    out = write_table(args.out, result.info, result.rows)
    console.print(
        f"wrote {out}: {len(result.rows)} of {len(grid)} points on {result.info['gpu']} "
        f"(torch {result.info['torch']})",
        markup=False,
    )
    if result.stopped is not None:
        err_console.print(
            f"stopped early: {result.stopped}; not measured: "
            + ", ".join(f"b={b} q={q}" for b, q in result.skipped[:8])
            + (" ..." if len(result.skipped) > 8 else ""),
            markup=False,
        )
    return 130 if result.interrupted else 0


def _calibrate_from_db(args: argparse.Namespace) -> int:
    from rich.table import Table

    from storage import Storage
    from tuner.calibrate import fit_from_storage, write_table
    from tuner.sim.graphs import DEFAULT_GRAPH_MAX_BS, cuda_graph_bs

    if args.server is None:
        raise ConfigError("--from-db needs --server ADDR (the server whose history to fit)")
    max_bs = DEFAULT_GRAPH_MAX_BS if args.graph_max_bs is None else args.graph_max_bs
    if not 1 <= max_bs <= 65536:  # SGLang captures a few hundred at most
        raise ConfigError(f"--graph-max-bs must be in 1..65536, got {max_bs}")
    graph_bs = None if args.no_graph_padding else cuda_graph_bs(max_bs)
    with Storage(args.from_db, read_only=True) as st:
        try:
            result = fit_from_storage(
                st,
                args.server,
                since=args.since,
                draft_ratio=args.draft_ratio,
                skip_zero_draft_extend=args.skip_zero_draft_extend,
                graph_bs=graph_bs,
                min_steps=args.min_steps,
                info={"name": f"fitted-{args.server}"},
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    out = write_table(args.out, result.info, result.rows)
    qs = sorted({r.q for r in result.rows})
    table = Table(title=f"target ms per forward, fitted to {args.server}")
    table.add_column("b", justify="right")
    for q in qs:
        table.add_column(f"q={q}", justify="right")
    # A mark per kind as well as a colour: colours are lost in a pipe or a log.
    style = {"measured": "bold", "interpolated": "cyan", "extrapolated": "yellow"}
    mark = {"measured": "", "interpolated": "~", "extrapolated": "^"}
    cells = {(r.b, r.q): r for r in result.rows}
    for b in sorted({r.b for r in result.rows}):
        row = [str(b)]
        for q in qs:
            r = cells[(b, q)]
            row.append(f"[{style[r.source]}]{r.target_ms:.3f}{mark[r.source]}[/]")
        table.add_row(*row)
    console.print(table)
    console.print(
        f"cells: {result.count('measured')} measured (no mark), {result.count('interpolated')} "
        f"interpolated (~), {result.count('extrapolated')} extrapolated (^); "
        f"draft = {args.draft_ratio:g} x target",
        markup=False,
    )
    for cell, why in result.ignored:
        err_console.print(f"left out b={cell.b} k={cell.k}: {why}", markup=False)
    console.print(f"wrote {out}", markup=False)
    return 0


# --- report / export -----------------------------------------------------------------------


def _history_url(flag: str | None) -> str:
    import os

    from tuner.config import DEFAULT_DB_URL

    return flag or os.environ.get("DYNSPEC_DB") or DEFAULT_DB_URL


@_command
def _add_report(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner.report import FORMATS

    p = sub.add_parser(
        "report",
        help="what was learned: goodput per bucket and arm with 95%% intervals, decisions, history",
        description=(
            "Per server and batch-size bucket: each arm's goodput with a 95% interval and its "
            "sample counts, the chosen arm (from the table in effect; the best arm by the data "
            "when no table was recorded) and its gain over k=0 and over the always-speculate "
            "arm, acceptance per arm; the policy's version history with reasons; outages, "
            "restarts and rejected updates. Plots: goodput vs batch size per arm with the "
            "crossover marked, the chosen arm per bucket over time, goodput over time "
            "(embedded in HTML; PNG files beside --out for text and JSON)."
        ),
    )
    p.add_argument("--db", metavar="URL",
                   help="history database (default: DYNSPEC_DB, else sqlite:///dynspec.db)")
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
    p.set_defaults(func=_cmd_report)


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


def _buckets_arg(edges: tuple[int, ...] | None) -> Buckets | None:  # noqa: F821 (lazy)
    from policies import Buckets

    if not edges:
        return None
    try:
        return Buckets(edges)
    except ValueError as exc:
        raise ConfigError(f"--buckets: {exc}") from exc


@_command
def _add_export(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner.export import EXPORT_FORMATS, SOURCES

    p = sub.add_parser(
        "export",
        help="write the learned table for stock SGLang (sglang-adaptive) or the plugin (dynspec)",
        description=(
            "Write one server's learned table. Where it comes from (--source): 'policy' = the "
            "last table recorded for the server in the history (the last one it applied; the "
            "last dry-run decision if nothing was applied); 'data' = re-derived now from the "
            "stored observations, the best arm per bucket (a bucket without data takes its "
            "nearest neighbour's); 'auto' (default) = 'policy' when a table was recorded, "
            "else 'data'. Formats: 'sglang-adaptive' = JSON for SGLang's "
            "--speculative-adaptive --speculative-adaptive-config FILE with one candidate step "
            "per batch-size slot (slot key = the row's lower bound, applied after CUDA-graph "
            "padding), so SGLang follows the table; SGLang pre-builds every arm in the file "
            "(listed in it under \"_dynspec\"). 'dynspec' = the plugin's versioned policy "
            "file (table + provenance), loaded at server start."
        ),
    )
    p.add_argument("--db", metavar="URL",
                   help="history database (default: DYNSPEC_DB, else sqlite:///dynspec.db)")
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
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    import time

    from tuner.export import export
    from tuner.protocol import format_table
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
    console.print(f"wrote {result.path}: {lt.server} {format_table(lt.table)} from {origin}",
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


@_command
def _add_bench(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner.bench import (
        DEFAULT_BENCH_LOAD,
        DEFAULT_BENCH_POLICIES,
        DEFAULT_BENCH_PROFILES,
        DEFAULT_BENCH_WORKLOADS,
        DEFAULT_WARMUP_S,
    )
    from tuner.bench_worlds import DEFAULT_WORLD_LOAD, DEFAULT_WORLD_POLICIES
    from tuner.sim.worlds import parse_world_range

    def csv(text: str) -> tuple[str, ...]:
        return tuple(p.strip() for p in text.split(",") if p.strip())

    def world_range(text: str) -> tuple[int, ...]:
        try:
            return parse_world_range(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p = sub.add_parser(
        "bench",
        help="run policies side by side in simulated time and score them against the oracle",
        description=(
            "Runs every (profile, workload, policy) under one load schedule on the "
            "simulator's engine, driven as the daemon drives a server, and prints per load "
            "phase the % of the oracle's goodput (after warm-up / including it), tokens lost "
            "to exploration, table switches, convergence and p50/p99 time per output token, "
            "then the targets. Deterministic for a seed. 'shift' = chat -> code -> hard over "
            "the schedule. A policy may carry parameters: 'threshold:max_batch=8', "
            "'sglang-real' runs SGLang's own AdaptiveSpeculativeParams when sglang is "
            "importable. --worlds runs generated worlds (MoE and dense cost surfaces, "
            "acceptance shapes, diversity, drift, noise, shifts) instead of profiles and "
            "workloads."
        ),
    )
    p.add_argument("--profiles", type=csv, default=None, metavar="LIST",
                   help=f"profile names or files (default: {','.join(DEFAULT_BENCH_PROFILES)})")
    p.add_argument("--workloads", type=csv, default=None, metavar="LIST",
                   help=f"default: {','.join(DEFAULT_BENCH_WORKLOADS)}")
    p.add_argument("--worlds", type=world_range, default=None, metavar="RANGE",
                   help="run generated worlds instead: N (worlds 0..N-1), A-B, or a list "
                   "'3,7,10-12'; choose on 0-49, report on 50-99")
    p.add_argument("--world-seed", type=int, default=0, metavar="S",
                   help="generator seed of --worlds (default 0)")
    p.add_argument("--load", default=None, metavar="SCHEDULE",
                   help=f"load schedule (default: {DEFAULT_BENCH_LOAD}; with --worlds "
                   f"{DEFAULT_WORLD_LOAD})")
    p.add_argument("--policies", type=csv, default=None, metavar="LIST",
                   help=f"default: {','.join(DEFAULT_BENCH_POLICIES)}; with --worlds "
                   f"{','.join(DEFAULT_WORLD_POLICIES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", type=_csv_ints, default=None, metavar="K,K,...",
                   help="arms the simulated server builds (default 0,1,3,5,7)")
    p.add_argument("--warmup", type=float, default=DEFAULT_WARMUP_S, metavar="S",
                   help=f"seconds of each load phase 'after warm-up' leaves out "
                   f"(default {DEFAULT_WARMUP_S:g})")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="run length for open-loop loads (poisson, trace)")
    p.add_argument("--max-running", type=int, default=None, metavar="N")
    p.add_argument("--skip-zero-draft-extend", action="store_true",
                   help="SGLang's SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 (cold recovery)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="worker processes (default: CPU count)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="also write every figure as JSON")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    import json
    import math

    from policies import DEFAULT_POLICY
    from tuner.bench import (
        DEFAULT_ARMS,
        DEFAULT_BENCH_LOAD,
        DEFAULT_BENCH_POLICIES,
        DEFAULT_BENCH_PROFILES,
        DEFAULT_BENCH_WORKLOADS,
        BenchConfig,
        run_bench,
        summarize_policies,
    )

    if args.worlds is not None:
        return _cmd_bench_worlds(args)
    config = BenchConfig(
        profiles=args.profiles or DEFAULT_BENCH_PROFILES,
        workloads=args.workloads or DEFAULT_BENCH_WORKLOADS, load=args.load or DEFAULT_BENCH_LOAD,
        policies=args.policies or DEFAULT_BENCH_POLICIES, seed=args.seed,
        arms=args.arms or DEFAULT_ARMS,
        warmup_s=args.warmup, duration_s=args.duration, max_running=args.max_running,
        skip_zero_draft_extend=args.skip_zero_draft_extend, jobs=args.jobs,
    )
    n = len(config.profiles) * len(config.workloads) * len(config.policies)
    err_console.print(f"bench: {n} runs on {config.jobs or 'all'} cores ...", markup=False)
    result = run_bench(config)

    def pct(v: float) -> str:
        return "-" if not math.isfinite(v) else f"{v:.1f}"

    def show(rows: list[list[str]]) -> None:
        # Plain aligned text: it survives pipes, logs and narrow terminals intact.
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            line = "  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            console.print(line.rstrip(), markup=False, soft_wrap=True)

    scenarios: dict[tuple[str, str], list] = {}
    for r in result.runs:
        scenarios.setdefault((r.profile, r.workload), []).append(r)
    for (prof, wl), runs in scenarios.items():
        console.print(f"\n{prof} / {wl} / load {config.load}: % of oracle per load phase, "
                      "after warm-up/including it", markup=False, soft_wrap=True)
        head = ["policy"] + [f"c={ph.concurrency}" if ph.concurrency is not None
                             else f"{ph.start_s:g}-{ph.end_s:g}s" for ph in runs[0].phases]
        head += ["all", "explore-lost", "switches", "converge-s", "tpot-p50/p99-ms"]
        rows = [head]
        for r in runs:
            tp50 = [ph.tpot_p50_ms for ph in r.phases if math.isfinite(ph.tpot_p50_ms)]
            tp99 = [ph.tpot_p99_ms for ph in r.phases if math.isfinite(ph.tpot_p99_ms)]
            rows.append([
                f"{r.policy} *" if r.policy == DEFAULT_POLICY else r.policy,
                *(f"{pct(ph.pct_oracle)}/{pct(ph.pct_oracle_all)}" for ph in r.phases),
                f"{pct(r.pct_oracle)}/{pct(r.pct_oracle_all)}",
                f"{r.explore_pct:.2f}%",
                str(r.switches),
                f"{r.worst_convergence_s:.0f}",
                f"{sum(tp50) / len(tp50):.1f}/{max(tp99):.1f}" if tp50 else "-",
            ])
        show(rows)

    console.print("\nper policy over every run (% of oracle; slowest bucket = traffic seconds "
                  "to converge, or spent unconverged)", markup=False, soft_wrap=True)
    rows = [["policy", "worst-phase-after-warm-up", "worst-phase-incl", "mean-phase-incl",
             "explore-lost", "slowest-bucket-s"]]
    for name, (w, a, m) in summarize_policies(result).items():
        runs = [r for r in result.runs if r.policy == name]
        lost = sum(r.explore_pct for r in runs) / len(runs)
        conv = max(r.worst_convergence_s for r in runs)
        rows.append([f"{name} *" if name == DEFAULT_POLICY else name, pct(w), pct(a), pct(m),
                     f"{lost:.2f}%", f"{conv:.0f}"])
    show(rows)
    for line in result.skipped:
        console.print(f"skipped {line}", markup=False)
    console.print(f"\ntargets for the default policy ({DEFAULT_POLICY}, marked *):",
                  markup=False)
    for c in result.checks:
        verdict = "n/a" if c.ok is None else "PASS" if c.ok else "FAIL"
        console.print(f"  [{verdict}] {c.target}: {c.detail}",
                      markup=False, soft_wrap=True)
    console.print(f"{len(result.runs)} runs in {result.wall_s:.0f} s wall", markup=False)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(result.to_json(), indent=1))
        except OSError as exc:
            raise ConfigError(f"--json {args.json}: {exc}") from exc
        console.print(f"wrote {args.json}", markup=False)
    return 0


def _cmd_bench_worlds(args: argparse.Namespace) -> int:
    import json

    from tuner.bench import DEFAULT_ARMS, RunResult
    from tuner.bench_worlds import (
        DEFAULT_WORLD_LOAD,
        DEFAULT_WORLD_POLICIES,
        WorldBenchConfig,
        render_worlds,
        run_worlds,
    )

    if args.profiles is not None or args.workloads is not None:
        raise ConfigError("--worlds replaces --profiles and --workloads: give one or the other")
    if args.duration is not None or args.max_running is not None:
        raise ConfigError("--duration and --max-running do not apply to --worlds "
                          "(each world has its own running-request cap)")
    config = WorldBenchConfig(
        worlds=args.worlds, world_seed=args.world_seed, load=args.load or DEFAULT_WORLD_LOAD,
        policies=args.policies or DEFAULT_WORLD_POLICIES, seed=args.seed,
        arms=args.arms or DEFAULT_ARMS, warmup_s=args.warmup,
        skip_zero_draft_extend=args.skip_zero_draft_extend, jobs=args.jobs,
    )
    n = len(config.worlds) * len(config.policies)
    err_console.print(f"bench: {n} runs on {len(config.worlds)} worlds, "
                      f"{config.jobs or 'all'} cores ...", markup=False)
    done = 0

    def progress(r: RunResult) -> None:
        nonlocal done
        done += 1
        err_console.print(f"  {done}/{n} {r.profile} {r.policy}", markup=False)

    result = run_worlds(config, progress=progress)
    for line in render_worlds(result):
        console.print(line, markup=False, soft_wrap=True)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(result.to_json(), indent=1))
        except OSError as exc:
            raise ConfigError(f"--json {args.json}: {exc}") from exc
        console.print(f"wrote {args.json}", markup=False)
    return 0


# --- sweep -----------------------------------------------------------------------------------


@_command
def _add_sweep(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner import config as c
    from tuner.loadgen import DEFAULT_MAX_TOKENS, ENDPOINTS

    p = sub.add_parser(
        "sweep",
        help="tokens/s by concurrency level and arm, the hand-drawn table, measured for you",
        description=(
            "Drive closed-loop load at each concurrency level (exactly N requests in flight, "
            "through /v1/completions or /generate), pin the server to one arm at a time through "
            "the plugin, and measure output tokens/s, time per output token (p50/p99) and the "
            "server's own counters. Optuna picks the next (level, arm) and stops windows that "
            "are clearly behind, so far fewer than levels x arms windows are needed; the "
            "study lives in --db (optuna-dashboard shows it) and a rerun with the same "
            "settings resumes it. Output: the table (best arm marked, crossover named) as "
            "text, JSON and PNG, plus the learned per-batch table. Ctrl-C stops cleanly and "
            "keeps what was measured; the server gets its own table back."
        ),
    )
    p.add_argument("--server", metavar="HOST:PORT", default=None,
                   help=f"the SGLang server (default {c.DEFAULT_SERVER})")
    p.add_argument("--concurrency", type=_csv_ints, default=c.DEFAULT_SWEEP_LEVELS,
                   metavar="LIST",
                   help="levels, requests in flight (default "
                   f"{','.join(map(str, c.DEFAULT_SWEEP_LEVELS))})")
    p.add_argument("--arms", type=_csv_ints, default=None, metavar="K,K,...",
                   help="arms to compare (default: every arm the server built)")
    p.add_argument("--prompts", type=Path, metavar="FILE.jsonl",
                   help='prompts, one {"prompt": "..."} per line (default: built-in chat-like '
                   "prompts; real traffic gives truer acceptance)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"output tokens per request, exact (ignore_eos; default "
                   f"{DEFAULT_MAX_TOKENS})")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="completions = /v1/completions (default), generate = /generate")
    p.add_argument("--model", default="default", help="the 'model' field of /v1/completions")
    p.add_argument("--per-level", type=float, default=c.DEFAULT_SWEEP_PER_LEVEL_S, metavar="S",
                   help="longest measured window per (level, arm), seconds, warm-up excluded "
                   f"(default {c.DEFAULT_SWEEP_PER_LEVEL_S:g}; windows that are precise or "
                   "clearly behind stop sooner)")
    p.add_argument("--warmup", type=float, default=c.DEFAULT_SWEEP_WARMUP_S, metavar="S",
                   help="load after each switch before measuring, once every earlier request "
                   f"has finished (default {c.DEFAULT_SWEEP_WARMUP_S:g})")
    p.add_argument("--trials", type=int, default=None, metavar="N",
                   help="at most N measured windows in the study (resumed ones count)")
    p.add_argument("--exhaustive", action="store_true",
                   help="measure every (level, arm) once for the full window: the plain grid")
    p.add_argument("--no-table", action="store_true",
                   help="skip the last pass that measures the learned table at every level")
    p.add_argument("--db", metavar="URL",
                   help="database for the Optuna study (default: DYNSPEC_DB, else "
                   f"{c.DEFAULT_DB_URL})")
    p.add_argument("--study", metavar="NAME",
                   help="study name (default: from server, endpoint, max tokens and prompts, "
                   "so the same sweep resumes)")
    p.add_argument("--out", type=Path, default=Path("sweep.json"), metavar="FILE",
                   help="write FILE (.json), and beside it .txt, .png and .policy.json "
                   "(default sweep.json)")
    p.add_argument("--api-key-file", metavar="F",
                   help="file holding SGLang's API key (or DYNSPEC_API_KEY); pinning arms "
                   "needs the admin key when one is set")
    p.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="longest wait for one reply, queueing included (default 600)")
    p.add_argument("--seed", type=int, default=0, help="prompt order (and the simulator)")
    g = p.add_argument_group("simulation (no GPU, no server needed)")
    g.add_argument("--simulate", action="store_true",
                   help="sweep the built-in simulator on a free loopback port")
    g.add_argument("--profile", metavar="NAME|FILE", default="seed-kimi-pcie",
                   help="cost profile (default seed-kimi-pcie: the PCIe box where speculation "
                   "loses at load; a fast profile such as h200-llama8b needs --speed 6 "
                   "--max-tokens 2048 for this client to keep up)")
    g.add_argument("--workload", metavar="W", default=c.DEFAULT_SIM_WORKLOAD,
                   help=f"default {c.DEFAULT_SIM_WORKLOAD}")
    g.add_argument("--speed", type=float, default=8.0, metavar="X",
                   help="simulated seconds per wall second (default 8; much faster and the "
                   "client's own turnaround starts to show in the numbers)")
    p.set_defaults(func=_cmd_sweep)


class _SweepView:
    """Rich progress for a sweep: one bar per level (arms measured or ruled out), one for the
    window being measured, and a line per finished window."""

    def __init__(self, progress: Progress, levels: Sequence[int]) -> None:
        self.progress = progress
        self.levels = {lv: progress.add_task(f"c={lv}", total=None) for lv in levels}
        self.window = progress.add_task("", total=None, visible=False)

    def __call__(self, e: SweepEvent) -> None:
        from tuner.sweep import TABLE_ARM

        p = self.progress
        arm = "table" if e.arm == TABLE_ARM else f"k={e.arm}"
        where = f"  c={e.level} {arm}"
        if e.kind == "setup":
            p.console.print(f"note: {e.message}", markup=False)
        elif e.kind == "status":
            for st in e.status:
                n = len(st.measured) + len(st.skipped) + len(st.pending)
                best = "" if st.best is None else f" best k={st.best}"
                p.update(self.levels[st.level], total=n,
                         completed=len(st.measured) + len(st.skipped),
                         description=f"c={st.level:<4}{best}{'' if st.resolved else ' …'}")
        elif e.kind == "trial":
            p.reset(self.window, total=e.steps, visible=True, description=f"{where}: switching")
        elif e.kind == "phase":
            p.update(self.window, description=f"{where}: {e.message}")
        elif e.kind == "step" and e.stats is not None and e.step is not None:
            p.update(self.window, completed=min(e.step, e.steps or e.step),
                     description=f"{where}: {e.stats.tok_s:,.0f} tok/s, "
                     f"{e.stats.requests} requests")
        elif e.kind == "done" and e.measurement is not None:
            m = e.measurement
            server = ""
            if m.server is not None:
                server = (f", server {m.server.goodput:,.0f} tok/s busy at batch "
                          f"{m.server.mean_batch:.1f}")
            errors = f", {m.errors} failed requests" if m.errors else ""
            p.console.print(
                f"c={m.level:<4} {arm:<6} {m.tok_s:>10,.1f} tok/s ± {m.tok_s_se:,.1f}  TPOT "
                f"{m.tpot_p50_ms:.1f}/{m.tpot_p99_ms:.1f} ms  {m.window_s:.0f} s, "
                f"{m.requests} requests ({e.message}){server}{errors}",
                markup=False, highlight=False,
            )
            p.update(self.window, visible=False)


def _cmd_sweep(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import math
    import os

    import optuna
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from tuner import sweep as s
    from tuner.config import DEFAULT_SERVER, normalize_server, read_api_key_file
    from tuner.loadgen import (
        DEFAULT_REQUEST_TIMEOUT_S,
        LoadConfig,
        load_prompts,
        synthetic_prompts,
    )

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for noisy in ("tuner.sim", "httpx"):  # a line per request would bury the progress
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.simulate and args.server:
        raise ConfigError("--simulate starts its own server; drop --server")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if not (args.speed > 0 and math.isfinite(args.speed)):
        raise ConfigError(f"--speed must be a positive number, got {args.speed}")
    prompts = load_prompts(args.prompts) if args.prompts else synthetic_prompts(seed=args.seed)
    load_config = LoadConfig(
        endpoint=args.endpoint, max_tokens=args.max_tokens, model=args.model, seed=args.seed,
        request_timeout_s=args.request_timeout or DEFAULT_REQUEST_TIMEOUT_S,
    )
    api_key = None
    if args.api_key_file:
        api_key = read_api_key_file(args.api_key_file)
    elif os.environ.get("DYNSPEC_API_KEY", "").strip():
        api_key = os.environ["DYNSPEC_API_KEY"].strip()
    elif os.environ.get("DYNSPEC_API_KEY_FILE", "").strip():
        api_key = read_api_key_file(os.environ["DYNSPEC_API_KEY_FILE"].strip())
    from tuner.outfiles import check_out

    check_out(args.out)  # before minutes of measuring, not after
    out_json = args.out if args.out.suffix == ".json" else args.out.with_suffix(".json")

    with contextlib.ExitStack() as stack:
        if args.simulate:
            from tuner.sim.server import SimServer

            sim = stack.enter_context(SimServer(profile=args.profile, workload=args.workload,
                                                speed=args.speed, seed=args.seed))
            server = normalize_server(f"127.0.0.1:{sim.port}")
            console.print(f"simulated server {server}: {args.profile}, {args.workload}, "
                          f"x{args.speed:g} speed (rates below are per wall second)",
                          markup=False)
        else:
            server = normalize_server(args.server or DEFAULT_SERVER)
        study = args.study or s.default_study_name(
            server, endpoint=args.endpoint, max_tokens=args.max_tokens, prompts=prompts)
        config = s.SweepConfig(
            levels=args.concurrency, arms=args.arms, per_level_s=args.per_level,
            warmup_s=args.warmup, max_trials=args.trials, exhaustive=args.exhaustive,
            table_pass=not args.no_table, study_name=study,
        )
        progress = stack.enter_context(Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            console=err_console, transient=True,
        ))
        result = asyncio.run(s.sweep_server(
            server, config, prompts=prompts, load_config=load_config,
            db_url=_history_url(args.db), api_key=api_key,
            on_event=_SweepView(progress, config.levels),
        ))
    header = (f"dynspec-tuner sweep of {server} ({load_config.path}, {args.max_tokens} tokens "
              f"per request, study {study!r})")
    text = s.render_text(result, header=header)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    written = [s.write_json(result, out_json, server=server, endpoint=load_config.path,
                            max_tokens=args.max_tokens)]
    txt = out_json.with_suffix(".txt")
    txt.write_text(text + "\n", encoding="utf-8")
    written.append(txt)
    if result.cells:
        written.append(s.plot_png(result, out_json.with_suffix(".png"), title=header))
    policy = s.write_policy_file(result, out_json.with_name(out_json.stem + ".policy.json"),
                                 server=server)
    if policy is not None:
        written.append(policy)
    for path in written:
        err_console.print(f"wrote {path}", markup=False)
    return 130 if result.interrupted else 0


@_command
def _add_sglang_args(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner.plugin.launch import (
        ALGORITHMS,
        DEFAULT_ALGORITHM,
        DEFAULT_ARMS,
        DEFAULT_MAX_RUNNING_REQUESTS,
    )

    p = sub.add_parser(
        "sglang-args",
        help="print the SGLang flags for the plugin and write its adaptive config",
        description=(
            "Write the single-slot adaptive config {\"1\": {\"candidate_steps\": ARMS}} (so "
            "SGLang builds CUDA graphs for every arm at every batch size and the plugin's "
            "table does the bucketing) and print the speculative flags for "
            "sglang.launch_server on stdout, ready for $(...). The arms are fixed for the "
            "server's lifetime: each costs graph-capture time and GPU memory."
        ),
    )
    p.add_argument("--arms", type=_csv_ints, default=DEFAULT_ARMS, metavar="K,K,...",
                   help="draft-step counts the server pre-builds, 0 = no drafting "
                   f"(default {','.join(map(str, DEFAULT_ARMS))})")
    p.add_argument("--out", type=Path, default=Path("dynspec-adaptive.json"), metavar="FILE",
                   help="where to write the adaptive config (default ./dynspec-adaptive.json)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM)
    p.add_argument("--initial-steps", type=int, metavar="K",
                   help="the arm the server starts on (default: SGLang's, the middle arm)")
    p.add_argument("--topk", type=int, default=1, metavar="K",
                   help="--speculative-eagle-topk; above 1 a tree, switched on and off per "
                   "batch: --arms 0,S with S its depth (default 1, a chain)")
    p.add_argument("--draft-tokens", type=int, metavar="N",
                   help="a tree's node count (--speculative-num-draft-tokens); needed with "
                   "--topk above 1")
    p.add_argument("--max-running-requests", type=int, default=DEFAULT_MAX_RUNNING_REQUESTS,
                   metavar="N", help="raise SGLang's EAGLE default of 48 so large-batch "
                   f"buckets occur (default {DEFAULT_MAX_RUNNING_REQUESTS}; 0 = leave it out)")
    p.set_defaults(func=_cmd_sglang_args)


def _cmd_sglang_args(args: argparse.Namespace) -> int:
    import shlex

    from tuner.plugin.launch import MANY_ARMS, sglang_flags, validate_arms, write_adaptive_config

    try:
        arms = validate_arms(args.arms)
        out = args.out.resolve()
        flags = sglang_flags(
            config_path=out, algorithm=args.algorithm, initial_steps=args.initial_steps,
            max_running_requests=args.max_running_requests or None, arms=arms,
            topk=args.topk, draft_tokens=args.draft_tokens,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        write_adaptive_config(arms, out)
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write: {exc.strerror or exc}") from exc
    err_console.print(f"wrote {out}: arms {list(arms)}", markup=False, soft_wrap=True)
    if len(arms) > MANY_ARMS:
        err_console.print(
            f"warning: {len(arms)} arms; each one captures its own CUDA graphs at every batch "
            "size, outside SGLang's memory planning (leave --mem-fraction-static headroom)",
            markup=False, soft_wrap=True,
        )
    err_console.print(
        "with the plugin installed in the server's environment (SGLANG_PLUGINS=dynspec to load "
        "only it; DYNSPEC_POLICY_FILE=FILE to start from an exported policy):",
        markup=False, soft_wrap=True,
    )
    console.print(shlex.join(flags), markup=False, highlight=False, soft_wrap=True)
    return 0


def _add_global_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--debug, --log-level and --log-format, accepted before or after the command (the
    command's copies default to SUPPRESS so they never undo a value given before it)."""
    from tuner.logging_setup import LOG_FORMATS, LOG_LEVELS

    d = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    p.add_argument("--debug", action="store_true", default=d(False),
                   help="show tracebacks and debug logs")
    p.add_argument("--log-level", choices=LOG_LEVELS, default=d(None),
                   help="log threshold (default info; debug with --debug)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=d("text"),
                   help="text (default) or json: one JSON object per line on stderr, for "
                   "journald and log shippers")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dynspec-tuner",
        description=(
            "Learns, per batch-size bucket, how many speculative draft steps pay on an SGLang "
            "server, and hot-updates the server's per-batch decision."
        ),
        epilog="Try: dynspec-tuner run --simulate   (no GPU, no server needed)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for _, add in _COMMANDS:
        add(sub)
    for p in sub.choices.values():
        _add_global_options(p, top=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a bare command: show what there is to run
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except Exception as exc:  # a flag's converter raised what argparse does not catch
        if "--debug" in argv:
            raise
        err_console.print(f"dynspec-tuner: error: a bad value on the command line "
                          f"({type(exc).__name__}: {exc})", markup=False, soft_wrap=True)
        return 2
    from tuner.logging_setup import configure_logging

    configure_logging(level=args.log_level, fmt=args.log_format, debug=args.debug)
    where = f"dynspec-tuner {args.command}"
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        if args.debug:
            raise
        err_console.print(f"{where}: error: {exc}", markup=False, soft_wrap=True)
        return 2
    except DynspecError as exc:
        if args.debug:
            raise
        err_console.print(f"{where}: {exc}", markup=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        err_console.print("interrupted", markup=False)
        return 130
    except OSError as exc:  # a file, folder, port or address given on the command line
        if args.debug:
            raise
        err_console.print(f"{where}: error: {_os_error(exc)}", markup=False, soft_wrap=True)
        return 2
    except Exception as exc:  # a bug: one line, the traceback with --debug
        if args.debug:
            raise
        err_console.print(
            f"{where}: internal error: {type(exc).__name__}: {exc} (run with --debug for the "
            "traceback, and please report it)", markup=False, soft_wrap=True)
        return 1


def _os_error(exc: OSError) -> str:
    what = exc.strerror or str(exc) or type(exc).__name__
    name = exc.filename if exc.filename is not None else None
    return f"{name}: {what}" if name is not None else what


if __name__ == "__main__":
    sys.exit(main())

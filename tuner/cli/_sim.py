"""Serve a simulated SGLang 0.5.23 server with EAGLE-3 speculative decoding and the dynspec
plugin on loopback, on a virtual clock calibrated from a cost profile. Runs until Ctrl-C.
"""

from __future__ import annotations

import argparse

from tuner.cli._common import _command, _csv_ints, console
from tuner.errors import ConfigError


def _add_sim(sub: argparse._SubParsersAction) -> None:
    from tuner.sim.engine import DEFAULT_ARMS, DEFAULT_MAX_RUNNING
    from tuner.sim.profiles import EXTRAPOLATE_MODES, list_profiles
    from tuner.sim.server import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_SIM_LOAD
    from tuner.sim.workloads import list_workloads

    p = _command(sub, "sim", _cmd_sim, __doc__,
                 help="run a simulated SGLang server (no GPU) that speaks SGLang's HTTP API")
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
                server.core.install_file(policy)
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

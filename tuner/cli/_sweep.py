"""Drive closed-loop load at each concurrency level (exactly N requests in flight, through
/v1/completions or /generate), pin the server to one arm at a time through the plugin, and
measure output tokens/s, time per output token (p50/p99) and the server's own counters. Optuna
picks the next (level, arm) and stops windows that are clearly behind, so far fewer than levels
x arms windows are needed; the study lives in --db (optuna-dashboard shows it) and a rerun with
the same settings resumes it. Output: the table (best arm marked, crossover named) as text,
JSON and PNG, plus the learned per-batch table. Ctrl-C stops cleanly and keeps what was
measured; the server gets its own table back.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tuner.cli._common import _command, _csv_ints, _history_url, console, err_console
from tuner.errors import ConfigError

if TYPE_CHECKING:
    from rich.progress import Progress

    from tuner.sweep import SweepEvent


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from tuner import config as c
    from tuner.loadgen import DEFAULT_MAX_TOKENS, ENDPOINTS

    p = _command(
        sub, "sweep", _cmd_sweep, __doc__,
        help="tokens/s by concurrency level and arm, the hand-drawn table, measured for you",
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

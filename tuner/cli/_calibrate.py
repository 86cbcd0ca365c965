"""Write a cost table for the simulator (JSON lines, shared/calibration format). --shape times
a random-weight decoder and its EAGLE-3-style draft on this machine's CUDA GPU (needs pip
install 'dynspec-tuner[gpu]'); --from-db fits one to the step times a live server reported, so
the simulator replays that server.
"""

from __future__ import annotations

import argparse

from tuner.cli._common import _command, _csv_ints, console, err_console
from tuner.errors import ConfigError


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

    p = _command(
        sub, "calibrate", _cmd_calibrate, __doc__,
        help="measure a GPU's cost table (torch), or fit one from a server's history",
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

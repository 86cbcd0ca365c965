"""Runs every (profile, workload, policy) under one load schedule on the simulator's engine,
driven as the daemon drives a server, and prints per load phase the % of the oracle's goodput
(after warm-up / including it), tokens lost to exploration, table switches, convergence and
p50/p99 time per output token, then the targets. Deterministic for a seed. 'shift' = chat ->
code -> hard over the schedule. A policy may carry parameters: 'threshold:max_batch=8',
'sglang-real' runs SGLang's own AdaptiveSpeculativeParams when sglang is importable. --worlds
runs generated worlds (MoE and dense cost surfaces, acceptance shapes, diversity, drift, noise,
shifts) instead of profiles and workloads.
"""

from __future__ import annotations

import argparse
from typing import Any

from tuner.cli._common import _command, _csv_ints, console, err_console
from tuner.errors import ConfigError


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

    def tree_shape(text: str) -> Any:
        from tuner.sim.tree import parse_tree

        try:
            return parse_tree(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def machine_drift(text: str) -> Any:
        from tuner.sim._step_cost import MachineDrift

        try:
            return MachineDrift.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    def world_range(text: str) -> tuple[int, ...]:
        try:
            return parse_world_range(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p = _command(
        sub, "bench", _cmd_bench, __doc__,
        help="run policies side by side in simulated time and score them against the oracle",
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
    p.add_argument("--policy-seed", type=int, default=None, metavar="S",
                   help="seed the policies' own random choices with S instead of --seed (the "
                   "traffic stays --seed's): rerun a bench with another S to see how much of a "
                   "difference between two runs is the policies' luck")
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
    p.add_argument("--machine-drift", type=machine_drift, default=None, metavar="SD:SECONDS",
                   help="the simulated machine's speed wanders: log spread SD, correlated "
                   "over SECONDS of busy time (e.g. 0.2:30, a loaded CPU server); every arm "
                   "alike")
    p.add_argument("--tree", type=tree_shape, default=None, metavar="KxSxN",
                   help="score a tree server (top-k K, S steps, N draft tokens, e.g. 4x2x16): "
                   "arms 0 and the tree, SGLang's own policies skipped")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="worker processes (default: CPU count)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="also write every figure as JSON")


def _cmd_bench(args: argparse.Namespace) -> int:
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
        if args.tree is not None:
            raise ConfigError("--tree applies to profiles, not to --worlds")
        return _cmd_bench_worlds(args)
    arms = args.arms or DEFAULT_ARMS
    if args.tree is not None:
        if args.arms is not None:
            raise ConfigError("--tree sets the arms (0 and the tree's steps): drop --arms")
        arms = (0, args.tree.steps)
    config = BenchConfig(
        profiles=args.profiles or DEFAULT_BENCH_PROFILES,
        workloads=args.workloads or DEFAULT_BENCH_WORKLOADS, load=args.load or DEFAULT_BENCH_LOAD,
        policies=args.policies or DEFAULT_BENCH_POLICIES, seed=args.seed,
        policy_seed=args.policy_seed, arms=arms,
        warmup_s=args.warmup, duration_s=args.duration, max_running=args.max_running,
        skip_zero_draft_extend=args.skip_zero_draft_extend, tree=args.tree, jobs=args.jobs,
        machine_drift=args.machine_drift,
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
        if config.tree is not None:
            t = config.tree
            prof = f"{prof} (tree {t.topk}x{t.steps}x{t.draft_tokens})"
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
        # The per-step oracle's headroom over the per-bucket one, on one run's batches.
        ref = next((r for r in runs if r.policy == DEFAULT_POLICY), runs[0])
        room = "  ".join(f"{pct(100.0 * (ph.step_headroom - 1.0))}" for ph in ref.phases)
        console.print(f"per-step oracle headroom, % per phase ({ref.policy}'s batches): {room}",
                      markup=False, soft_wrap=True)

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
    _write_json(args, result)
    return 0


def _cmd_bench_worlds(args: argparse.Namespace) -> int:
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
        policy_seed=args.policy_seed, arms=args.arms or DEFAULT_ARMS, warmup_s=args.warmup,
        skip_zero_draft_extend=args.skip_zero_draft_extend, jobs=args.jobs,
        machine_drift=args.machine_drift,
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
    _write_json(args, result)
    return 0


def _write_json(args: argparse.Namespace, result: Any) -> None:
    """``--json``: the result's JSON, when asked for (a bench and a worlds run alike)."""
    import json

    if args.json is not None:
        try:
            args.json.write_text(json.dumps(result.to_json(), indent=1))
        except OSError as exc:
            raise ConfigError(f"--json {args.json}: {exc}") from exc
        console.print(f"wrote {args.json}", markup=False)

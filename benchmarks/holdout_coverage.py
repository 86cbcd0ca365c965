"""Coverage of the gain intervals on the simulator, where the truth is known.

Runs seeded ``run --simulate --holdout`` sessions (the real daemon over HTTP against the
simulator, in simulated time) and checks, per run:

- the switchback (``tuner.switchback``): is the true gain it estimates (the oracle's expected
  goodputs for the arms the control windows ran against the starting table, over the pairs'
  own batch sizes: ``tuner.report_switchback.true_gain``) inside its 95 % interval? Is its
  cost at most the holdout share times the measured gain?
- the observational gain of ``report`` over the starting table (``tuner.report_gain``): is
  the oracle's gain of the same table over the starting one, at the run's batch-size mix
  (busy seconds per batch size, as ``report`` weights it), inside its 95 % interval?

Target (issue 16): the truth inside the interval in >= 95 % of seeded runs. The run's seed
seeds the simulator, the policy and the schedule; nothing here is tuned on these seeds.

    .venv/bin/python benchmarks/holdout_coverage.py --seeds 0-19 --jobs 2

Figures (benchmarks/results/holdout-coverage-*.txt, 100 seeds each, 5 % in 5 s windows, on
two states of the tree): 600 simulated s (median 6 pairs), seeds 0-99: switchback 94 and
97 of 100, observational 100 and 100; 1800 simulated s (median 17 pairs), seeds 100-199:
switchback 98 and 99, observational 99 and 94 (docs/commands.md, "run", says which code).
With the token budget (04ff607), seeds 200-259 at 600 s: switchback 60/60, cost within
its own bound 60/60, observational 59/60.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _observational(storage, server, engine):  # noqa: ANN001
    """report's gain over the starting table, and the oracle's value of it."""
    from tuner.protocol import lookup
    from tuner.report import build_report
    from tuner.sim import oracle

    (s,) = build_report(storage, server=server).servers
    gains = {rg.gain.baseline: rg for rg in s.gains}
    rg = gains.get("start")
    if rg is None or s.table is None:
        return None
    occ: dict[int, float] = {}
    for a in storage.aggregate(server=server):
        occ[a.b] = occ.get(a.b, 0.0) + a.busy_s

    def g(b: int, k: int) -> float:
        return oracle.expected_goodput(engine.profile, engine.workload, b, k,
                                       graph_bs=tuple(engine.graph_bs),
                                       skip_zero_draft_extend=engine.skip_zero_draft_extend)

    table = s.table.table
    num = sum(t * g(b, lookup(table, b)) for b, t in occ.items())
    den = sum(t * g(b, lookup(rg.base_table, b)) for b, t in occ.items())
    return {"ratio": rg.gain.ratio, "low": rg.gain.low, "high": rg.gain.high,
            "truth": num / den - 1, "measured_share": rg.gain.measured_share}


def _diagnose(storage, server, engine) -> dict:  # noqa: ANN001
    """Where the switchback's error comes from: per role, the busy-weighted ratio of realized
    to expected (oracle) goodput over the strata the pair shares, and the batch-size mix."""
    from policies import Buckets
    from tuner.daemon._holdout import stratum
    from tuner.report_switchback import read_pairs
    from tuner.sim import oracle

    buckets = Buckets()
    acc = {r: [0.0, 0.0, 0.0] for r in ("base", "control")}  # tokens, busy, busy x expected
    for p in read_pairs(storage, server):
        shared = {k for k in p.base if k in p.control and p.base[k][1] > 0
                  and p.control[k][1] > 0}
        for role, span in (("base", p.base_span), ("control", p.control_span)):
            for a in storage.aggregate(server=server, since=span[0] + 1e-6,
                                       until=span[1] + 1e-6):
                if a.busy_s <= 0 or stratum(buckets, a.b) not in shared:
                    continue
                g = oracle.expected_goodput(engine.profile, engine.workload, a.b, a.k,
                                            graph_bs=tuple(engine.graph_bs),
                                            skip_zero_draft_extend=engine.skip_zero_draft_extend)
                acc[role][0] += a.emitted_tokens
                acc[role][1] += a.busy_s
                acc[role][2] += a.busy_s * g
    kinds = [e.kind for e in storage.events(server=server)]
    out = {f"{r}_realized_over_expected": (v[0] / v[2] if v[2] > 0 else None)
           for r, v in acc.items()}
    out.update(skipped=kinds.count("holdout_skip"), void=kinds.count("holdout_void"))
    return out


def one_run(seed: int, args: argparse.Namespace) -> dict:
    from storage import Storage
    from tuner.config import SimulateConfig, TunerConfig
    from tuner.sim.server import SimServer
    from tuner.simulate import run_simulation

    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'run.db'}"
        cfg = TunerConfig(db_url=db, seed=seed, holdout=args.holdout,
                          holdout_window_s=args.window)
        sim = SimulateConfig(seed=seed, duration_s=args.duration, speed=args.speed, port=0,
                             profile=args.profile, workload=args.workload)
        t0 = time.monotonic()
        s = run_simulation(cfg, sim)
        wall = time.monotonic() - t0
        out = {"seed": seed, "wall_s": round(wall, 1), "switchback": None, "observational": None}
        if s.switchback is not None:
            r = s.switchback
            out["switchback"] = {
                "ratio": r.ratio, "low": r.low, "high": r.high, "pairs": r.pairs,
                "truth": s.switchback_truth, "cost": r.cost, "base_share": r.base_share,
                "covered": bool(r.low <= s.switchback_truth <= r.high),
                "cost_bound": cfg.holdout * max(0.0, r.ratio),
            }
        # The engine's profile and workload, for the oracle (the summary keeps names only).
        engine = SimServer(profile=sim.profile, workload=sim.workload, load=sim.load,
                           max_running=sim.max_running, seed=seed, speed=1.0, port=0).engine
        with Storage(db, read_only=True) as st:
            obs = _observational(st, s.server, engine)
            if out["switchback"] is not None:
                out["switchback"].update(_diagnose(st, s.server, engine))
        if obs is not None:
            obs["covered"] = bool(obs["low"] <= obs["truth"] <= obs["high"])
            out["observational"] = obs
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-19", help="e.g. 0-19 or 0,3,7 (default 0-19)")
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds per run")
    ap.add_argument("--holdout", type=float, default=0.05, help="share on the baseline")
    ap.add_argument("--window", type=float, default=5.0, help="window seconds (simulated)")
    ap.add_argument("--speed", type=float, default=1000.0)
    ap.add_argument("--profile", default="h200-llama8b")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ap.add_argument("--json", metavar="PATH", help="write every run's figures here")
    args = ap.parse_args(argv)
    seeds = _seeds(args.seeds)
    t0 = time.monotonic()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            runs = list(pool.map(one_run, seeds, [args] * len(seeds)))
    else:
        runs = [one_run(s, args) for s in seeds]

    def pct(x: float) -> str:
        return f"{100 * x:+.2f}%" if math.isfinite(x) else "inf"

    print(f"{len(seeds)} runs of {args.duration:g} simulated s, holdout {args.holdout:.0%} in "
          f"{args.window:g} s windows ({args.profile}, {args.workload}); "
          f"{time.monotonic() - t0:.0f} s wall")
    print("seed  switchback: gain [95% interval] truth pairs cost  |  observational: gain "
          "[95% interval] truth")
    for r in runs:
        sb, ob = r["switchback"], r["observational"]
        left = (f"{pct(sb['ratio'])} [{pct(sb['low'])}, {pct(sb['high'])}] {pct(sb['truth'])} "
                f"{sb['pairs']} {100 * sb['cost']:.3f}%{'' if sb['covered'] else ' MISS'}"
                if sb else "no pair")
        right = (f"{pct(ob['ratio'])} [{pct(ob['low'])}, {pct(ob['high'])}] {pct(ob['truth'])}"
                 f"{'' if ob['covered'] else ' MISS'}" if ob else "no gain")
        print(f"{r['seed']:>4}  {left}  |  {right}")
    sbs = [r["switchback"] for r in runs if r["switchback"]]
    obs = [r["observational"] for r in runs if r["observational"]]
    if sbs:
        cov = sum(s["covered"] for s in sbs)
        within = sum(s["cost"] <= s["cost_bound"] + 1e-12 for s in sbs)
        print(f"switchback: truth inside the 95% interval in {cov}/{len(sbs)} runs "
              f"({100 * cov / len(sbs):.0f}%); cost <= holdout x measured gain in "
              f"{within}/{len(sbs)}; mean cost {100 * sum(s['cost'] for s in sbs) / len(sbs):.3f}%"
              f" of goodput against a mean bound of "
              f"{100 * sum(s['cost_bound'] for s in sbs) / len(sbs):.3f}%; mean baseline share of busy time "
              f"{100 * sum(s['base_share'] for s in sbs) / len(sbs):.2f}%; median pairs "
              f"{sorted(s['pairs'] for s in sbs)[len(sbs) // 2]}")
        over = [s["cost"] / s["cost_bound"] for s in sbs if s["cost_bound"] > 0]
        err = [s["ratio"] - s["truth"] for s in sbs]
        print(f"switchback: largest cost / own bound {max(over, default=math.nan):.3f}; "
              f"pairs skipped by the budget {sum(s.get('skipped', 0) for s in sbs)}, void "
              f"{sum(s.get('void', 0) for s in sbs)}; error (gain - truth) mean "
              f"{100 * sum(err) / len(err):+.3f} points, below the truth in "
              f"{sum(e < 0 for e in err)}/{len(err)}")
        for role in ("base", "control"):
            v = [s[f"{role}_realized_over_expected"] for s in sbs
                 if s.get(f"{role}_realized_over_expected")]
            if v:
                print(f"  {role} windows: realized / oracle-expected goodput, mean over runs "
                      f"{sum(v) / len(v):.4f}")
    if obs:
        cov = sum(o["covered"] for o in obs)
        print(f"observational: truth inside the 95% interval in {cov}/{len(obs)} runs "
              f"({100 * cov / len(obs):.0f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

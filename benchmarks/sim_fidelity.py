"""Simulator fidelity: does the engine reproduce the numbers its profiles were built from?

Three checks, each printing simulated / reference ratios:

1. ``h200-llama8b`` — decode step times the engine charges (read back from the plugin core's
   telemetry: busy seconds per decode step) equal the calibration table's composition
   ``k·draft(b,1) + target(b,k+1) + draft(b,k+1)`` (``k = 0``: ``target(b,1) + draft(b,1)``)
   at every measured ``(b, q)``. Target: within 1 %.
2. ``seed-kimi-pcie`` — the seed's three headline numbers: EAGLE-3 ≈ 96 tok/s at one request,
   ≈ 354 tok/s at high concurrency (64 running) vs ≈ 773 tok/s without speculation. Target:
   within 10 %.
3. ``h100-llama8b`` — EAGLE-3's SGLang speedup row (arXiv 2503.01840 Table 3, chain of 3,
   MT-bench): throughput with EAGLE-3 / without, per batch size. Target: within 10 % each.

Throughputs are decode goodput measured the way the tuner measures it (emitted tokens / busy
seconds from the ``(b, k)`` counters) on a closed loop that holds the batch at ``b``.

Run: ``.venv/bin/python benchmarks/sim_fidelity.py`` (about a minute on 2 cores; ``--quick``
shortens the runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path

from tuner.plugin.core import PluginCore
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop
from tuner.sim.oracle import expected_goodput
from tuner.sim.profiles import load_profile
from tuner.sim.workloads import CLASSES, LengthDist, Phase, RequestClass, Workload

SHARED_TABLE = (
    Path(__file__).resolve().parents[2] / "shared" / "calibration"
    / "h200-llama8b-bf16-ctx1024.jsonl"
)
SEED_TARGETS = {"eagle3_1_request": 96.0, "eagle3_64_running": 354.0, "no_spec_64_running": 773.0}
EAGLE3_SGLANG_ROW = {
    2: 1.81,
    4: 1.82,
    8: 1.62,
    16: 1.48,
    24: 1.39,
    32: 1.32,
    48: 1.38,
    56: 1.34,
    64: 1.38,
}


def _short_prompts(base: str = "chat") -> Workload:
    """The class's own outputs (requests come and go, so acceptance averages over many of
    them) with short prompts, so prefills take little time."""
    c = CLASSES[base]
    cls = RequestClass(
        name=c.name, acceptance=c.acceptance, prompt=LengthDist(16, 0.0), output=c.output
    )
    return Workload(name=f"{base}-short-prompts", phases=(Phase(1.0, ((1.0, cls),)),))


def _endless(base: str = "chat") -> Workload:
    """The chat class with short prompts and outputs long enough that nobody finishes: the
    batch stays at the closed loop's concurrency and (after the first prefill) every decode
    step is timed."""
    c = CLASSES[base]
    cls = RequestClass(
        name=c.name,
        acceptance=c.acceptance,
        prompt=LengthDist(16, 0.0),
        output=LengthDist(10**7, 0.0, 1, 10**8),
    )
    return Workload(name=f"{base}-endless", phases=(Phase(1.0, ((1.0, cls),)),))


def _goodput_at(core: PluginCore, b: int, k: int) -> tuple[float, int]:
    rows = [r for r in core.state().counters if r.b == b and r.k == k]
    steps = sum(r.decode_steps for r in rows)
    busy = sum(r.busy_s for r in rows)
    return (sum(r.emitted_tokens for r in rows) / busy if busy else float("nan")), steps


def _run_closed(
    profile,
    workload,
    *,
    b: int,
    k: int,
    seconds: float,
    no_spec: bool = False,
    max_running=None,
    seed=0,
):
    arms = (0,) if no_spec else (0, 1, 3, 5)
    core = PluginCore(arms, started_at=0.0, default_arm=0 if no_spec else k)
    eng = Engine(
        profile=profile,
        workload=workload,
        core=core,
        max_running=max_running,
        skip_zero_draft_extend=no_spec,  # no speculation at all: no draft extend either
        seed=seed,
        load=ClosedLoop([(1e12, b)]),
    )
    eng.run_until(seconds)
    g, steps = _goodput_at(core, b, 0 if no_spec else k)
    return g, steps, eng


def check_calibration(quick: bool) -> float:
    print("1. h200-llama8b: engine step time / calibration table composition")
    text = (
        SHARED_TABLE.read_text()
        if SHARED_TABLE.exists()
        else (resources.files("tuner.sim").joinpath("profiles", "h200-llama8b.jsonl").read_text())
    )
    src = SHARED_TABLE if SHARED_TABLE.exists() else "the shipped copy"
    raw = {
        (r["b"], r["q"]): (r["target_ms"], r["draft_ms"])
        for r in map(json.loads, text.splitlines())
        if r.get("kind") == "cost"
    }
    bs = sorted({b for b, _ in raw})
    qs = sorted({q for _, q in raw})
    ks = [q - 1 for q in qs if q >= 2 and (1 in qs)]
    prof = load_profile("h200-llama8b")
    wl = _endless()
    worst = 0.0
    n = 0
    print(f"   reference: {src}")
    print("   " + "b".rjust(5) + "".join(f"k={k}".rjust(9) for k in [0, *ks]))
    ratios: dict[tuple[int, int], float] = {}
    for k in [0, *ks]:
        arms = tuple(sorted({0, k}))
        core = PluginCore(arms, started_at=0.0, default_arm=k)
        eng = Engine(
            profile=prof,
            workload=wl,
            core=core,
            max_running=max(bs),
            seed=1,
            load=ClosedLoop([(0.5 if quick else 1.5, b) for b in bs]),
        )
        eng.run_until(len(bs) * (0.5 if quick else 1.5))
        for b in bs:
            t1, d1 = raw[(b, 1)]
            if k == 0:
                ref = t1 + d1
            else:
                tq, dq = raw[(b, k + 1)]
                ref = k * d1 + tq + dq
            rows = [r for r in core.state().counters if r.b == b and r.k == k]
            steps = sum(r.decode_steps for r in rows)
            sim = 1000 * sum(r.busy_s for r in rows) / steps
            ratios[(b, k)] = sim / ref
    for b in bs:
        print("   " + str(b).rjust(5) + "".join(f"{ratios[(b, k)]:9.4f}" for k in [0, *ks]))
        for k in [0, *ks]:
            worst = max(worst, abs(ratios[(b, k)] - 1))
            n += 1
    print(
        f"   {n} measured points; worst |ratio - 1| = {worst:.2e} (target <= 1e-2): "
        + ("PASS" if worst <= 0.01 else "FAIL")
    )
    return worst


def check_seed(quick: bool) -> float:
    print("2. seed-kimi-pcie: the seed's headline numbers (decode goodput, tok/s)")
    prof = load_profile("seed-kimi-pcie")
    secs = 120.0 if quick else 600.0
    wl = _short_prompts()
    cases = [
        ("eagle3_1_request", dict(b=1, k=3)),
        ("eagle3_64_running", dict(b=64, k=3)),
        ("no_spec_64_running", dict(b=64, k=0, no_spec=True)),
    ]
    worst = 0.0
    for name, kw in cases:
        g, steps, eng = _run_closed(prof, wl, seconds=secs, seed=2, **kw)
        target = SEED_TARGETS[name]
        analytic = (
            64 / prof.base_step_s(64)
            if kw.get("no_spec")
            else expected_goodput(prof, "chat", kw["b"], kw["k"])
        )
        # The same traffic with finite chat outputs (prefills included), as a benchmark sees it.
        _, _, e2e_eng = _run_closed(prof, "chat", seconds=secs, seed=2, **kw)
        e2e = e2e_eng.request_stats(since=secs * 0.1).output_throughput
        r = g / target
        worst = max(worst, abs(r - 1))
        print(
            f"   {name:20s} sim {g:7.1f}  target {target:6.1f}  ratio {r:6.3f}  "
            f"(oracle {analytic:6.1f}; end-to-end with prefills {e2e:6.1f}; {steps} timed steps)"
        )
    print(
        f"   worst |ratio - 1| = {worst:.3f} (target <= 0.10): "
        + ("PASS" if worst <= 0.10 else "FAIL")
    )
    return worst


def check_h100(quick: bool) -> float:
    print(
        "3. h100-llama8b: EAGLE-3 / no-speculation throughput, SGLang Table 3 (chain 3, MT-bench)"
    )
    prof = load_profile("h100-llama8b")
    secs = 30.0 if quick else 120.0
    wl = _short_prompts()
    worst = 0.0
    print("   " + "bs".rjust(4) + "  sim    paper   ratio")
    for b, paper in EAGLE3_SGLANG_ROW.items():
        spec, _, _ = _run_closed(prof, wl, b=b, k=3, seconds=secs, max_running=64, seed=3)
        base, _, _ = _run_closed(
            prof, wl, b=b, k=0, seconds=secs, max_running=64, no_spec=True, seed=3
        )
        sim = spec / base
        r = sim / paper
        worst = max(worst, abs(r - 1))
        print(f"   {b:4d} {sim:5.2f}  {paper:5.2f}  {r:6.3f}")
    print(
        f"   worst |ratio - 1| = {worst:.3f} (target <= 0.10): "
        + ("PASS" if worst <= 0.10 else "FAIL")
    )
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = [
        check_calibration(args.quick) <= 0.01,
        check_seed(args.quick) <= 0.10,
        check_h100(args.quick) <= 0.10,
    ]
    print(f"done in {time.perf_counter() - t0:.1f} s wall: {sum(results)}/3 checks pass")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

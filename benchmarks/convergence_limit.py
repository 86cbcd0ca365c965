"""How often even a best-case learner picks the wrong one of two near-tied arms at one request.

The bench's convergence target asks every bucket's greedy arm to be within 2 % of the oracle
within 60 s of traffic. At one running request that is a question about the workload's mean
acceptance α, and the data are one request at a time: each request draws its own α (Beta,
κ = 20 in the simulator), so a minute holds only a few independent samples of it.

This script measures the limit that puts on *any* policy. Its learner knows everything but the
requests' own α: the exact step times, the chain model and δ, the population's κ. It runs the
arm a policy would run (``--run-arm``, default the larger of the two), one request after
another with the simulator's length distribution, and at each horizon estimates the mean α
by inverting the mean accepted drafts per step it saw, and picks the arm whose expected
goodput (over the requests' spread, as the bench's oracle scores) is higher there. It prints the share
of runs that pick the wrong arm, next to the two arms' true goodput ratio.

    .venv/bin/python benchmarks/convergence_limit.py          # Kimi table, hard, k=1 vs k=3
    .venv/bin/python benchmarks/convergence_limit.py --profile h200-llama8b --workload hard \\
        --arms 3,5

Deterministic for ``--seed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from policies._acceptance import expected_accepted
from tuner.sim.oracle import expected_goodput
from tuner.sim.profiles import load_profile
from tuner.sim.workloads import Phase, Workload, get_workload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="seed-kimi-pcie")
    ap.add_argument("--workload", default="hard", help="a stationary workload (one class)")
    ap.add_argument("--arms", default="1,3", help="the two near-tied arms, K1,K2 (both > 0)")
    ap.add_argument("--run-arm", type=int, default=None, help="arm that runs (default: larger)")
    ap.add_argument("--horizons", default="30,60,120,240", help="seconds of traffic")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    prof = load_profile(args.profile)
    wl = get_workload(args.workload)
    ((_, cls),) = wl.mix_at(0.0)
    alpha, delta = cls.acceptance[prof.acceptance]
    ka, kb = sorted(int(x) for x in args.arms.split(","))
    run = args.run_arm if args.run_arm is not None else kb
    horizons = sorted(float(h) for h in args.horizons.split(","))
    t_step = {k: prof.step_s(1, k) for k in (ka, kb, run)}

    grid = np.linspace(0.01, 0.99, 981)
    mean_acc = np.array([expected_accepted(a, delta, run) for a in grid])

    def good(mean: float, k: int) -> float:
        # The simulator's oracle (the bench's scoring: the requests' Beta spread, weighted
        # by request-steps) for this workload with its mean α moved to ``mean``.
        moved = dataclasses.replace(cls, acceptance={**cls.acceptance,
                                                     prof.acceptance: (mean, delta)})
        w = Workload(name="moved", phases=(Phase(1.0, ((1.0, moved),)),), kappa=wl.kappa)
        return expected_goodput(prof, w, 1, k, graph_bs=())

    best = ka if good(alpha, ka) >= good(alpha, kb) else kb
    ratio = min(good(alpha, ka), good(alpha, kb)) / max(good(alpha, ka), good(alpha, kb))
    coarse = np.linspace(0.2, 0.95, 301)
    diff = np.array([good(a, ka) - good(a, kb) for a in coarse])
    crossing = np.nonzero(np.diff(np.sign(diff)))[0]
    if not len(crossing):
        print("the two arms never tie at one request; nothing to decide")
        return 0
    tie = float(coarse[crossing[0]])
    ka_below = diff[0] > 0  # k_a wins at low acceptance (it drafts less)
    a_beta, b_beta = wl.beta_params(alpha)
    sd_req = float(np.sqrt(alpha * (1 - alpha) / (wl.kappa + 1)))
    print(f"{prof.name} / {args.workload}: alpha {alpha:.3f} (per-request sd {sd_req:.3f}), "
          f"delta {delta:g}; k={ka} vs k={kb} at one request: best k={best}, the other "
          f"{(1 - ratio) * 100:.1f} % behind; they tie at mean alpha {tie:.3f}; running "
          f"k={run} ({t_step[run] * 1e3:.1f} ms a step)")

    rng = np.random.default_rng(args.seed)
    positions = delta ** np.arange(run)  # per-position acceptance factor α·δ^(i−1)
    wrong = np.zeros(len(horizons))
    for _ in range(args.runs):
        t, acc, steps, hi = 0.0, 0, 0, 0
        while hi < len(horizons):
            a = rng.beta(a_beta, b_beta)
            n_out = int(cls.output.sample(rng))
            made = 0
            while made < n_out and hi < len(horizons):
                ok = rng.random(run) < a * positions
                x = run if ok.all() else int(np.argmin(ok))  # leading accepted drafts
                acc += x
                steps += 1
                made += x + 1
                t += t_step[run]
                while hi < len(horizons) and t >= horizons[hi]:
                    est = grid[np.argmin(np.abs(mean_acc - acc / steps))]
                    pick = ka if (est < tie) == ka_below else kb
                    wrong[hi] += pick != best
                    hi += 1
    for h, w in zip(horizons, wrong, strict=True):
        print(f"  after {h:5.0f} s of traffic: the wrong arm in {w / args.runs:5.1%} of runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far off the default policy's step-time model is where no drafting arm has run yet.

Feeds the `model` policy exact step times: every arm up to a batch size, `k = 0` to four times
that (as a bench run's rising load measures them), for the shipped cost tables and generated
worlds. Prints, per extrapolation, the log error of the drafting cells four times further out
(positive: the cell is dearer than predicted) and how many posterior standard deviations
that is: a calibrated posterior has about half its |z| below 0.67 and few above 3.

    .venv/bin/python benchmarks/steptime_extrapolation.py [--worlds 30] [--verbose]
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from policies import Observation, expected_emitted, make_policy
from policies._model import DEFAULT_CHAIN_DELTA
from tuner.sim.profiles import CostProfile, load_profile
from tuner.sim.worlds import WorldProfile, make_world

ARMS = (0, 1, 3, 5, 7)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROFILES = ("seed-kimi-pcie", "h200-moe-qwen3-30b-a3b", "h200-moe-mixtral-8x7b",
            "h200-llama8b", "h100-llama8b")
STEPS = 50  # decode steps per observation; exact times, no noise
ALPHA = 0.7  # acceptance of the fed steps (only their step times are read back)


def exact(prof: CostProfile, b: int, k: int) -> Observation:
    """``STEPS`` decode steps at the table's step time, acceptance a default chain."""
    emitted = round(expected_emitted(ALPHA, DEFAULT_CHAIN_DELTA, k) * b * STEPS)
    return Observation(b, k, STEPS, emitted, emitted - b * STEPS, k * b * STEPS,
                       STEPS * prof.step_s(b, k))


def errors(prof: CostProfile, drafted_to: int) -> tuple[list[float], list[float]]:
    """Log errors and z-scores of the drafting cells at ``4 · drafted_to`` requests."""
    pol = make_policy("model", arms=ARMS, seed=0)
    for _ in range(10):
        for b in BATCHES:
            for k in ARMS:
                fed = b <= (drafted_to if k else 4 * drafted_to)
                if fed and not pol.update(exact(prof, b, k)):
                    raise AssertionError(f"the policy refused b={b} k={k}")
    post = pol._step_times()  # the posterior the policy decides from
    target = 4 * drafted_to
    j = pol.buckets.index(target)
    errs, zs = [], []
    for a, k in enumerate(ARMS):
        if k:
            e = math.log(prof.step_s(target, k)) - float(post.mean[j, a])
            errs.append(e)
            zs.append(e / float(post.sd[j, a]))
    return errs, zs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, default=30, help="generated worlds 0..N-1 (seed 0)")
    ap.add_argument("--verbose", action="store_true", help="every table's errors")
    args = ap.parse_args()
    tables = [(name, load_profile(name)) for name in PROFILES]
    tables += [(f"world-{i}", WorldProfile(make_world(i, 0))) for i in range(args.worlds)]
    print(f"{len(PROFILES)} shipped tables and {args.worlds} generated worlds; drafting cells "
          f"k = {ARMS[1:]} four times past the largest drafted batch")
    for drafted_to in (4, 16, 64):
        all_e, all_z = [], []
        for name, prof in tables:
            e, z = errors(prof, drafted_to)
            all_e += e
            all_z += z
            if args.verbose:
                print(f"  {drafted_to:3d} -> {4 * drafted_to:3d} {name:24s} "
                      + " ".join(f"{x:+.2f}/{y:+.1f}" for x, y in zip(e, z, strict=True)))
        e, z = np.array(all_e), np.abs(np.array(all_z))
        print(f"drafted to {drafted_to:3d}, predicted at {4 * drafted_to:3d}: mean error {e.mean():+.3f}, "
              f"mean |error| {np.abs(e).mean():.3f}, under-predicted {np.mean(e > 0):.0%}, "
              f"median |z| {np.median(z):.1f}, |z| > 3 {np.mean(z > 3):.0%}")


if __name__ == "__main__":
    main()

"""How far the default policy's step-time model carries k = 0 beyond where it was measured.

Feeds the `model` policy exact step times of a cost table for an EAGLE tree server (arms 0 and
the tree, the tree priced at its verified tokens): the tree at every batch size, k = 0 only up
to a batch size, as a bench run that keeps the tree on at mid batch measures them. Prints the
predicted k = 0 step time (and its log-sd) where k = 0 was never run against the table's.

    .venv/bin/python benchmarks/model_extrapolation.py [--profile P] [--tree 4x2x16]
"""

from __future__ import annotations

import argparse
import math

from policies import Observation, make_policy
from tuner.sim.profiles import load_profile
from tuner.sim.tree import TreeArm, parse_tree

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h200-moe-qwen3-30b-a3b-q16")
    ap.add_argument("--tree", default="4x2x16")
    args = ap.parse_args()
    prof, shape = load_profile(args.profile), parse_tree(args.tree)
    tree = TreeArm(shape)
    print(f"{args.profile}, tree {args.tree}: k = 0 predicted vs the table where never run")
    for k0_up_to in (16, 64):
        pol = make_policy("model", arms=(0, shape.steps), seed=0)
        pol.set_verify_tokens({shape.steps: shape.draft_tokens})
        n = 50  # decode steps per observation; exact times, no noise
        for _ in range(30):
            for b in BATCHES:
                t = tree.step_s(prof, b)
                pol.update(Observation(b, shape.steps, n, int(n * b * 2.2), int(n * b * 1.2),
                                       n * b * shape.steps, n * t))
                if b <= k0_up_to:
                    pol.update(Observation(b, 0, n, n * b, 0, 0, n * prof.step_s(b, 0)))
        post = pol._step_times()  # the posterior the policy decides from
        for b in (b for b in BATCHES if b > k0_up_to):
            j = pol.buckets.index(b)
            print(f"  k = 0 run up to b={k0_up_to:3d}; at b={b:3d}: predicted "
                  f"{math.exp(post.mean[j, 0]) * 1e3:6.1f} ms (log-sd {post.sd[j, 0]:.2f}), "
                  f"table {prof.step_s(b, 0) * 1e3:6.1f} ms; "
                  f"tree {tree.step_s(prof, b) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()

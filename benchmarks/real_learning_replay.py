"""What the default (model) policy believed at the end of a daemon run: its history replayed.

    .venv/bin/python benchmarks/real_learning_replay.py HISTORY.db|HISTORY.jsonl [--arms 0,1,3]
        [--buckets 1,2,4,8] [--upto S] [--draws 2000]

Feeds the run's observations, in order, to a fresh ``ModelPolicy`` (seed 0) and prints, per
bucket with traffic, each arm's predicted goodput, the step-time posterior (log seconds, mean
and sd), the emitted tokens per request-step it assumes, and how often a posterior draw picks
each arm (what exploration proposes). Written to explain why the real-server learning test's
daemon kept k3 after acceptance fell to 0.25 (tests/real/test_learning_real.py). It reads the
policy's internals (``_components``, ``_sample``): a diagnostic, not an interface.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies._base import Buckets, Observation  # noqa: E402
from policies._model import ModelPolicy  # noqa: E402


FIELDS = ("ts", "b", "k", "decode_steps", "emitted_tokens", "accepted_drafts", "drafted_tokens",
          "busy_s")


def read_history(path: str) -> list[tuple]:
    """The observations of a daemon's SQLite history, or of a JSON-lines dump of them (one
    object per row with FIELDS, as benchmarks/results keeps them)."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            return [tuple(json.loads(line)[name] for name in FIELDS) for line in f]
    with sqlite3.connect(path) as c:
        query = f"SELECT {', '.join(FIELDS)} FROM observations ORDER BY ts, id"
        return c.execute(query).fetchall()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db")
    ap.add_argument("--arms", default="0,1,3")
    ap.add_argument("--buckets", default="1,2,4,8")
    ap.add_argument("--upto", type=float, default=None, help="seconds of history to replay")
    ap.add_argument("--draws", type=int, default=2000)
    a = ap.parse_args()
    arms = tuple(int(x) for x in a.arms.split(","))
    policy = ModelPolicy(arms=arms, buckets=Buckets(tuple(int(x) for x in a.buckets.split(","))),
                         seed=0)  # fmt: skip
    rows = read_history(a.db)
    t0 = rows[0][0]
    for ts, *obs in rows:
        if a.upto is not None and ts - t0 > a.upto:
            break
        policy.update(Observation(*obs))
    alpha, alpha_sd = policy._alpha
    print(f"{a.db}: per-position acceptance {alpha:.3f} ± {alpha_sd:.3f}; greedy "
          f"{policy.greedy()}")
    t, em, _ = policy._components()
    if policy._machine is not None:
        drift = policy._machine.drift_var()
        print(f"machine: drift between 5-s windows log sd {drift ** 0.5:.3f} "
              f"({'offset applied' if drift else 'taken as steady'}); offset now "
              f"{policy._machine.offset:+.3f}")
    estimates = {(e.bucket, e.arm): e for e in policy._estimates()}
    greedy = policy.greedy_arms()
    for j in range(len(policy.buckets.edges) + 1):
        if not policy._state[j].steps:
            continue
        draws = Counter(policy._sample(j, greedy[j]) for _ in range(a.draws))
        print(f"bucket {policy.buckets.label(j)}: greedy k{greedy[j]}")
        for ai, k in enumerate(arms):
            e = estimates[(j, k)]
            print(f"  k{k}: {e.estimate:7.1f} ± {e.std:5.1f} tok/s (n {e.n:5d}); step "
                  f"{1000 * 2.718281828 ** float(t.mean[j, ai]):5.1f} ms (log sd "
                  f"{float(t.sd[j, ai]):.3f}); emitted/request-step {float(em[k]):.3f}; "
                  f"drawn {draws[k] / a.draws:6.1%}")


if __name__ == "__main__":
    main()

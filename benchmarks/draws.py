"""A change to the policy judged over several draws of the bench, against the same draws of a base.

One run of ``dynspec-tuner bench`` is one draw of traffic and of the policy's own choices
(``--seed``, ``--policy-seed``); luck alone moves a draw's count of worlds that clear 98 % in
every phase by 2–4 (docs/policy-log.md, "How much of a difference is luck"). So a change is run on
several draws, and this reads their ``--json`` files back into the figures the docs compare:

- generated worlds (``bench --worlds``): worlds at ≥ 98 % in every phase after warm-up
  ("ok"), phases below 98 %, their shortfall (the points below 98 summed), worlds below 95 %
  somewhere, and the worst phase;
- shipped profiles (``bench --policies model,thompson,ucb``): the worst phase, phases below
  98 %, and phases more than a point below the better of Thompson sampling and UCB.

    .venv/bin/python benchmarks/draws.py new-s0.json new-s1.json --base base-s0.json base-s1.json

``--base`` files are paired with the others in order, and the totals set side by side.
``--low`` lists each draw's phases below 98 %. ``--pair`` reads each base draw only for the runs
its new draw holds (a change screened on a few worlds, against the base's draws of them all)
and lists, run by run, the base's phases beside the new ones wherever either falls below 98 %.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies import DEFAULT_POLICY
from tuner.bench_worlds import BANDIT_MARGIN, BANDITS, WORLD_FLOOR_PCT, WORLD_TARGET_PCT


def phases(run: dict[str, Any], key: str = "pct_oracle") -> list[float]:
    """A run's per-phase % of the oracle after warm-up (``key`` ``pct_oracle_all``: including
    it; a phase without a figure as NaN)."""
    return [math.nan if p.get(key) is None else float(p[key])
            for p in run["phases"]]


def score(doc: dict[str, Any], policy: str = DEFAULT_POLICY) -> dict[str, Any]:
    """The draw's figures for ``policy`` (see the module docstring); ``low`` lists its
    runs with a phase below 98 % as ``(name, phases)``."""
    runs = [r for r in doc["runs"] if r["policy"] == policy]
    if not runs:
        raise ValueError(f"no runs of policy {policy!r}")
    out: dict[str, Any] = {"runs": len(runs), "low": []}
    short = 0.0
    below = floor = ok = 0
    worst = (math.inf, "")
    for r in runs:
        ps = phases(r)
        name = run_name(doc, r)
        bad = [p for p in ps if p < WORLD_TARGET_PCT]
        below += len(bad)
        short += sum(WORLD_TARGET_PCT - p for p in bad)
        floor += any(p < WORLD_FLOOR_PCT for p in ps)
        ok += not bad and not any(math.isnan(p) for p in ps)
        worst = min(worst, (min(filter(math.isfinite, ps), default=math.inf), name))
        if bad:
            out["low"].append((name, ps))
    out.update(ok=ok, below=below, shortfall=short, floor=floor, worst=worst)
    if "worlds" not in doc:  # shipped profiles: against the better bandit, phase by phase,
        # after warm-up (the measure) and including it (where the bandits explore:
        # every arm while a bucket is new)
        out["behind"] = behind(doc, runs, "pct_oracle")
        out["behind_all"] = behind(doc, runs, "pct_oracle_all")
    return out


def behind(doc: dict[str, Any], runs: Sequence[dict[str, Any]], key: str) -> int:
    """Phases of ``runs`` more than :data:`BANDIT_MARGIN` below the better bandit's, by
    ``key`` (see :func:`phases`)."""
    bandits: dict[tuple[str, str], list[list[float]]] = {}
    for r in doc["runs"]:
        if r["policy"] in BANDITS:
            bandits.setdefault((r["profile"], r["workload"]), []).append(phases(r, key))
    count = 0
    for r in runs:
        others = bandits.get((r["profile"], r["workload"]), [])
        for i, p in enumerate(phases(r, key)):
            best = max((o[i] for o in others if i < len(o)), default=-math.inf)
            count += best - p > BANDIT_MARGIN
    return count


def row(ps: Sequence[float]) -> str:
    """A run's phases as one line of figures."""
    return " ".join(f"{p:5.1f}" for p in ps)


def run_name(doc: dict[str, Any], run: dict[str, Any]) -> str:
    return run["profile"] if "worlds" in doc else f"{run['profile']} {run['workload']}"


def restricted(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``base`` with only the runs ``new`` holds (by name and policy)."""
    keep = {(run_name(new, r), r["policy"]) for r in new["runs"]}
    return {**base, "runs": [r for r in base["runs"] if (run_name(base, r), r["policy"]) in keep]}


def paired(base: dict[str, Any], new: dict[str, Any], policy: str) -> list[str]:
    """Run by run, the base's phases beside the new ones where either has one below 98 %."""
    before = {run_name(base, r): phases(r) for r in base["runs"] if r["policy"] == policy}
    out = []
    for r in new["runs"]:
        name, now = run_name(new, r), phases(r)
        was = before.get(name)
        if was is None or not any(p < WORLD_TARGET_PCT for p in (*was, *now)):
            continue
        out.append(f"    {name:28s} {row(was)}  ->  {row(now)}")
    return out


def line(name: str, s: dict[str, Any]) -> str:
    worst = f"worst {s['worst'][0]:.1f} ({s['worst'][1]})"
    if "behind" in s:
        return (f"{name:32s} {worst}  below 98 % {s['below']:3d}  "
                f"> {BANDIT_MARGIN:g} pt behind a bandit {s['behind']:3d} "
                f"(including warm-up {s['behind_all']})")
    return (f"{name:32s} ok {s['ok']:3d}/{s['runs']:<3d} below 98 % {s['below']:3d}  "
            f"shortfall {s['shortfall']:6.1f}  below 95 % {s['floor']:2d}  {worst}")


def totals(scores: Sequence[dict[str, Any]]) -> str:
    if any("behind" in s for s in scores):
        return (f"worst {min(s['worst'][0] for s in scores):.1f}  below 98 % "
                f"{sum(s['below'] for s in scores)}  behind a bandit "
                f"{sum(s['behind'] for s in scores)} (including warm-up "
                f"{sum(s['behind_all'] for s in scores)})")
    return (f"ok {sum(s['ok'] for s in scores)}/{sum(s['runs'] for s in scores)}  "
            f"below 98 % {sum(s['below'] for s in scores)}  shortfall "
            f"{sum(s['shortfall'] for s in scores):.1f}  below 95 % "
            f"{sum(s['floor'] for s in scores)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="bench --json files, one per draw")
    ap.add_argument("--base", nargs="*", type=Path, default=[],
                    help="the same draws of the base, in the same order")
    ap.add_argument("--policy", default=DEFAULT_POLICY)
    ap.add_argument("--low", action="store_true", help="list each draw's phases below 98 %%")
    ap.add_argument("--pair", action="store_true",
                    help="read each base draw for its new draw's runs only, and list their "
                         "phases side by side wherever either is below 98 %%")
    a = ap.parse_args(argv)
    if a.base and len(a.base) != len(a.files):
        ap.error(f"{len(a.base)} --base files for {len(a.files)} draws")
    if a.pair and not a.base:
        ap.error("--pair needs --base")
    try:
        docs = {f: json.loads(f.read_text()) for f in [*a.files, *a.base]}
        if a.pair:
            for f, b in zip(a.files, a.base, strict=True):
                docs[b] = restricted(docs[b], docs[f])
        groups = [("base", a.base), ("new", a.files)] if a.base else [("", a.files)]
        summary = []
        for label, files in groups:
            scores = []
            for f in files:
                s = score(docs[f], a.policy)
                scores.append(s)
                print(line(f.name, s))
                for name, ps in s["low"] if a.low else ():
                    print(f"    {name:28s} {row(ps)}")
            summary.append(f"{label + ': ' if label else ''}{totals(scores)}")
        for f, b in zip(a.files, a.base, strict=True) if a.pair else ():
            print(f"{b.name} -> {f.name}")
            print("\n".join(paired(docs[b], docs[f], a.policy)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"draws: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

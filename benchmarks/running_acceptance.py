"""The acceptance of the requests actually running, per time window, against the workload's
steady state and against what the default policy was fed.

The policy learns acceptance from the steps that ran; the per-bucket oracle scores against
the workload's steady state (``tuner.sim.oracle.workload_emitted``). The two part where the
running requests are not a steady-state sample: in a drain (concurrency falling, no
admissions) the requests that outlive the others are the slow ones, which accept less,
and where acceptance drifts down over a request's output they are also the old ones. This
runs one world or profile through the bench's own ``run_one`` and prints per window, for
``k`` = 1, 3, 7 (accepted drafts per request-step):

- **running**: the expectation over the requests running at each decode step, given each
  one's own acceptance and progress (the per-step oracle's; every step counted, at
  whatever arm it ran);
- **steady**: the workload's steady state at that time;
- **fed**: what the observations given to the policy measured at that arm, with their
  request-steps (the arm must have run).

The running figure is taken over the batch mix that the arms which ran produced, and the
steady one over the mix that arm ``k`` itself would: requests that accept less stay longer,
by how much depends on the arm. So far from the arm that ran (``k = 7`` while ``k = 3``
runs) the two part even at a steady load; at the arm that ran they agree.

    .venv/bin/python benchmarks/running_acceptance.py --world 36 --policy-seed 1000
    .venv/bin/python benchmarks/running_acceptance.py --profile h100-llama8b --workload chat
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any
from unittest import mock

from policies import _model
from tuner.bench import run_one
from tuner.bench_config import DEFAULT_BENCH_LOAD
from tuner.bench_worlds import DEFAULT_WORLD_LOAD
from tuner.sim import engine as sim_engine
from tuner.sim._step_oracle import StepOracle
from tuner.sim.oracle import workload_emitted
from tuner.sim.worlds import make_world

ARMS = (1, 3, 7)


def measure(*, load: str, window_s: float, seed: int, policy_seed: int | None,
            world: int | None = None, profile: str | None = None,
            workload: str | None = None) -> tuple[dict[int, dict[str, Any]], Any, Any]:
    """Per window index, its sums (``running[i]`` at ``ARMS[i]`` over ``steps`` request-steps,
    ``fed[k] = [accepted, request-steps]``); and the run's cost profile and workload.

    The running requests' expectation is the per-step oracle's own: it already values every
    arm for the batch that runs, at every step, as ``(n + expected drafts) / step time``.
    """
    wins: dict[int, dict[str, Any]] = defaultdict(
        lambda: {"running": [0.0] * len(ARMS), "steps": 0, "fed": defaultdict(lambda: [0, 0])})
    clock, engines = [0.0], []
    decode, oracle_step = sim_engine.Engine._decode, StepOracle.step
    update = _model.ModelPolicy.update

    def traced_decode(self: Any) -> Any:
        if not engines:
            engines.append(self)
        clock[0] = self.now  # the step oracle is told of the step inside
        return decode(self)

    def traced_step(self: StepOracle, rows: Any, n: int, pb: int, k: int, dt: float,
                    band: int = 0) -> None:
        oracle_step(self, rows, n, pb, k, dt, band)
        w = wins[int(clock[0] // window_s)]
        inv_cost = self._inv_cost[pb]
        for i, arm in enumerate(ARMS):
            a = self._index[arm]
            w["running"][i] += self._values[a] / inv_cost[a] - n
        w["steps"] += n

    def traced_update(self: Any, obs: Any) -> bool:
        if obs.k > 0:
            fed = wins[int(clock[0] // window_s)]["fed"][obs.k]
            fed[0] += obs.accepted_drafts
            fed[1] += obs.b * obs.decode_steps
        return update(self, obs)

    if world is not None:
        w = make_world(world, 0)
        kw: dict[str, Any] = {"profile": w.name, "workload": "generated", "world": w}
    else:
        assert profile is not None and workload is not None
        kw = {"profile": profile, "workload": workload}
    with (mock.patch.object(sim_engine.Engine, "_decode", traced_decode),
          mock.patch.object(StepOracle, "step", traced_step),
          mock.patch.object(_model.ModelPolicy, "update", traced_update)):
        run_one(load=load, policy="model", seed=seed, policy_seed=policy_seed, **kw)
    return dict(wins), engines[0].profile, engines[0].workload


def steady(prof: Any, wl: Any, k: int, t: float) -> float:
    return workload_emitted(wl, prof.acceptance, k, t=t) - 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--world", type=int, help="generated world (generator seed 0)")
    src.add_argument("--profile", help="a shipped cost profile (with --workload)")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--load", default=None,
                    help=f"load schedule (default: worlds {DEFAULT_WORLD_LOAD}; profiles the "
                         "bench's default)")
    ap.add_argument("--window", type=float, default=30.0, help="seconds per window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy-seed", type=int, default=None)
    args = ap.parse_args(argv)
    if args.load is None:
        args.load = DEFAULT_WORLD_LOAD if args.world is not None else DEFAULT_BENCH_LOAD
    wins, prof, wl = measure(load=args.load, window_s=args.window, seed=args.seed,
                             policy_seed=args.policy_seed, world=args.world,
                             profile=args.profile, workload=args.workload)
    print(f"accepted drafts per request-step at k = {ARMS}: running / steady / fed (request-steps)")
    for i in sorted(wins):
        w, t0 = wins[i], i * args.window
        cells = []
        for a, k in enumerate(ARMS):
            run = w["running"][a] / w["steps"] if w["steps"] else float("nan")
            acc, rs = w["fed"].get(k, (0, 0))
            fed = f"{acc / rs:5.2f} ({rs:6d})" if rs else " " * 14
            cells.append(f"k{k} {run:5.2f} / {steady(prof, wl, k, t0 + args.window / 2):5.2f} / {fed}")
        print(f"{t0:5.0f}-{t0 + args.window:5.0f} s  " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

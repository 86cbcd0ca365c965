"""Simulator speed: one hour of 64-way closed-loop traffic must take <= 60 s of wall time.

Runs the engine (plugin core included: every decode step goes through ``steps_for_batch`` and
``record_decode``) for an hour of virtual time on each shipped profile, and prints the wall
time, the ratio to the 60 s budget, and the speed-up over real time. As a baseline measured
in the same run it also times the same engine with a per-request Python loop for the
acceptance draws (what the numpy vectorisation replaces) over a shorter stretch, and prints
the per-step cost ratio.

Run: ``.venv/bin/python benchmarks/sim_speed.py`` (``--hours 0.25`` for a shorter check).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np

from tuner.sim._running import RunningRows
from tuner.sim.engine import Engine
from tuner.sim.load import ClosedLoop
from tuner.sim.profiles import list_profiles

BUDGET_S_PER_HOUR = 60.0


class _ScalarRows(RunningRows):
    """Baseline: the acceptance draws done request by request in Python."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._py_rng = random.Random(0)

    def _draw(self, n: int, k: int) -> np.ndarray:
        surv = self._surv
        draw = self._py_rng.random
        out = np.zeros(n, dtype=np.int64)
        for i in range(n):
            u = draw()
            a = 0
            while a < k and u < surv[i, a]:
                a += 1
            out[i] = a
        return out


class _ScalarEngine(Engine):
    """Baseline: the same engine with :class:`_ScalarRows`."""

    _rows_class = _ScalarRows


def _run(cls: type[Engine], profile: str, hours: float, conc: int = 64) -> tuple[float, Engine]:
    eng = cls(profile=profile, workload="chat", load=ClosedLoop([(1e12, conc)]), seed=0)
    t0 = time.perf_counter()
    eng.run_until(hours * 3600.0)
    return time.perf_counter() - t0, eng


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--hours", type=float, default=1.0, help="virtual hours per profile (default 1)"
    )
    args = ap.parse_args(argv)
    ok = True
    print(
        f"{'profile':16s} {'virtual':>8s} {'wall s':>8s} {'per hour':>9s} {'/budget':>8s} "
        f"{'x real':>8s} {'decode steps':>13s} {'us/step':>8s}"
    )
    for name in list_profiles():
        wall, eng = _run(Engine, name, args.hours)
        per_hour = wall / args.hours
        steps = eng.counters.decode_steps + eng.counters.prefill_steps
        ok &= per_hour <= BUDGET_S_PER_HOUR
        print(
            f"{name:16s} {args.hours:7.2f}h {wall:8.2f} {per_hour:8.2f}s "
            f"{per_hour / BUDGET_S_PER_HOUR:8.3f} {args.hours * 3600 / wall:8.0f} "
            f"{eng.counters.decode_steps:13d} {1e6 * wall / steps:8.1f}"
        )
    # Baseline in the same run: per-request Python acceptance draws, on the profile with the
    # most steps per hour, over a tenth of the time.
    short = args.hours / 10
    fast_wall, fast = _run(Engine, "h200-llama8b", short)
    slow_wall, slow = _run(_ScalarEngine, "h200-llama8b", short)
    per_fast = fast_wall / (fast.counters.decode_steps + fast.counters.prefill_steps)
    per_slow = slow_wall / (slow.counters.decode_steps + slow.counters.prefill_steps)
    print(
        f"baseline (per-request Python draws, h200-llama8b, {short:.2f}h): "
        f"{1e6 * per_slow:.1f} us/step "
        f"vs {1e6 * per_fast:.1f} us/step vectorised: x{per_slow / per_fast:.2f}"
    )
    print(
        "PASS" if ok else "FAIL",
        f"(target: <= {BUDGET_S_PER_HOUR:.0f} s wall per simulated hour of 64-way traffic)",
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

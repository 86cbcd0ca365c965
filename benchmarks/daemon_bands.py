"""The daemon end to end on the loopback simulator with the model policy: a protocol v2 plugin
(the daemon learns per acceptance band and pushes banded tables) against a v1 plugin
(band-agnostic tables), same profile, workload, load and seed, in one run.

Goodput is emitted tokens per busy second from the daemon's own stored ``(b, k)``
observations (both protocols report them), over the whole run (exploration included) and
over its second half. Time is simulated (a fake clock; the engine steps only when told), so
the figures do not depend on the machine's load. The seeds are not the ones any constant was
tuned on.

    .venv/bin/python benchmarks/daemon_bands.py [--ticks 300] [--load 1] \
        [--profile seed-kimi-pcie] [--workload diverse] [--seeds 11 12 13]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage import Storage  # noqa: E402
from tests._fakes import FakeClock  # noqa: E402
from tuner.config import TunerConfig  # noqa: E402
from tuner.daemon import Daemon  # noqa: E402
from tuner.plugin.core import PluginCore  # noqa: E402
from tuner.sim.server import SimServer  # noqa: E402


def run(protocol: int, args: argparse.Namespace, seed: int) -> tuple[float, float, int, int]:
    """(goodput, second-half goodput, pushes, refused) of one daemon run."""
    sim_clock, clock = FakeClock(0.0), FakeClock()
    server = SimServer(speed=1.0, clock=sim_clock, profile=args.profile,
                       workload=args.workload, load=args.load, seed=seed)
    if protocol == 1:  # a server still on the previous plugin
        old = server.engine.core
        server.engine.core = PluginCore(old.arms, started_at=old.started_at,
                                        default_arm=old.table[-1][1], protocol=1)
    db = f"sqlite:///{Path(tempfile.mkdtemp()) / 'h.db'}"
    server.start()
    try:
        config = TunerConfig(servers=(f"127.0.0.1:{server.port}",), interval_s=1.0,
                             policy="model", seed=seed, db_url=db)
        d = Daemon(config, storage=Storage(db), clock=clock)
        d.run_once()
        for _ in range(args.ticks):
            sim_clock.advance(1.0)
            with server.lock:
                server.engine.run_until(server.virtual_now())
            clock.advance(1.0)
            d.run_once()
        d.shutdown()
        pushes = d.status().servers[0].pushes
        with server.lock:
            refused = server.core.updates_rejected
    finally:
        server.stop()
    with Storage(db, read_only=True) as st:
        obs = st.observations()
    half = obs[0].ts + (obs[-1].ts - obs[0].ts) / 2

    def goodput(rows: list) -> float:
        return sum(o.emitted_tokens for o in rows) / sum(o.busy_s for o in rows)

    return goodput(obs), goodput([o for o in obs if o.ts > half]), pushes, refused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticks", type=int, default=300, help="simulated seconds (1 s ticks)")
    ap.add_argument("--load", default="1")
    ap.add_argument("--profile", default="seed-kimi-pcie")
    ap.add_argument("--workload", default="diverse")
    ap.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    args = ap.parse_args()
    print(f"{args.profile} / {args.workload}, load {args.load}, {args.ticks} simulated s")
    for seed in args.seeds:
        g1, h1, p1, r1 = run(1, args, seed)
        g2, h2, p2, r2 = run(2, args, seed)
        print(f"seed {seed}: v1 {g1:.1f} tok/s (2nd half {h1:.1f}), v2 banded {g2:.1f} "
              f"(2nd half {h2:.1f}): ratio {g2 / g1:.4f}, 2nd half {h2 / h1:.4f}; "
              f"pushes {p1}/{p2}, refused {r1}/{r2}")


if __name__ == "__main__":
    main()

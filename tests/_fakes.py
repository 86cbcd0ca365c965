"""Fakes the tests share: a clock that moves only when told, a simulated SGLang server on a
loopback port whose virtual time moves only when a test steps it, and Ctrl-C for a child."""

from __future__ import annotations

import signal

from tuner.sim.server import SimServer


def interruptible() -> None:
    """``preexec_fn`` for a child a test stops with Ctrl-C: SIGINT back to its default. A
    shell starts background jobs with SIGINT ignored, children inherit that, and Python then
    never raises KeyboardInterrupt (the suite run from ``nohup ... &`` failed so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class FakeClock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class LoopbackSim:
    """A :class:`SimServer` on a free loopback port (``addr`` once entered), on its own fake
    clock from 0: virtual time moves only by :meth:`step`. ``server_args`` go to the server."""

    def __init__(self, **server_args) -> None:
        self.clock = FakeClock(0.0)
        self.server = SimServer(speed=1.0, clock=self.clock, **server_args)

    def __enter__(self) -> LoopbackSim:
        self.server.start()
        self.addr = f"127.0.0.1:{self.server.port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def step(self, s: float = 1.0) -> None:
        self.clock.advance(s)
        with self.server.lock:
            self.server.engine.run_until(self.server.virtual_now())

"""Load and tuner processes for tests/real (imported by name).

- :class:`Load`: closed-loop sampled traffic (``c`` requests always in flight, token ids
  sent to ``/generate``, temperature 1 so the sampled verify and its acceptance knob apply).
- :class:`Tuner`: ``dynspec-tuner`` run as its own process from the project's venv
  (``DYNSPEC_REAL_CLIENT``), as it runs beside a production server.
- counter helpers: per-``(b, k)`` deltas of the plugin's readout and pinned-arm goodput.
- :func:`set_acceptance`: the acceptance knob, set at run time.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from _server import VOCAB, acceptance_threshold, http, readout

from tuner.protocol import CounterRow, DynspecState, encode_update

__all__ = [
    "Load",
    "Tuner",
    "client_exe",
    "counters",
    "pin",
    "push",
    "pushed_versions",
    "run_client",
    "set_acceptance",
    "tuner_args",
    "watch_versions",
]


def tuner_args(server, db: Path, *extra: str) -> list[str]:
    """``dynspec-tuner run`` against ``server`` with a fast cadence for the tier."""
    return ["run", "--server", server.address, "--db", f"sqlite:///{db}", "--interval", "0.5",
            "--decision-period", "2", "--seed", "0", *extra]  # fmt: skip


def pushed_versions(log: str) -> list[int]:
    """The versions a daemon's log says it pushed, in order."""
    return [int(v) for v in re.findall(r": pushed v(\d+) ", log)]


def watch_versions(url: str, seconds: float, key: str | None = None,
                   every_s: float = 0.5) -> list[int]:  # fmt: skip
    """The server's policy_version, read every ``every_s`` for ``seconds``."""
    seen, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.append(readout(url, key)["policy_version"])
        time.sleep(every_s)
    return seen


def client_exe() -> str:
    exe = os.environ.get("DYNSPEC_REAL_CLIENT") or shutil.which("dynspec-tuner")
    if not exe:
        raise RuntimeError("no dynspec-tuner to run: set DYNSPEC_REAL_CLIENT")
    return exe


class Load:
    """``concurrency`` worker threads, each sending one request and waiting for it."""

    def __init__(self, url: str, concurrency: int, *, max_new_tokens: int = 24,
                 key: str | None = None, seed: int = 0) -> None:  # fmt: skip
        self.url, self.key = url, key
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True)
                         for i in range(concurrency)]  # fmt: skip
        self.completed = 0
        self.errors: list[str] = []

    def _work(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            ids = [(self.seed * 7919 + worker * 613 + n * 31 + j) % (VOCAB - 10) + 10
                   for j in range(8)]  # fmt: skip
            params = {"temperature": 1.0, "max_new_tokens": self.max_new_tokens,
                      "ignore_eos": True}  # fmt: skip
            try:
                status, out = http(self.url, "/generate",
                                   {"input_ids": ids, "sampling_params": params}, key=self.key)
            except OSError as exc:  # the server is down (a restart test): try again
                status, out = 0, str(exc)
            if status == 200:
                self.completed += 1
            else:
                self.errors.append(f"{status}: {str(out)[:200]}")
                self._stop.wait(0.2)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


class Tuner:
    """``dynspec-tuner <args>`` as a subprocess with its log in a file; stopped by SIGTERM."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = [client_exe(), *args]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Tuner:
        log = open(self.log_path, "wb")  # noqa: SIM115 (kept open for the child)
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        log.close()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def run_client(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """A one-shot ``dynspec-tuner`` command (export, report, sweep); raises with its output."""
    done = subprocess.run([client_exe(), *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"dynspec-tuner {' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")  # fmt: skip
    return done


def state(url: str, key: str | None = None) -> DynspecState:
    """The server's ``dynspec`` readout, decoded."""
    return DynspecState.from_json(readout(url, key))


def counters(url: str, key: str | None = None) -> tuple[CounterRow, ...]:
    return state(url, key).counters


def push(url: str, table, version: int, key: str | None = None) -> tuple[int, object]:
    return http(url, "/set_internal_state", {"server_args": encode_update(table, version)},
                key=key)  # fmt: skip


def pin(url: str, k: int, key: str | None = None) -> None:
    """Run every batch size on arm ``k`` (a one-row table at the next version)."""
    version = readout(url, key)["policy_version"] + 1
    status, reply = push(url, ((None, k),), version, key)
    if status != 200 or reply != [True]:
        raise AssertionError(f"pinning k={k} refused: {status} {reply}")


def set_acceptance(url: str, alpha: float, key: str | None = None) -> None:
    """Set the server's per-position acceptance at run time (SGLang's own
    ``speculative_accept_threshold_acc``: see ``_server.acceptance_threshold``)."""
    status, reply = http(url, "/set_internal_state", {
        "server_args": {"speculative_accept_threshold_acc": acceptance_threshold(alpha)}},
        key=key)  # fmt: skip
    if status != 200 or reply != [True]:
        raise AssertionError(f"setting acceptance {alpha} refused: {status} {reply}")

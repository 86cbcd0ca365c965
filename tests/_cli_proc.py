"""The CLI as a child process, stopped the way systemd and ``docker stop`` stop it."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def cli_process(*argv: str, **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """``python -m tuner.cli ARGV`` with stdout and stderr piped as text; killed on the way
    out if it still runs (a failed assertion, or a process that hung)."""
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def sigterm(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM, then ``(stdout, stderr)`` once it has exited (60 s at most)."""
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=60)

"""``dynspec-tuner sim``: serves until interrupted; bad input exits 2 with a clear message."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest

from tests._fakes import interruptible
from tuner.cli import main


def test_sim_serves_until_interrupted():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tuner.cli", "sim", "--port", "0", "--speed", "20", "--load", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=interruptible,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url, line
        info = httpx.get(url.group(0) + "/server_info", timeout=10).json()
        dynspec = info["internal_states"][0]["dynspec"]
        assert dynspec["arms"] == [0, 1, 3, 5] and info["max_running_requests"] == 48
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()  # never leave a simulator serving after the test
            proc.communicate()
            raise
    assert proc.returncode == 0
    assert "stopped after" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--profile", "nope"], "unknown profile 'nope'"),
        (["--load", "poisson:0"], "rate must be > 0"),
        (["--workload", "poetry"], "unknown workload 'poetry'"),
        (["--speed", "0"], "--speed must be > 0"),
        (["--max-running", "300"], "batch size 272 would be an extrapolation"),
    ],
)
def test_bad_sim_arguments_exit_2(capsys, argv, message):
    assert main(["sim", "--port", "0", *argv]) == 2
    assert message in capsys.readouterr().err

"""benchmarks/steptime_extrapolation.py: the cells it reads are the ones the policy never saw."""

from __future__ import annotations

import math

import pytest

from tests._bench_scripts import load_benchmark


class Table:
    """Bilinear step times, drafting ``jump`` times dearer at ``at`` requests."""

    def __init__(self, jump: float = 1.0, at: int = 64) -> None:
        self.jump, self.at = jump, at

    def step_s(self, b: int, k: int) -> float:
        t = (5 + 0.04 * b + k * (0.5 + 0.06 * b)) / 1000
        return t * self.jump if k and b == self.at else t


def test_errors_are_read_where_no_drafting_arm_ran_and_positive_when_dearer():
    mod = load_benchmark("steptime_extrapolation")
    plain, plain_z = mod.errors(Table(), 16)
    dear, dear_z = mod.errors(Table(jump=2.0), 16)
    assert len(plain) == len(plain_z) == len(mod.ARMS) - 1
    # The policy never saw a drafting cell at 64 requests: its prediction is the same, and
    # the error moves by exactly the jump, in z by the jump over the same spread.
    for e0, e1, z0, z1 in zip(plain, dear, plain_z, dear_z, strict=True):
        assert e1 - e0 == pytest.approx(math.log(2.0), abs=1e-9)
        assert (z1 - z0) * (e1 - e0) > 0
    # A jump inside the drafted range is fed to the policy and moves its prediction: the
    # table at 64 is the plain one, the errors there are not.
    seen, _ = mod.errors(Table(jump=2.0, at=16), 16)
    assert all(abs(s - p) > 0.01 for s, p in zip(seen, plain, strict=True))

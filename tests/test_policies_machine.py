"""The machine's speed, shared by every arm, taken out of the step times only where it moves."""

from __future__ import annotations

import math
import random

import pytest

from policies import Observation
from policies._machine import MachineSpeed

T = {0: 0.010, 1: 0.012, 3: 0.020}  # true step times per arm at eight requests


def _obs(k: int, step_s: float, steps: int = 50) -> Observation:
    return Observation(b=8, k=k, decode_steps=steps, emitted_tokens=8 * steps,
                       accepted_drafts=0, drafted_tokens=8 * steps * k, busy_s=steps * step_s)


def _drive(speed: MachineSpeed, log_speed, seconds: float, arms, rng, jitter=0.03):
    """Readings of ``arms`` in turn for ``seconds`` of busy time on a machine whose log speed
    at busy time t is ``log_speed(t)``; yields (arm, corrected step time)."""
    clock, i = 0.0, 0
    while clock < seconds:
        k = arms[i % len(arms)]
        i += 1
        o = _obs(k, T[k] * math.exp(log_speed(clock) + rng.gauss(0.0, jitter)))
        clock += o.busy_s
        out = speed.correct(o)
        yield k, out.busy_s / out.decode_steps, o


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_steady_machine_passes_readings_unchanged(seed):
    speed, rng = MachineSpeed(5.0, 60.0), random.Random(seed)
    for _, _, raw in _drive(speed, lambda t: 0.0, 300.0, (0, 1, 3, 1), rng):
        pass
    assert speed.drift_var() == 0.0
    # Every reading left as it came: the residuals were the steps' own jitter.
    rng = random.Random(seed)
    speed = MachineSpeed(5.0, 60.0)
    for _, corrected, raw in _drive(speed, lambda t: 0.0, 300.0, (0, 1, 3, 1), rng):
        assert corrected == raw.busy_s / raw.decode_steps


def test_arms_timed_at_different_speeds_of_a_drifting_machine_compare_as_on_a_steady_one():
    # The machine slows by up to 1.8x and back, with a period of two minutes of busy time.
    # Arm 0 runs throughout; arm 1 is tried for ten seconds at the slow peak beside it (as
    # probes interleave). What the policy compares is each arm's mean over its readings.
    def log_speed(t):
        return 0.3 * (1 - math.cos(2 * math.pi * t / 120.0))

    speed, rng = MachineSpeed(5.0, 60.0), random.Random(0)
    logs: dict[str, dict[int, list[float]]] = {"raw": {0: [], 1: []}, "corrected": {0: [], 1: []}}
    for arms, seconds, start in (((0, 3), 55.0, 0.0), ((0, 1), 10.0, 55.0)):
        for k, corrected, raw in _drive(speed, lambda t, s=start: log_speed(t + s), seconds,
                                        arms, rng):  # fmt: skip
            if k in (0, 1):
                logs["raw"][k].append(math.log(raw.busy_s / raw.decode_steps))
                logs["corrected"][k].append(math.log(corrected))
    assert speed.drift_var() > 0

    def ratio(kind: str) -> float:
        mean = {k: sum(v) / len(v) for k, v in logs[kind].items()}
        return math.exp(mean[1] - mean[0])

    truth = T[1] / T[0]
    # Raw, arm 1 looks a third slower against arm 0 than it is; corrected, within 10 %.
    assert ratio("raw") / truth > 1.25
    assert abs(math.log(ratio("corrected") / truth)) < 0.1, ratio("corrected") / truth


def test_equal_readings_of_a_noise_free_server_are_left_alone():
    speed = MachineSpeed(5.0, 60.0)
    for i in range(2000):
        k = (0, 3)[i % 2]
        o = _obs(k, T[k])
        assert speed.correct(o) is o
    assert speed.offset == 0.0


def test_the_model_policy_takes_the_machine_as_steady_when_told_and_refuses_a_bad_memory():
    from policies import make_policy

    assert make_policy("model", arms=(0, 1, 3))._machine is not None
    assert make_policy("model", arms=(0, 1, 3), machine_memory_s=0)._machine is None
    for bad in (-1.0, math.inf):
        with pytest.raises(ValueError, match="machine_memory_s"):
            make_policy("model", arms=(0, 1, 3), machine_memory_s=bad)

"""Workloads: what requests look like — acceptance and lengths — and how that shifts over time.

A :class:`RequestClass` carries the chain-acceptance parameters of ``anchors.md`` §3.3 (the
per-position acceptance probability is ``α·δ^(i−1)``) per acceptance family (dense EAGLE-3
heads vs the seed's Kimi head), and lognormal prompt/output length distributions. A
:class:`Workload` is a sequence of phases, each a weighted mix of classes; it cycles.

Per request the engine draws ``α ~ Beta(κ·ᾱ, κ·(1−ᾱ))`` around the class mean ``ᾱ`` (anchors
§3.3, κ ≈ 20), so acceptance varies between requests as it does in real traffic.

Names for :func:`get_workload`: ``chat``, ``code``, ``summarise`` (alias ``summarize``),
``hard``, ``mixed`` (a fixed blend), ``diverse`` (the same blend with requests far more unlike
each other: κ = 4) and ``shift`` (chat → code → hard, 10 minutes each, then again). A custom shifting workload is written ``"chat:300,code:120,hard:60"`` (class:seconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tuner.errors import ConfigError
from tuner.sim.acceptance import AcceptanceShape

__all__ = [
    "CLASSES",
    "DEFAULT_KAPPA",
    "DIVERSE_KAPPA",
    "DEFAULT_SHIFT_PHASE_S",
    "LengthDist",
    "Phase",
    "RequestClass",
    "Workload",
    "get_workload",
    "list_workloads",
]

# Beta concentration of the per-request α around its class mean (anchors §3.3).
DEFAULT_KAPPA = 20.0
# The ``diverse`` preset: requests that differ far more from each other (one request's α
# sd ≈ 0.19 around a mean of 0.775, against 0.09 at κ = 20).
DIVERSE_KAPPA = 4.0
DEFAULT_SHIFT_PHASE_S = 600.0


@dataclass(frozen=True)
class LengthDist:
    """Lognormal token counts: ``median·exp(σ·Z)``, rounded and clipped to ``[lo, hi]``."""

    median: float
    sigma: float
    lo: int = 1
    hi: int = 32768

    def __post_init__(self) -> None:
        if not (self.median >= 1 and self.sigma >= 0 and 1 <= self.lo <= self.hi):
            raise ValueError(f"bad length distribution {self!r}")

    def sample(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray | int:
        z = rng.standard_normal(n)
        x = np.clip(np.rint(self.median * np.exp(self.sigma * z)), self.lo, self.hi)
        return int(x) if n is None else x.astype(np.int64)

    @property
    def mean(self) -> float:
        """Mean of the unclipped lognormal (close to the clipped one for these presets)."""
        return self.median * math.exp(self.sigma**2 / 2)


@dataclass(frozen=True)
class RequestClass:
    """One kind of request.

    Attributes:
        name: ``chat``, ``code``...
        acceptance: family -> ``(α, δ)``; α the mean first-position acceptance, δ the decay
            per further position.
        prompt, output: token-count distributions.
        shape: per-position acceptance other than the chain, and drift within a request
            (:mod:`tuner.sim.acceptance`); None = the chain ``α·δ^(i−1)`` of ``acceptance``.
    """

    name: str
    acceptance: Mapping[str, tuple[float, float]]
    prompt: LengthDist
    output: LengthDist
    shape: AcceptanceShape | None = None

    def alpha_delta(self, family: str) -> tuple[float, float]:
        try:
            return self.acceptance[family]
        except KeyError:
            raise ConfigError(
                f"request class {self.name!r} has no acceptance preset for {family!r} "
                f"(has {', '.join(self.acceptance)})"
            ) from None


@dataclass(frozen=True)
class Phase:
    """A stretch of time with one mix of request classes (weights need not sum to 1)."""

    duration_s: float
    mix: tuple[tuple[float, RequestClass], ...]

    def __post_init__(self) -> None:
        if not self.mix or any(w <= 0 for w, _ in self.mix):
            raise ValueError("a phase needs at least one class with a positive weight")
        if not self.duration_s > 0:
            raise ValueError(f"phase duration must be > 0, got {self.duration_s}")


@dataclass(frozen=True)
class Workload:
    """Phases that follow each other and then repeat.

    A single phase is a stationary workload (its duration does not matter).
    """

    name: str
    phases: tuple[Phase, ...]
    kappa: float = DEFAULT_KAPPA
    _cum: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a workload needs at least one phase")
        if not self.kappa > 0:
            raise ValueError(f"kappa must be > 0, got {self.kappa}")
        cum, t = [], 0.0
        for p in self.phases:
            t += p.duration_s
            cum.append(t)
        object.__setattr__(self, "_cum", tuple(cum))

    @property
    def period_s(self) -> float:
        return self._cum[-1]

    @property
    def stationary(self) -> bool:
        return len(self.phases) == 1

    def phase_at(self, t: float) -> Phase:
        """The phase in force at virtual time ``t`` (seconds since the start)."""
        if len(self.phases) == 1:
            return self.phases[0]
        t = t % self.period_s
        for end, phase in zip(self._cum, self.phases, strict=True):
            if t < end:
                return phase
        return self.phases[-1]

    def mix_at(self, t: float) -> tuple[tuple[float, RequestClass], ...]:
        """Normalised ``(weight, class)`` pairs in force at ``t``."""
        mix = self.phase_at(t).mix
        total = sum(w for w, _ in mix)
        return tuple((w / total, c) for w, c in mix)

    def sample_class(self, rng: np.random.Generator, t: float) -> RequestClass:
        mix = self.phase_at(t).mix
        if len(mix) == 1:
            return mix[0][1]
        weights = np.array([w for w, _ in mix], dtype=float)
        return mix[int(rng.choice(len(mix), p=weights / weights.sum()))][1]

    def beta_params(self, alpha: float) -> tuple[float, float]:
        """``(a, b)`` of the per-request Beta around mean ``alpha``."""
        return self.kappa * alpha, self.kappa * (1.0 - alpha)


_DENSE_DELTA = 0.973  # anchors §3.3, fitted to vLLM's EAGLE-3 chain sweep


def _cls(
    name: str, dense: float, kimi: float, prompt: LengthDist, output: LengthDist
) -> RequestClass:
    return RequestClass(
        name=name,
        acceptance={"eagle3-dense": (dense, _DENSE_DELTA), "kimi-eagle3": (kimi, 1.0)},
        prompt=prompt,
        output=output,
    )


# α presets: anchors §3.3. Length distributions are illustrative [I]: chat is MT-bench-like,
# summarisation reads a lot and writes little, "hard" is reasoning-style (short in, long out).
CLASSES: dict[str, RequestClass] = {
    "chat": _cls(
        "chat", 0.775, 0.70, LengthDist(512, 0.8, 16, 8192), LengthDist(256, 0.7, 8, 4096)
    ),
    "code": _cls(
        "code", 0.80, 0.75, LengthDist(1024, 0.8, 16, 16384), LengthDist(384, 0.7, 8, 4096)
    ),
    "summarise": _cls(
        "summarise", 0.74, 0.66, LengthDist(2048, 0.6, 64, 16384), LengthDist(192, 0.5, 8, 2048)
    ),
    "hard": _cls(
        "hard", 0.60, 0.55, LengthDist(256, 0.8, 16, 8192), LengthDist(1024, 0.6, 16, 8192)
    ),
}
_ALIASES = {"summarize": "summarise", "summarization": "summarise", "summarisation": "summarise"}


def _single(name: str) -> Workload:
    return Workload(name=name, phases=(Phase(DEFAULT_SHIFT_PHASE_S, ((1.0, CLASSES[name]),)),))


def _presets() -> dict[str, Workload]:
    out = {n: _single(n) for n in CLASSES}
    out["mixed"] = Workload(
        name="mixed",
        phases=(
            Phase(
                DEFAULT_SHIFT_PHASE_S,
                (
                    (0.5, CLASSES["chat"]),
                    (0.3, CLASSES["code"]),
                    (0.1, CLASSES["summarise"]),
                    (0.1, CLASSES["hard"]),
                ),
            ),
        ),
    )
    out["diverse"] = Workload(name="diverse", phases=out["mixed"].phases, kappa=DIVERSE_KAPPA)
    out["shift"] = Workload(
        name="shift",
        phases=tuple(
            Phase(DEFAULT_SHIFT_PHASE_S, ((1.0, CLASSES[n]),)) for n in ("chat", "code", "hard")
        ),
    )
    return out


_PRESETS = _presets()


def list_workloads() -> tuple[str, ...]:
    """Names :func:`get_workload` accepts (besides ``class:seconds,...`` strings)."""
    return tuple(_PRESETS)


def get_workload(name: str) -> Workload:
    """A preset by name, or a shifting workload written ``"chat:300,code:120,hard:60"``.

    Raises:
        ConfigError: unknown name or a malformed phase list.
    """
    if isinstance(name, Workload):
        return name
    key = _ALIASES.get(name, name)
    if key in _PRESETS:
        return _PRESETS[key]
    if ":" in name or "," in name:
        phases = []
        for part in name.split(","):
            part = part.strip()
            cls_name, _, dur = part.partition(":")
            cls_name = _ALIASES.get(cls_name.strip(), cls_name.strip())
            if cls_name not in CLASSES:
                raise ConfigError(
                    f"workload {name!r}: unknown request class {cls_name!r} "
                    f"(known: {', '.join(CLASSES)})"
                )
            try:
                seconds = float(dur) if dur else DEFAULT_SHIFT_PHASE_S
            except ValueError:
                raise ConfigError(f"workload {name!r}: bad duration {dur!r} in {part!r}") from None
            if not seconds > 0 or not math.isfinite(seconds):
                raise ConfigError(f"workload {name!r}: duration must be > 0 in {part!r}")
            phases.append(Phase(seconds, ((1.0, CLASSES[cls_name]),)))
        return Workload(name=name, phases=tuple(phases))
    raise ConfigError(
        f"unknown workload {name!r} (known: {', '.join(_PRESETS)}, or 'chat:300,code:120,...')"
    )

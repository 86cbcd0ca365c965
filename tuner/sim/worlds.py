"""Generated worlds: seeded, physically plausible servers and traffic the bench was not built on.

A :class:`World` is every parameter of one simulated server and its traffic, frozen; world
``i`` of seed ``s`` (:func:`make_world`) is always the same, whatever else is generated. It
gives the engine a cost profile (:class:`WorldProfile`), a workload and a step-time noise,
and the oracle takes its expectations from the same objects, so scoring stays exact.

**Cost** (milliseconds; ``anchors.md`` §3.1 made less regular). A target forward over ``N``
query tokens of ``B`` sequences costs

    launch + (mem^p + comp^p)^(1/p) + kv·B,   mem = w + e·cov(N),   comp = c·N

— a smooth roofline: weight-bound (``mem``) at few tokens, compute-bound past the knee
``N ≈ mem / c``, with ``p`` setting how sharp the turn is. Dense models have ``e = 0``. For a
mixture of experts, ``cov(N) = 1 − (1 − topk/E)^N`` is the share of routed experts a forward
wakes, so a verify of ``B·(k+1)`` tokens reads many more expert weights than a plain step at a
few requests (speculation pays least there) and almost none more at 16–64 (where it pays most).
A speculative step adds verify bookkeeping, ``k`` draft steps ``d_o + d_n·B`` and a draft
extend ``e_o + e_n·N`` (SGLang's order); ``k = 0`` adds the one-token extend. Every forward
pays a fixed CPU ``overhead`` (scheduler, sampling), which favours deeper drafts.

**Acceptance**: a mean first-position acceptance per workload phase, an
:class:`~tuner.sim.acceptance.AcceptanceShape` (chain with δ in [0.85, 1], a horizon cliff,
or rising conditional acceptance; drift within a request), and per-request diversity
``Beta`` concentration κ in [3, 50].

**Traffic over time**: one, two or three workload phases over the run, the mean acceptance
moving between them.

**Noise**: each decode step's time varies by up to 15 % (lognormal, mean one).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tuner.errors import ConfigError
from tuner.sim.acceptance import AcceptanceShape
from tuner.sim.profiles import CostProfile
from tuner.sim.workloads import LengthDist, Phase, RequestClass, Workload

__all__ = [
    "WORLD_FAMILY",
    "World",
    "WorldProfile",
    "make_world",
    "parse_world_range",
]

# The acceptance family of every generated world's request classes and profile.
WORLD_FAMILY = "world"
_KINDS = ("dense", "moe")
# (experts, routed per token) of real MoE families: Mixtral, Qwen-MoE, DeepSeek/Kimi.
_MOE_SHAPES = ((8, 2), (16, 2), (64, 4), (64, 8), (128, 8), (256, 8), (384, 8))
_CAPS = (48, 64, 128, 256)
_PROMPT = LengthDist(512, 0.8, 16, 8192)


@dataclass(frozen=True)
class World:
    """One generated server and its traffic. Times in milliseconds.

    Attributes:
        index, seed: which world of which generator seed.
        kind: ``dense`` or ``moe``.
        launch: per-forward launch / all-reduce time.
        weights: dense (attention, shared-expert) weight-read time per forward.
        experts: routed-expert weight-read time when every expert is woken (0 for dense).
        n_experts, topk: routed experts and experts per token (0, 0 for dense).
        compute: compute time per query token (``c``); the knee is ``weights / compute``.
        sharpness: ``p`` of the smooth roofline (higher = sharper weight/compute turn).
        kv: KV read time per sequence per forward.
        draft_o, draft_n: one draft step, fixed and per sequence.
        extend_o, extend_n: the draft extend, fixed and per token.
        verify_o: verify bookkeeping per speculative step.
        overhead: fixed CPU time per forward.
        noise: σ of the decode step's lognormal time factor (≈ its coefficient of variation).
        alphas: mean first-position acceptance per workload phase.
        shape: position profile and drift of acceptance.
        kappa: per-request Beta concentration around the phase mean.
        output_median: median output tokens.
        max_running: the running-request cap.
    """

    index: int
    seed: int
    kind: str
    launch: float
    weights: float
    experts: float
    n_experts: int
    topk: int
    compute: float
    sharpness: float
    kv: float
    draft_o: float
    draft_n: float
    extend_o: float
    extend_n: float
    verify_o: float
    overhead: float
    noise: float
    alphas: tuple[float, ...]
    shape: AcceptanceShape
    kappa: float
    output_median: float
    max_running: int

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if not self.alphas or not all(0.0 < a < 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be in (0, 1), got {self.alphas}")
        if (self.kind == "moe") != (self.n_experts > 0):
            raise ValueError("a moe world needs experts, a dense one none")

    @property
    def name(self) -> str:
        return f"world-{self.index}"

    def describe(self) -> str:
        """One line: what kind of server and traffic this is."""
        if self.kind == "moe":
            cost = (f"moe E={self.n_experts} top{self.topk}, dense {self.weights:.1f} + "
                    f"experts {self.experts:.1f} ms")
        else:
            cost = f"dense {self.weights:.1f} ms"
        knee = (self.weights + self.experts * self.topk / max(self.n_experts, 1)) / self.compute
        alphas = "→".join(f"{a:.2f}" for a in self.alphas)
        return (f"{self.name} (seed {self.seed}): {cost}, knee {knee:.0f} tok, "
                f"launch {self.launch:.1f} + overhead {self.overhead:.1f} ms, "
                f"noise {100 * self.noise:.0f} %; α {alphas} {self.shape.label()}, "
                f"κ {self.kappa:.0f}; out ~{self.output_median:.0f} tok; cap {self.max_running}")

    def params(self) -> dict[str, Any]:
        """Every parameter, JSON-ready."""
        out = asdict(self)
        out["alphas"] = list(self.alphas)
        return out

    def profile(self) -> WorldProfile:
        return WorldProfile(self)

    def workload(self, total_s: float) -> Workload:
        """The traffic: the phases of :attr:`alphas` in equal parts of ``total_s``."""
        if not total_s > 0:
            raise ValueError(f"total_s must be > 0, got {total_s}")
        # A chain without drift keeps the closed-form oracle; anything else goes by its shape.
        plain = self.shape.kind == "chain" and not self.shape.drift
        output = LengthDist(self.output_median, 0.7, 8, 8192)
        part = total_s / len(self.alphas)
        phases = tuple(
            Phase(part, ((1.0, RequestClass(
                name=f"{self.name}-{i}",
                acceptance={WORLD_FAMILY: (a, self.shape.delta if plain else 1.0)},
                prompt=_PROMPT,
                output=output,
                shape=None if plain else self.shape,
            )),))
            for i, a in enumerate(self.alphas)
        )
        return Workload(name=self.name, phases=phases, kappa=self.kappa)


class WorldProfile(CostProfile):
    """The cost surface of a :class:`World` (see the module docstring)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.name = world.name
        self.description = world.describe()
        self.acceptance = WORLD_FAMILY
        self.max_running = world.max_running
        self.source = f"world:{world.seed}:{world.index}"
        self._cache: dict[tuple[int, int, bool], float] = {}

    def forward_ms(self, n_tokens: float, b: float) -> float:
        """One target forward over ``n_tokens`` query tokens of ``b`` sequences."""
        w = self.world
        mem = w.weights
        if w.n_experts:
            mem += w.experts * (1.0 - (1.0 - w.topk / w.n_experts) ** n_tokens)
        comp = w.compute * n_tokens
        p = w.sharpness
        roof = (mem**p + comp**p) ** (1.0 / p)
        return w.overhead + w.launch + roof + w.kv * b

    def _step_ms(self, b: int, k: int, skip_zero_draft_extend: bool) -> float:
        if b < 1:
            raise ValueError(f"batch size must be >= 1, got {b}")
        w = self.world
        if k == 0:
            ms = self.forward_ms(b, b)
            return ms if skip_zero_draft_extend else ms + w.extend_o + w.extend_n * b
        n = b * (k + 1)
        return (self.forward_ms(n, b) + w.verify_o + k * (w.draft_o + w.draft_n * b)
                + w.extend_o + w.extend_n * n)

    def base_step_s(self, b: int) -> float:
        return self.forward_ms(b, b) / 1000.0

    def prefill_s(self, tokens: int, requests: int = 1) -> float:
        tokens = max(int(tokens), 1)
        w = self.world
        return (self.forward_ms(tokens, requests) + w.extend_o + w.extend_n * tokens) / 1000.0


def _loguniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def make_world(index: int, seed: int = 0) -> World:
    """World ``index`` of generator ``seed``: the same parameters every time.

    Ranges (all drawn independently from a generator seeded by ``(seed, index)``): half the
    worlds MoE (:data:`_MOE_SHAPES`), dense weights 2–15 ms per forward, MoE routed experts
    8–60 ms with a dense part of 0.4–3 ms, the weight/compute knee at 40–400 tokens, a 0–40 % fixed CPU overhead of a
    one-request step, draft steps 4–20 % of it, noise 0–15 %, mean acceptance 0.45–0.9
    shifting by up to ±0.15 in up to three phases, δ 0.85–1, κ 3–50, drift in half the worlds.
    """
    if index < 0 or seed < 0:
        raise ValueError(f"world index and seed must be >= 0, got {index}, {seed}")
    rng = np.random.default_rng([seed, index])
    kind = _KINDS[int(rng.integers(2))]
    launch = _loguniform(rng, 0.3, 3.0)
    weights = _loguniform(rng, 2.0, 15.0)
    if kind == "moe":
        n_experts, topk = _MOE_SHAPES[int(rng.integers(len(_MOE_SHAPES)))]
        # Reading every routed expert takes 8-60 ms (Qwen3-30B-A3B or Mixtral on one H200,
        # DeepSeek-V3 on eight, Kimi-K2.5 INT4 over PCIe: anchors §2.3, §3.2); the dense rest
        # (attention, shared experts) is a small part: 0.4-3 ms.
        experts = _loguniform(rng, 8.0, 60.0)
        weights /= 5.0
    else:
        n_experts = topk = 0
        experts = 0.0
    active = weights + experts * topk / max(n_experts, 1)
    compute = active / _loguniform(rng, 40.0, 400.0)
    sharpness = float(rng.uniform(2.0, 6.0))
    kv = weights * _loguniform(rng, 0.002, 0.03)
    one = launch + weights + experts * topk / max(n_experts, 1)  # about one request's step
    draft_o = one * rng.uniform(0.04, 0.2)
    draft_n = draft_o / _loguniform(rng, 64.0, 512.0)
    extend_o = draft_o * rng.uniform(0.6, 1.2)
    extend_n = compute * rng.uniform(0.03, 0.15)
    verify_o = one * rng.uniform(0.02, 0.1)
    overhead = one * rng.uniform(0.0, 0.4)
    noise = float(rng.uniform(0.0, 0.15))
    alpha0 = float(rng.uniform(0.45, 0.9))
    n_phases = int(rng.choice([1, 2, 3], p=[0.4, 0.35, 0.25]))
    alphas = [alpha0] + [
        float(np.clip(alpha0 + rng.uniform(-0.15, 0.15), 0.35, 0.92))
        for _ in range(n_phases - 1)
    ]
    shape_kind = str(rng.choice(["chain", "horizon", "rising"], p=[0.5, 0.25, 0.25]))
    delta = float(rng.uniform(0.85, 1.0))
    drift = float(rng.uniform(-0.4, 0.4)) if rng.random() < 0.5 else 0.0
    shape = AcceptanceShape(
        kind=shape_kind,
        delta=delta if shape_kind != "rising" else 1.0,
        horizon=int(rng.integers(1, 5)),
        cliff=float(rng.uniform(0.5, 0.9)),
        # Rejection shrinking 3-25 % a position: vLLM PR 24243's per-position acceptance
        # (anchors §3.3) has it shrink ~10 % a position.
        rise=float(rng.uniform(0.75, 0.97)),
        drift=round(drift, 3),
    )
    return World(
        index=index, seed=seed, kind=kind, launch=launch, weights=weights, experts=experts,
        n_experts=n_experts, topk=topk, compute=compute, sharpness=sharpness, kv=kv,
        draft_o=draft_o, draft_n=draft_n, extend_o=extend_o, extend_n=extend_n,
        verify_o=verify_o, overhead=overhead, noise=noise,
        alphas=tuple(round(a, 4) for a in alphas), shape=shape,
        kappa=_loguniform(rng, 3.0, 50.0),
        output_median=_loguniform(rng, 96.0, 1024.0),
        max_running=int(rng.choice(_CAPS)),
    )


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_world_range(spec: str) -> tuple[int, ...]:
    """World indices from ``"50"`` (worlds 0–49), ``"0-49"``, ``"50-99"`` or ``"3,7,10-12"``.

    A bare number alone is a count; inside a comma list it is one index (``"3,7"`` = worlds
    3 and 7). Ranges are inclusive; repeats are dropped.

    Raises:
        ConfigError: anything else, naming the bad part.
    """
    parts = str(spec).split(",")
    out: list[int] = []
    for part in parts:
        m = _RANGE.match(part)
        if not m:
            raise ConfigError(
                f"bad world range {spec!r}: {part!r} is not N, A-B or a comma list of them"
            )
        lo, hi = int(m.group(1)), m.group(2)
        if hi is None:
            if len(parts) == 1:
                if lo < 1:
                    raise ConfigError(f"bad world range {spec!r}: a count must be >= 1")
                out.extend(range(lo))
            else:
                out.append(lo)
            continue
        if int(hi) < lo:
            raise ConfigError(f"bad world range {spec!r}: {part!r} ends before it starts")
        out.extend(range(lo, int(hi) + 1))
    return tuple(dict.fromkeys(out))

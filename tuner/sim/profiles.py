"""Cost profiles: how long one forward of the target and draft models takes.

A profile answers three questions for the engine and the oracle:

- :meth:`CostProfile.step_s` — seconds of one decode step of ``b`` requests at arm ``k``;
- :meth:`CostProfile.base_step_s` — the same step with speculation off entirely;
- :meth:`CostProfile.prefill_s` — seconds of a prefill forward over ``tokens`` prompt tokens.

Two kinds exist, both loadable from files a user can write:

- a **cost table** (JSON lines, the format of ``shared/calibration/``): rows
  ``{"kind": "cost", "b": B, "q": Q, "target_ms": T, "draft_ms": D}`` where ``q`` is query
  tokens per sequence, plus an optional ``{"kind": "info", ...}`` row. A speculative step of
  ``k`` draft steps costs ``k·draft(b,1) + target(b,k+1) + draft(b,k+1)`` (draft steps,
  verify, draft extend); ``k = 0`` costs ``target(b,1) + draft(b,1)`` by default (SGLang still
  runs the draft extend) and ``target(b,1)`` when the extend is skipped. Values are linear
  interpolations in ``q`` within a measured ``b`` and then in ``b``; a batch size or ``q``
  beyond the table is refused unless the profile was loaded with ``extrapolate="clamp"`` or
  ``"linear"``.
- a **parametric** profile (one JSON object, ``"kind": "parametric"``): the step-time model of
  ``anchors.md`` §3.1 with named millisecond coefficients.

Shipped profiles (:func:`list_profiles`): ``h200-llama8b`` (measured table), ``h100-llama8b``
(anchors P1, fitted to EAGLE-3's SGLang table), ``seed-kimi-pcie`` (anchors P3, the seed's
8×RTX PRO 6000 box with Kimi-K2.5), and two measured mixture-of-experts tables,
``h200-moe-qwen3-30b-a3b`` (128 experts, top-8) and ``h200-moe-mixtral-8x7b`` (8 experts,
top-2), where a verify of ``k+1`` tokens per request touches more experts at few requests.
``h200-llama8b-q16`` and ``h200-moe-qwen3-30b-a3b-q16`` are the same shapes measured again with
``q`` up to 16, for tree verifies of 16 draft tokens.
"""

from __future__ import annotations

import abc
import json
import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from tuner.calibrate._table import number_field, parse_table
from tuner.errors import ConfigError

__all__ = [
    "ACCEPTANCE_FAMILIES",
    "DEFAULT_ACCEPTANCE_FAMILY",
    "EXTRAPOLATE_MODES",
    "CostProfile",
    "ParametricProfile",
    "ProfileRangeError",
    "TableProfile",
    "list_profiles",
    "load_profile",
]

# Which acceptance presets of a workload apply (anchors §3.3): dense EAGLE-3 heads
# (Llama-class) or the Kimi-K2.5 EAGLE-3 head of the seed's box.
ACCEPTANCE_FAMILIES = ("eagle3-dense", "kimi-eagle3")
DEFAULT_ACCEPTANCE_FAMILY = "eagle3-dense"
EXTRAPOLATE_MODES = ("refuse", "clamp", "linear")

_SHIPPED = {
    "h200-llama8b": "h200-llama8b.jsonl",
    "h100-llama8b": "h100-llama8b.json",
    "seed-kimi-pcie": "seed-kimi-pcie.json",
    "h200-moe-qwen3-30b-a3b": "h200-moe-qwen3-30b-a3b.jsonl",
    "h200-moe-mixtral-8x7b": "h200-moe-mixtral-8x7b.jsonl",
    # Re-measured up to 16 tokens per request, so an EAGLE tree of 16 draft tokens is scored
    # on measured verify times rather than refused (the tables above stop at q = 8).
    "h200-llama8b-q16": "h200-llama8b-q16.jsonl",
    "h200-moe-qwen3-30b-a3b-q16": "h200-moe-qwen3-30b-a3b-q16.jsonl",
}


class ProfileRangeError(ConfigError):
    """A batch size or query length outside what a cost table measured."""


class CostProfile(abc.ABC):
    """Seconds per forward for one hardware + model pair.

    Attributes:
        name: short name (``h200-llama8b`` or the file stem).
        description: one line for humans.
        acceptance: the acceptance family (a key of :data:`ACCEPTANCE_FAMILIES`) whose
            workload presets fit this model's draft head.
        max_running: the running-request cap the profile was measured/fitted with, or None
            (the engine then uses SGLang's EAGLE default of 48).
        source: where it came from (a path, or ``builtin:NAME``).
    """

    name: str
    description: str
    acceptance: str
    max_running: int | None
    source: str

    _cache: dict[tuple[int, int, bool], float]

    def step_s(self, b: int, k: int, *, skip_zero_draft_extend: bool = False) -> float:
        """Seconds of one decode step of ``b`` requests launched with ``k`` draft steps.

        ``b`` is the batch size the forward runs at (after CUDA-graph padding). Memoised: the
        engine asks for the same few cells at every step.

        Raises:
            ProfileRangeError: ``b`` or ``k`` outside a table that refuses extrapolation.
        """
        key = (b, k, skip_zero_draft_extend)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if k < 0:
            raise ValueError(f"arm k must be >= 0, got {k}")
        out = self._cache[key] = self._step_ms(b, k, skip_zero_draft_extend) / 1000.0
        return out

    @abc.abstractmethod
    def _step_ms(self, b: int, k: int, skip_zero_draft_extend: bool) -> float:
        """:meth:`step_s` in milliseconds, uncached (``k >= 0``)."""

    @abc.abstractmethod
    def base_step_s(self, b: int) -> float:
        """Seconds of one decode step with speculation off entirely (target forward only)."""

    @abc.abstractmethod
    def prefill_s(self, tokens: int, requests: int = 1) -> float:
        """Seconds of one prefill forward over ``tokens`` prompt tokens of ``requests``."""

    @property
    def max_batch(self) -> int | None:
        """The largest batch size the profile answers for, or None when unbounded."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} from {self.source}>"


# --- measured cost tables -------------------------------------------------------------------


@dataclass(frozen=True)
class _BRow:
    b: int
    q: tuple[int, ...]
    target_ms: tuple[float, ...]
    draft_ms: tuple[float, ...]


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    i = bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i == 0:
        i = 1
    elif i == len(xs):
        i = len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class TableProfile(CostProfile):
    """A measured cost table (JSON lines, ``shared/calibration/`` format).

    Args:
        rows: ``(b, q, target_ms, draft_ms)`` tuples; every ``b`` needs ``q = 1`` and at
            least one ``q >= 2`` only if speculative arms are used.
        name, description, acceptance, max_running, source: see :class:`CostProfile`.
        extrapolate: ``"refuse"`` (default) raises :class:`ProfileRangeError` outside the
            measured range; ``"clamp"`` uses the nearest measured value; ``"linear"``
            continues the last segment.
        prefill_ms_per_token: marginal prefill cost; derived from the table's largest
            forward when None.
    """

    def __init__(
        self,
        *,
        rows: list[tuple[int, int, float, float]],
        name: str,
        description: str = "",
        acceptance: str = DEFAULT_ACCEPTANCE_FAMILY,
        max_running: int | None = None,
        source: str = "<memory>",
        extrapolate: str = "refuse",
        prefill_ms_per_token: float | None = None,
    ) -> None:
        if extrapolate not in EXTRAPOLATE_MODES:
            raise ConfigError(
                f"extrapolate must be one of {EXTRAPOLATE_MODES}, got {extrapolate!r}"
            )
        if acceptance not in ACCEPTANCE_FAMILIES:
            raise ConfigError(
                f"{source}: acceptance must be one of {ACCEPTANCE_FAMILIES}, got {acceptance!r}"
            )
        if not rows:
            raise ConfigError(f'{source}: no cost rows (kind "cost")')
        self.name = name
        self.description = description
        self.acceptance = acceptance
        self.max_running = max_running
        self.source = source
        self.extrapolate = extrapolate
        by_b: dict[int, dict[int, tuple[float, float]]] = {}
        for b, q, t, d in rows:
            if q in by_b.setdefault(b, {}):
                raise ConfigError(f"{source}: duplicate cost row for b={b}, q={q}")
            by_b[b][q] = (t, d)
        self._rows: list[_BRow] = []
        for b in sorted(by_b):
            qs = tuple(sorted(by_b[b]))
            if qs[0] != 1:
                raise ConfigError(f"{source}: b={b} has no q=1 row (needed for every batch size)")
            self._rows.append(
                _BRow(
                    b,
                    qs,
                    tuple(by_b[b][q][0] for q in qs),
                    tuple(by_b[b][q][1] for q in qs),
                )
            )
        self._bs = tuple(r.b for r in self._rows)
        if prefill_ms_per_token is None:
            # Marginal cost per token of the largest measured forward: prefill is compute
            # bound like a wide verify forward, and the table has nothing closer.
            big = max(
                (
                    (r.b * q, r.target_ms[i] + r.draft_ms[i])
                    for r in self._rows
                    for i, q in enumerate(r.q)
                ),
            )
            small = self._rows[0].target_ms[0] + self._rows[0].draft_ms[0]
            tokens = big[0] - self._rows[0].b
            prefill_ms_per_token = (big[1] - small) / tokens if tokens > 0 else 0.0
        self.prefill_ms_per_token = float(prefill_ms_per_token)
        self._cache: dict[tuple[int, int, bool], float] = {}

    @property
    def max_batch(self) -> int | None:
        return None if self.extrapolate != "refuse" else self._bs[-1]

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The measured batch sizes."""
        return self._bs

    def max_q(self, b: int) -> int:
        """Largest measured ``q`` usable at batch size ``b`` (the min over bracketing rows)."""
        lo, hi = self._bracket(b)
        return min(lo.q[-1], hi.q[-1])

    def _bracket(self, b: float) -> tuple[_BRow, _BRow]:
        bs = self._bs
        if b < bs[0] or b > bs[-1]:
            if self.extrapolate == "refuse":
                raise ProfileRangeError(
                    f"profile {self.name!r} ({self.source}) measured batch sizes "
                    f"{bs[0]}..{bs[-1]}; batch size {b} would be an extrapolation "
                    "(allow extrapolation: --extrapolate clamp|linear, or extrapolate= in "
                    "load_profile; "
                    "or lower the running-request cap)"
                )
        i = bisect_left(bs, b)
        if i < len(bs) and bs[i] == b:
            return self._rows[i], self._rows[i]
        if len(bs) == 1:
            return self._rows[0], self._rows[0]
        i = min(max(i, 1), len(bs) - 1)
        return self._rows[i - 1], self._rows[i]

    def _at_row(self, row: _BRow, q: int, which: str) -> float:
        if q > row.q[-1]:
            if self.extrapolate == "refuse":
                raise ProfileRangeError(
                    f"profile {self.name!r} ({self.source}) measured q up to {row.q[-1]} at "
                    f"b={row.b}; q={q} (arm k={q - 1}) would be an extrapolation"
                )
            if self.extrapolate == "clamp":
                q = row.q[-1]
        ys = row.target_ms if which == "target" else row.draft_ms
        if len(row.q) == 1:
            return ys[0]
        return _interp(row.q, ys, q)

    def _ms(self, b: float, q: int, which: str) -> float:
        lo, hi = self._bracket(b)
        if self.extrapolate == "clamp":
            b = min(max(b, self._bs[0]), self._bs[-1])
        y0 = self._at_row(lo, q, which)
        if lo is hi:
            return y0
        y1 = self._at_row(hi, q, which)
        return y0 + (y1 - y0) * (b - lo.b) / (hi.b - lo.b)

    def target_ms(self, b: float, q: int) -> float:
        """Interpolated target forward time, ms."""
        return self._ms(b, q, "target")

    def draft_ms(self, b: float, q: int) -> float:
        """Interpolated draft forward time, ms."""
        return self._ms(b, q, "draft")

    def _step_ms(self, b: int, k: int, skip_zero_draft_extend: bool) -> float:
        if k == 0:
            ms = self.target_ms(b, 1)
            return ms if skip_zero_draft_extend else ms + self.draft_ms(b, 1)
        return k * self.draft_ms(b, 1) + self.target_ms(b, k + 1) + self.draft_ms(b, k + 1)

    def base_step_s(self, b: int) -> float:
        return self.target_ms(b, 1) / 1000.0

    def prefill_s(self, tokens: int, requests: int = 1) -> float:
        first = self._rows[0]
        fixed = first.target_ms[0] + first.draft_ms[0]
        return (fixed + self.prefill_ms_per_token * max(tokens - 1, 0)) / 1000.0


# --- parametric model (anchors §3.1) --------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ParametricProfile(CostProfile):
    """The step-time model of ``anchors.md`` §3.1, coefficients in milliseconds.

    A forward over ``N`` query tokens of ``B`` sequences costs
    ``t_o + t_w + t_e·cov(N) + c_f·N + kv`` with ``cov(N) = 1 − (1 − expert_frac)^N`` (routed
    expert weights read; 0 for dense models) and ``kv = kv_seq·B`` (KV read once per
    sequence) — except a verify forward when ``verify_kv_factor`` φ > 0, which reads KV per
    query token: ``kv = kv_seq·φ·N`` (anchors P3).

    A spec step adds ``v_o`` (verify bookkeeping), ``k·(d_o + d_n·B)`` (draft steps) and
    ``e_o + e_n·B·(k+1)`` (draft extend); ``k = 0`` adds only the extend of one token,
    ``e_o + e_n·B``, unless it is skipped.
    """

    name: str
    t_o: float
    t_w: float
    c_f: float
    kv_seq: float
    d_o: float
    e_o: float
    v_o: float
    d_n: float
    e_n: float
    t_e: float = 0.0
    expert_frac: float = 0.0
    verify_kv_factor: float = 0.0
    description: str = ""
    acceptance: str = DEFAULT_ACCEPTANCE_FAMILY
    max_running: int | None = None
    source: str = "<memory>"
    # Not an init field: dataclasses.replace must not hand a copy the original's memo.
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("name", "description", "acceptance", "max_running", "source", "_cache"):
                continue
            v = getattr(self, f.name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ):
                raise ConfigError(
                    f"{self.source}: field {f.name!r} must be a number >= 0, got {v!r}"
                )
        if self.expert_frac > 1:
            raise ConfigError(
                f"{self.source}: field 'expert_frac' must be in [0, 1], got {self.expert_frac}"
            )
        if self.acceptance not in ACCEPTANCE_FAMILIES:
            raise ConfigError(
                f"{self.source}: field 'acceptance' must be one of {ACCEPTANCE_FAMILIES}, "
                f"got {self.acceptance!r}"
            )
        if self.max_running is not None and (
            isinstance(self.max_running, bool)
            or not isinstance(self.max_running, int)
            or self.max_running < 1
        ):
            raise ConfigError(
                f"{self.source}: field 'max_running' must be an integer >= 1, "
                f"got {self.max_running!r}"
            )

    def _fwd_ms(self, n_tokens: float, b: float, *, verify: bool) -> float:
        cov = 1.0 - (1.0 - self.expert_frac) ** n_tokens if self.expert_frac > 0 else 0.0
        if verify and self.verify_kv_factor > 0:
            kv = self.kv_seq * self.verify_kv_factor * n_tokens
        else:
            kv = self.kv_seq * b
        return self.t_o + self.t_w + self.t_e * cov + self.c_f * n_tokens + kv

    def _step_ms(self, b: int, k: int, skip_zero_draft_extend: bool) -> float:
        if b < 1:
            raise ValueError(f"batch size must be >= 1, got {b}")
        if k == 0:
            ms = self._fwd_ms(b, b, verify=False)
            if not skip_zero_draft_extend:
                ms += self.e_o + self.e_n * b
        else:
            n = b * (k + 1)
            ms = (
                self._fwd_ms(n, b, verify=True)
                + self.v_o
                + k * (self.d_o + self.d_n * b)
                + self.e_o
                + self.e_n * n
            )
        return ms

    def base_step_s(self, b: int) -> float:
        return self._fwd_ms(b, b, verify=False) / 1000.0

    def prefill_s(self, tokens: int, requests: int = 1) -> float:
        tokens = max(int(tokens), 1)
        ms = (
            self.t_o
            + self.t_w
            + (
                self.t_e * (1.0 - (1.0 - self.expert_frac) ** tokens)
                if self.expert_frac > 0
                else 0.0
            )
            + self.c_f * tokens
            + self.e_o
            + self.e_n * tokens
        )
        return ms / 1000.0


_PARAM_FIELDS = {f.name for f in fields(ParametricProfile) if f.name not in ("source", "_cache")}


# --- loading --------------------------------------------------------------------------------


def list_profiles() -> tuple[str, ...]:
    """Names of the shipped profiles."""
    return tuple(_SHIPPED)


def load_profile(spec: str | Path, *, extrapolate: str = "refuse") -> CostProfile:
    """Load a shipped profile by name, or a profile file by path.

    Args:
        spec: ``h200-llama8b``, ``h100-llama8b``, ``seed-kimi-pcie``, or a path to a JSON-lines
            cost table (``.jsonl``) or a parametric profile (one JSON object).
        extrapolate: for cost tables: ``"refuse"``, ``"clamp"`` or ``"linear"``.

    Raises:
        ConfigError: unknown name, unreadable file, or a bad field (the message names the file,
            line and field).
    """
    spec_s = str(spec)
    if spec_s in _SHIPPED:
        res = resources.files("tuner.sim").joinpath("profiles", _SHIPPED[spec_s])
        text = res.read_text(encoding="utf-8")
        return _parse(
            text, source=f"builtin:{spec_s}", default_name=spec_s, extrapolate=extrapolate
        )
    path = Path(spec_s)
    if not path.exists():
        raise ConfigError(
            f"unknown profile {spec_s!r}: not a shipped profile ({', '.join(_SHIPPED)}) "
            "and no such file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read profile file {path}: {exc}") from exc
    return _parse(text, source=str(path), default_name=path.stem, extrapolate=extrapolate)


def _parse(text: str, *, source: str, default_name: str, extrapolate: str) -> CostProfile:
    stripped = text.strip()
    if not stripped:
        raise ConfigError(f"{source}: profile file is empty")
    # One JSON object spanning the file = parametric; otherwise JSON lines.
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and obj.get("kind") == "parametric":
            return _parametric(obj, source=source, default_name=default_name)
    return _table(text, source=source, default_name=default_name, extrapolate=extrapolate)


def _parametric(obj: Mapping[str, Any], *, source: str, default_name: str) -> ParametricProfile:
    kw = {k: v for k, v in obj.items() if k not in ("kind", "comment", "notes", "fitted_to")}
    unknown = sorted(set(kw) - _PARAM_FIELDS)
    if unknown:
        raise ConfigError(
            f"{source}: unknown field {unknown[0]!r} in parametric profile "
            f"(known: {', '.join(sorted(_PARAM_FIELDS))})"
        )
    kw.setdefault("name", default_name)
    for f in fields(ParametricProfile):
        if f.name in ("source", "_cache"):
            continue
        if f.default is MISSING and f.default_factory is MISSING and f.name not in kw:
            raise ConfigError(f"{source}: parametric profile lacks field {f.name!r}")
    if not isinstance(kw["name"], str):
        raise ConfigError(f"{source}: field 'name' must be a string")
    return ParametricProfile(source=source, **kw)


def _table(text: str, *, source: str, default_name: str, extrapolate: str) -> TableProfile:
    table = parse_table(text, source=source)
    info = table.info
    rows = [(r.b, r.q, r.target_ms, r.draft_ms) for r in table.rows]
    max_running = info.get("max_running")
    if max_running is not None:
        max_running = number_field(info, "max_running", f"{source} (info row)", integer=True)
    pmt = info.get("prefill_ms_per_token")
    if pmt is not None:
        pmt = number_field(info, "prefill_ms_per_token", f"{source} (info row)", positive=True)
    name = info.get("name", default_name)
    if not isinstance(name, str):
        raise ConfigError(f"{source} (info row): field 'name' must be a string")
    return TableProfile(
        rows=rows,
        name=name,
        description=str(info.get("description", "")),
        acceptance=str(info.get("acceptance", DEFAULT_ACCEPTANCE_FAMILY)),
        max_running=max_running,
        source=source,
        extrapolate=extrapolate,
        prefill_ms_per_token=pmt,
    )

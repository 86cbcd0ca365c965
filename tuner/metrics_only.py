"""Metrics-only mode: coarse observations from a stock SGLang server (no dynspec plugin).

Without the plugin there are no per-``(b, k)`` counters; what stock SGLang 0.5.23 offers is

- ``GET /metrics`` (Prometheus text, needs ``--enable-metrics``), counters updated every
  decode iteration: ``sglang:realtime_tokens_total{mode="decode"}`` (tokens emitted by decode
  steps) and ``sglang:cuda_graph_passes_total{mode="decode_cuda_graph"|"decode_none"}`` (decode
  steps); gauges set only every ``--decode-log-interval`` (40) decode batches:
  ``sglang:num_running_reqs`` (batch size at that tick), ``sglang:spec_num_steps`` (the live
  draft depth) and ``sglang:spec_accept_length`` (window mean, bonus token included);
- ``GET /v1/loads`` (JSON), per DP rank ``decode_moments`` = cumulative
  ``[n, Σbs, Σstep_us, Σbs², Σbs·step_us, Σgenerated]`` over contiguous decode launches.

:class:`MetricsSampler` turns two successive readings into at most one :class:`Observation`
per DP replica, attributed to the arm the server ran at both ends of the interval. It is pure
(the caller fetches the texts and passes the time) and never pushes anything.

How coarse it is, and why:

- With ``/v1/loads`` the interval's decode steps, busy time (launch-to-launch, contiguous
  decodes only), emitted tokens and mean batch size are exact; accepted drafts are
  ``Σgenerated − Σbs`` (one bonus token per request per step).
- With ``/metrics`` alone busy time is the wall-clock interval (prefill and idle time
  included, so goodput reads low, equally for every arm), the batch size is the mean of the
  gauge at both ends, and accepted drafts come from the accept-length gauge.
- An interval in which the arm changed (gauge differs at the ends), the batch size spread
  over several buckets, the counters went backwards (restart) or too few steps ran yields no
  observation; stock adaptive SGLang may still switch and switch back between two readings,
  which this cannot see.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from policies import Buckets, Observation
from tuner.errors import MalformedReplyError

__all__ = [
    "DEFAULT_MAX_BS_RSD",
    "DEFAULT_MIN_STEPS",
    "LOADS_PATH",
    "METRICS_PATH",
    "DecodeMoments",
    "MetricsReading",
    "MetricsSampler",
    "metrics_only_notice",
    "parse_loads",
    "parse_metrics",
]

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
# ``core`` carries decode_moments, ``spec`` the lifetime accept length.
LOADS_PATH = "/v1/loads?include=core,spec"

# An interval with fewer decode steps is extended rather than recorded: the gauges refresh
# only every 40 decode batches, so fewer steps say little about the batch size.
DEFAULT_MIN_STEPS = 40
# Relative standard deviation of the batch size within an interval above which the interval
# mixes too many batch sizes to be credited to one (needs decode_moments to be known).
DEFAULT_MAX_BS_RSD = 0.5

_DECODE_PASS_MODES = ("decode_cuda_graph", "decode_none")


def metrics_only_notice(server: str) -> str:
    """What the daemon tells the user, once, about a server without the plugin."""
    return (
        f"{server}: no \"dynspec\" section in /server_info (stock SGLang, or the plugin's "
        "hooks did not load). Learning from /metrics and /v1/loads only: coarse per-interval "
        "batch sizes, only the arm the server runs now, and no table can be pushed. "
        "To enable per-batch control, install dynspec-tuner into the server's Python "
        "environment (pip install dynspec-tuner; SGLang loads it through the "
        "'sglang.srt.plugins' entry point, SGLANG_PLUGINS=dynspec to whitelist it) and start "
        "the server with --enable-metrics --speculative-adaptive "
        "--speculative-adaptive-config pointing to {\"1\": {\"candidate_steps\": ARMS}} "
        "(`dynspec-tuner sglang-args` prints the flags)."
    )


@dataclass(frozen=True, slots=True)
class DecodeMoments:
    """``/v1/loads`` ``decode_moments`` of one DP rank (cumulative since start)."""

    n: float
    sum_bs: float
    sum_step_us: float
    sum_bs2: float
    sum_bs_step_us: float
    sum_generated: float

    @classmethod
    def from_json(cls, raw: object) -> DecodeMoments:
        if not isinstance(raw, list) or len(raw) != 6:
            raise ValueError(f"decode_moments must be a list of 6 numbers, got {raw!r}")
        vals = []
        for v in raw:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"decode_moments must hold finite numbers, got {raw!r}")
            vals.append(float(v))
        return cls(*vals)


@dataclass(frozen=True, slots=True)
class MetricsReading:
    """What one scrape says about one DP replica; None where the server did not say."""

    dp_rank: int
    decode_tokens: float | None = None  # realtime_tokens_total{mode="decode"}
    decode_passes: float | None = None  # cuda_graph_passes_total{mode=decode_*}
    running_reqs: float | None = None  # num_running_reqs gauge
    spec_num_steps: int | None = None  # spec_num_steps gauge
    spec_accept_length: float | None = None  # spec_accept_length gauge
    moments: DecodeMoments | None = None  # from /v1/loads


def _series_key(labels: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(dp_rank, tp_rank, pp_rank) of a scheduler series; None for one to ignore."""
    if labels.get("priority", "") != "":  # per-priority breakdown, not the total
        return None
    try:
        return (
            int(labels.get("dp_rank", 0) or 0),
            int(labels.get("tp_rank", 0) or 0),
            int(labels.get("pp_rank", 0) or 0),
        )
    except ValueError:
        return None


def parse_metrics(text: str) -> dict[int, MetricsReading]:
    """Parse SGLang's ``/metrics`` text into one reading per DP rank.

    Only the scheduler series of the lowest TP/PP rank of each DP rank are used (only TP rank
    0 reports unless ``--enable-metrics-for-all-schedulers``). DP ranks that report none of the
    decode counters are left out.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    fields: dict[tuple[int, int, int], dict[str, float]] = {}

    def put(key: tuple[int, int, int] | None, name: str, value: float, add: bool = False) -> None:
        if key is None or not math.isfinite(value):
            return
        slot = fields.setdefault(key, {})
        slot[name] = slot.get(name, 0.0) + value if add else value

    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, IndexError, TypeError ...
        raise ValueError(f"not Prometheus text format: {exc}") from exc
    # Families present, even without samples: prometheus_client lists a labelled counter's
    # HELP/TYPE before its first increment, which then reads as 0.
    known = {family.name for family in families}
    for family in families:
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == "sglang:realtime_tokens_total" and labels.get("mode") == "decode":
                put(_series_key(labels), "decode_tokens", value)
            elif (
                name == "sglang:cuda_graph_passes_total"
                and labels.get("mode") in _DECODE_PASS_MODES
            ):
                put(_series_key(labels), "decode_passes", value, add=True)
            elif name == "sglang:num_running_reqs":
                put(_series_key(labels), "running_reqs", value)
            elif name == "sglang:spec_num_steps":
                put(_series_key(labels), "spec_num_steps", value)
            elif name == "sglang:spec_accept_length":
                put(_series_key(labels), "spec_accept_length", value)

    out: dict[int, MetricsReading] = {}
    for key in sorted(fields):
        dp = key[0]
        if dp in out:
            continue  # a higher TP/PP rank of a DP rank already read
        f = fields[key]
        steps = f.get("spec_num_steps")
        out[dp] = MetricsReading(
            dp_rank=dp,
            decode_tokens=f.get(
                "decode_tokens", 0.0 if "sglang:realtime_tokens" in known else None
            ),
            decode_passes=f.get(
                "decode_passes", 0.0 if "sglang:cuda_graph_passes" in known else None
            ),
            running_reqs=f.get("running_reqs"),
            spec_num_steps=None if steps is None else int(round(steps)),
            spec_accept_length=f.get("spec_accept_length"),
        )
    return out


def parse_loads(obj: object) -> dict[int, DecodeMoments]:
    """``/v1/loads`` JSON -> decode moments per DP rank (ranks without moments left out).

    Raises:
        ValueError: the reply is not shaped as SGLang 0.5.23 shapes it.
    """
    if not isinstance(obj, Mapping) or not isinstance(obj.get("loads"), list):
        raise ValueError("expected an object with a 'loads' list")
    out: dict[int, DecodeMoments] = {}
    for entry in obj["loads"]:
        if not isinstance(entry, Mapping):
            raise ValueError(f"each load must be an object, got {entry!r}")
        raw = entry.get("decode_moments")
        if raw is None:
            continue  # no decode step yet
        dp = entry.get("dp_rank", 0)
        if isinstance(dp, bool) or not isinstance(dp, int):
            raise ValueError(f"dp_rank must be an integer, got {dp!r}")
        out[dp] = DecodeMoments.from_json(raw)
    return out


@dataclass(frozen=True, slots=True)
class _Baseline:
    at: float
    reading: MetricsReading


class MetricsSampler:
    """Turns successive ``/metrics`` (+ ``/v1/loads``) readings into coarse observations.

    One instance per server. Call :meth:`observe` once per tick with what the server returned;
    the first call only sets a baseline.

    Args:
        server: the server's address, for error messages.
        buckets: the daemon's buckets; an interval whose batch sizes straddle two buckets is
            dropped.
        min_steps: decode steps an interval needs before it is recorded (a shorter one is
            extended to the next reading).
        max_bs_rsd: largest relative standard deviation of the batch size within an interval
            (known only with ``/v1/loads``).
    """

    def __init__(
        self,
        *,
        server: str,
        buckets: Buckets | None = None,
        min_steps: int = DEFAULT_MIN_STEPS,
        max_bs_rsd: float = DEFAULT_MAX_BS_RSD,
    ) -> None:
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {min_steps}")
        if not max_bs_rsd > 0:
            raise ValueError(f"max_bs_rsd must be > 0, got {max_bs_rsd}")
        self.server = server
        self.buckets = buckets or Buckets()
        self.min_steps = min_steps
        self.max_bs_rsd = max_bs_rsd
        self._base: dict[int, _Baseline] = {}
        self.restarts = 0
        # Why the last interval per DP rank gave no observation (for status lines and tests).
        self.last_skip: dict[int, str] = {}

    def observe(
        self, metrics_text: str, loads_json: object | None = None, *, now: float
    ) -> list[Observation]:
        """Feed one reading; returns the observations of the interval it closes (maybe none).

        Args:
            metrics_text: the body of ``GET /metrics``.
            loads_json: the parsed body of ``GET /v1/loads?include=core,spec``, or None when
                the server did not serve it.
            now: the time of the reading, seconds (any clock, as long as it is the same one
                on every call).

        Raises:
            MalformedReplyError: a reply that is not what SGLang sends (the baseline is kept).
        """
        try:
            readings = parse_metrics(metrics_text)
        except ValueError as exc:
            raise MalformedReplyError(self.server, f"/metrics: {exc}") from exc
        if loads_json is not None:
            try:
                moments = parse_loads(loads_json)
            except ValueError as exc:
                raise MalformedReplyError(self.server, f"/v1/loads: {exc}") from exc
            readings = {
                dp: _with_moments(r, moments.get(dp)) for dp, r in readings.items()
            }
        if not readings:
            raise MalformedReplyError(
                self.server,
                "/metrics has no SGLang scheduler metrics (sglang:num_running_reqs, "
                "sglang:realtime_tokens_total ...): is the server started with --enable-metrics?",
            )
        out: list[Observation] = []
        for dp, reading in readings.items():
            base = self._base.get(dp)
            if base is None or now <= base.at:
                self._base[dp] = _Baseline(now, reading)
                continue
            obs, reason, rebase = self._interval(base, reading, now)
            if obs is not None:
                out.append(obs)
                self.last_skip.pop(dp, None)
            elif reason is not None:
                self.last_skip[dp] = reason
                log.debug("%s dp%d: no observation: %s", self.server, dp, reason)
            if rebase:
                self._base[dp] = _Baseline(now, reading)
        return out

    # --- one interval -------------------------------------------------------------------------

    def _interval(
        self, base: _Baseline, cur: MetricsReading, now: float
    ) -> tuple[Observation | None, str | None, bool]:
        """-> (observation, why not, whether to move the baseline to ``cur``)."""
        prev = base.reading
        if _went_backwards(prev, cur):
            self.restarts += 1
            return None, "counters went backwards (server restarted)", True
        k0, k1 = prev.spec_num_steps, cur.spec_num_steps
        if k1 is None:
            return None, "no sglang:spec_num_steps (speculative decoding off?)", True
        if k0 != k1:
            return None, f"arm changed within the interval ({k0} -> {k1})", True
        k = k1
        if prev.moments is not None and cur.moments is not None:
            return self._from_moments(prev.moments, cur.moments, k)
        return self._from_counters(prev, cur, k, now - base.at)

    def _from_moments(
        self, m0: DecodeMoments, m1: DecodeMoments, k: int
    ) -> tuple[Observation | None, str | None, bool]:
        n = m1.n - m0.n
        if n < self.min_steps:
            return None, f"only {n:.0f} decode steps so far", False
        sum_bs = m1.sum_bs - m0.sum_bs
        busy_s = (m1.sum_step_us - m0.sum_step_us) / 1e6
        generated = m1.sum_generated - m0.sum_generated
        mean_bs = sum_bs / n
        var_bs = max(0.0, (m1.sum_bs2 - m0.sum_bs2) / n - mean_bs * mean_bs)
        if math.sqrt(var_bs) > self.max_bs_rsd * mean_bs:
            spread = f"mean {mean_bs:.1f}, sd {math.sqrt(var_bs):.1f}"
            return None, f"batch size spread too wide ({spread})", True
        b = max(1, round(mean_bs))
        accepted = max(0, round(generated - sum_bs))
        return self._finish(
            b=b, k=k, steps=round(n), emitted=round(generated), accepted=accepted,
            drafted=round(k * sum_bs), busy_s=busy_s,
        )

    def _from_counters(
        self, prev: MetricsReading, cur: MetricsReading, k: int, wall_s: float
    ) -> tuple[Observation | None, str | None, bool]:
        if cur.decode_tokens is None or prev.decode_tokens is None:
            return None, "no decode token counter", True
        tokens = cur.decode_tokens - prev.decode_tokens
        if prev.running_reqs is None or cur.running_reqs is None:
            return None, "no sglang:num_running_reqs gauge", True
        if self.buckets.index(max(1, round(prev.running_reqs))) != self.buckets.index(
            max(1, round(cur.running_reqs))
        ):
            return (
                None,
                f"batch size moved across buckets ({prev.running_reqs:.0f} -> "
                f"{cur.running_reqs:.0f})",
                True,
            )
        b = max(1, round((prev.running_reqs + cur.running_reqs) / 2))
        accept_len = cur.spec_accept_length
        if accept_len is None or accept_len < 1.0:
            accept_len = 1.0  # speculation off or no window yet: one token per request
        if k == 0:
            accept_len = 1.0
        if cur.decode_passes is not None and prev.decode_passes is not None:
            steps = cur.decode_passes - prev.decode_passes
        else:
            steps = tokens / (b * accept_len)
        if steps < self.min_steps:
            return None, f"only {steps:.0f} decode steps so far", False
        sum_bs = tokens / accept_len
        return self._finish(
            b=b, k=k, steps=round(steps), emitted=round(tokens),
            accepted=max(0, round(tokens - sum_bs)), drafted=round(k * sum_bs), busy_s=wall_s,
        )

    def _finish(
        self, *, b: int, k: int, steps: int, emitted: int, accepted: int, drafted: int,
        busy_s: float,
    ) -> tuple[Observation | None, str | None, bool]:
        obs = Observation(
            b=b, k=k, decode_steps=steps, emitted_tokens=emitted, accepted_drafts=accepted,
            drafted_tokens=drafted, busy_s=busy_s,
        )
        problem = obs.problem()
        if problem is not None:
            # e.g. drafts accepted at k=0: the arm changed and changed back unseen.
            return None, f"inconsistent interval: {problem}", True
        return obs, None, True


def _with_moments(reading: MetricsReading, moments: DecodeMoments | None) -> MetricsReading:
    if moments is None:
        return reading
    return MetricsReading(
        dp_rank=reading.dp_rank,
        decode_tokens=reading.decode_tokens,
        decode_passes=reading.decode_passes,
        running_reqs=reading.running_reqs,
        spec_num_steps=reading.spec_num_steps,
        spec_accept_length=reading.spec_accept_length,
        moments=moments,
    )


def _went_backwards(prev: MetricsReading, cur: MetricsReading) -> bool:
    pairs: list[tuple[Any, Any]] = [
        (prev.decode_tokens, cur.decode_tokens),
        (prev.decode_passes, cur.decode_passes),
    ]
    if prev.moments is not None and cur.moments is not None:
        pairs.append((prev.moments.n, cur.moments.n))
        pairs.append((prev.moments.sum_generated, cur.moments.sum_generated))
    return any(a is not None and b is not None and b < a for a, b in pairs)

"""The engine's requests: one request's life, and the log of finished ones with its stats."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tuner.sim.acceptance import AcceptanceShape

if TYPE_CHECKING:
    from tuner.sim.load import Load

__all__ = ["Request", "RequestLog", "RequestStats"]


class Request:
    """One request's life. ``on_finish(request)`` is called when its last token is out."""

    __slots__ = (
        "rid",
        "cls",
        "alpha",
        "prompt_tokens",
        "output_tokens",
        "arrival",
        "admitted_at",
        "first_token_at",
        "finished_at",
        "load",
        "on_finish",
        "delta",
        "shape",
    )

    def __init__(
        self,
        rid: int,
        cls: str,
        alpha: float,
        delta: float,
        prompt_tokens: int,
        output_tokens: int,
        arrival: float,
        load: Load | None,
        on_finish: Callable[[Request], None] | None,
    ) -> None:
        self.rid = rid
        self.cls = cls
        self.alpha = alpha
        self.delta = delta
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.arrival = arrival
        self.admitted_at = math.nan
        self.first_token_at = math.nan
        self.finished_at = math.nan
        self.load = load
        self.on_finish = on_finish
        self.shape: AcceptanceShape | None = None

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (NaN for single-token requests)."""
        if self.output_tokens <= 1:
            return math.nan
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)

    def __repr__(self) -> str:
        return f"<Request {self.rid} {self.cls} out={self.output_tokens}>"


@dataclass(frozen=True)
class RequestStats:
    """Summary of the requests that finished in a time window (seconds are virtual)."""

    finished: int
    output_tokens: int
    window_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    tpot_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float

    @property
    def output_throughput(self) -> float:
        """Output tokens per second over the window."""
        return self.output_tokens / self.window_s if self.window_s > 0 else 0.0


class RequestLog:
    """Per finished request: when it finished, its TPOT, TTFT, end-to-end time and length."""

    def __init__(self) -> None:
        self._cols: dict[str, list[float]] = {
            "finished_at": [],
            "tpot": [],
            "ttft": [],
            "e2e": [],
            "tokens": [],
        }

    def finished(self, done: Iterable[Request], now: float) -> None:
        """Stamp ``done`` as finished at ``now`` and log them."""
        log = self._cols
        for r in done:
            r.finished_at = now
            log["finished_at"].append(now)
            log["tpot"].append(r.tpot_s)
            log["ttft"].append(r.first_token_at - r.arrival)
            log["e2e"].append(now - r.arrival)
            log["tokens"].append(r.output_tokens)

    def stats(self, since: float, until: float) -> RequestStats:
        """Stats of requests that finished in ``[since, until)``."""
        log = self._cols
        fin = np.asarray(log["finished_at"])
        sel = (fin >= since) & (fin < until) if fin.size else np.zeros(0, dtype=bool)
        tpot = np.asarray(log["tpot"])[sel] if fin.size else np.zeros(0)
        tpot = tpot[np.isfinite(tpot)]
        ttft = np.asarray(log["ttft"])[sel] if fin.size else np.zeros(0)
        e2e = np.asarray(log["e2e"])[sel] if fin.size else np.zeros(0)
        toks = int(np.asarray(log["tokens"])[sel].sum()) if fin.size else 0

        def pct(x: np.ndarray, q: float) -> float:
            return float(np.percentile(x, q)) if x.size else math.nan

        return RequestStats(
            finished=int(sel.sum()),
            output_tokens=toks,
            window_s=max(until - since, 0.0),
            tpot_p50_s=pct(tpot, 50),
            tpot_p99_s=pct(tpot, 99),
            tpot_mean_s=float(tpot.mean()) if tpot.size else math.nan,
            ttft_p50_s=pct(ttft, 50),
            ttft_p99_s=pct(ttft, 99),
            e2e_p50_s=pct(e2e, 50),
        )

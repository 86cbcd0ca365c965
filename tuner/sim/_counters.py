"""The engine's server-level counters: what SGLang's ``/metrics`` and ``/v1/loads`` show."""

from __future__ import annotations

__all__ = ["EngineCounters"]


class EngineCounters:
    """Cumulative server-level counters (what SGLang's ``/metrics`` and ``/v1/loads`` show)."""

    __slots__ = (
        "decode_steps",
        "decode_tokens",
        "prefill_steps",
        "prefill_tokens",
        "accepted_drafts",
        "request_steps",
        "requests_submitted",
        "requests_finished",
        "generation_tokens",
        "graph_passes",
        "eager_passes",
        "moments",
        "gauges",
        "_win_steps",
        "_win_tokens",
        "_win_start",
        "_win_req_steps",
        "_win_accepted",
        "_last_decode",
    )

    def __init__(self) -> None:
        self.decode_steps = 0
        self.decode_tokens = 0
        self.prefill_steps = 0
        self.prefill_tokens = 0
        self.accepted_drafts = 0
        self.request_steps = 0  # sum of batch sizes over decode steps (SGLang's verify count)
        self.requests_submitted = 0
        self.requests_finished = 0
        self.generation_tokens = 0
        self.graph_passes = 0
        self.eager_passes = 0
        # /v1/loads decode_moments over contiguous decode launches:
        # [n, Σbs, Σstep_us, Σbs², Σbs·step_us, Σgenerated]
        self.moments = [0, 0, 0.0, 0, 0.0, 0]
        # Gauges refreshed every decode-log interval, as SGLang's metrics collector does.
        self.gauges: dict[str, float] = {
            "gen_throughput": 0.0,
            "num_running_reqs": 0.0,
            "num_queue_reqs": 0.0,
            "spec_accept_length": 0.0,
            "spec_accept_rate": 0.0,
            "spec_num_steps": 0.0,
        }
        self._win_steps = 0
        self._win_tokens = 0
        self._win_start = 0.0
        self._win_req_steps = 0
        self._win_accepted = 0
        self._last_decode: tuple[int, float, int, int] | None = None  # (b, launch, iter, gen)

    @property
    def avg_spec_accept_length(self) -> float:
        """Lifetime tokens per request-verify, bonus included (SGLang's readout)."""
        return self.decode_tokens / self.request_steps if self.request_steps else 0.0

    def count_decode(
        self, n: int, launch: float, fi: int, emitted: int, accepted: int, graph: bool
    ) -> int:
        """Count a decode step of ``n`` requests launched at ``launch`` as forward ``fi``.

        Returns the decode steps in the current gauge window.
        """
        prev = self._last_decode
        # A moment spans launch to launch, so only a decode right after a decode gives one.
        if prev is not None and prev[2] + 1 == fi:
            gap_us = (launch - prev[1]) * 1e6
            mo = self.moments
            pbn = prev[0]
            mo[0] += 1
            mo[1] += pbn
            mo[2] += gap_us
            mo[3] += pbn * pbn
            mo[4] += pbn * gap_us
            mo[5] += prev[3]
        self._last_decode = (n, launch, fi, emitted)
        self.decode_steps += 1
        self.decode_tokens += emitted
        self.accepted_drafts += accepted
        self.request_steps += n
        self.generation_tokens += emitted
        if graph:
            self.graph_passes += 1
        else:
            self.eager_passes += 1
        self._win_steps += 1
        self._win_tokens += emitted
        self._win_req_steps += n
        self._win_accepted += accepted
        return self._win_steps

    def refresh_gauges(self, now: float, n: int, k: int, queued: int, static: int) -> None:
        """Close the gauge window at ``now``: ``n`` running, ``queued`` waiting, arm ``k``,
        ``static`` the server's largest (static) draft width."""
        span = now - self._win_start
        g = self.gauges
        g["gen_throughput"] = self._win_tokens / span if span > 0 else 0.0
        g["num_running_reqs"] = float(n)
        g["num_queue_reqs"] = float(queued)
        req_steps = self._win_req_steps
        g["spec_accept_length"] = self._win_tokens / req_steps if req_steps else 0.0
        # SGLang divides by the static draft width, which is wrong under adaptive; mirror it.
        g["spec_accept_rate"] = (
            self._win_accepted / (req_steps * static) if req_steps and static else 0.0
        )
        g["spec_num_steps"] = float(k)
        self._win_steps = self._win_tokens = self._win_req_steps = self._win_accepted = 0
        self._win_start = now

"""``GET /metrics`` for the simulator: the engine's counters and gauges as Prometheus text,
under the metric names and labels SGLang 0.5.23 uses."""

from __future__ import annotations

from tuner.sim.engine import Engine

__all__ = ["prometheus_text"]

# (name, help, gauge key) for the gauges read straight from ``counters.gauges``.
_GAUGES = (
    ("sglang:num_running_reqs", "The number of running requests.", "num_running_reqs"),
    ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", "num_queue_reqs"),
    ("sglang:gen_throughput", "The generation throughput (token/s).", "gen_throughput"),
    ("sglang:spec_accept_length", "The average acceptance length of speculative decoding.",
     "spec_accept_length"),
    ("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding.",
     "spec_accept_rate"),
    ("sglang:spec_num_steps", "The number of speculative steps.", "spec_num_steps"),
)  # fmt: skip


def prometheus_text(engine: Engine, model_name: str) -> str:
    """The exposition text; the caller holds the server's lock."""
    c = engine.counters
    g = c.gauges
    labels = (
        f'model_name="{model_name}",engine_type="unified",tp_rank="0",pp_rank="0",'
        'moe_ep_rank="0"'
    )
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for extra, value in samples:
            lab = labels + ("," + extra if extra else "")
            lines.append(f"{name}{{{lab}}} {float(value)!r}")

    for name, help_, key in _GAUGES:
        metric(name, "gauge", help_, [("", g[key])])
    metric(
        "sglang:spec_num_draft_tokens",
        "gauge",
        "The number of speculative draft tokens.",
        [("", g["spec_num_steps"] + 1)],
    )
    metric("sglang:token_usage", "gauge", "The token usage.", [("", 0.0)])
    for name, help_, samples in (
        ("sglang:realtime_tokens_total",
         "Total tokens processed, updated every scheduler iteration.",
         [('mode="prefill_compute"', c.prefill_tokens), ('mode="decode"', c.decode_tokens)]),
        ("sglang:cuda_graph_passes_total", "Forward passes by CUDA graph usage.",
         [('mode="decode_cuda_graph"', c.graph_passes), ('mode="decode_none"', c.eager_passes)]),
        ("sglang:generation_tokens_total", "Number of generation tokens processed.",
         [("", c.generation_tokens)]),
        ("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
         [("", c.prefill_tokens)]),
        ("sglang:num_requests_total", "Number of requests processed.",
         [("", c.requests_finished)]),
        ("sglang:spec_verify_calls_total", "Number of speculative verify calls.",
         [("", c.request_steps)]),
    ):  # fmt: skip
        metric(name, "counter", help_, samples)
    return "\n".join(lines) + "\n"

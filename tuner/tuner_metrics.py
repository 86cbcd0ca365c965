"""The tuner's own Prometheus metrics (``dynspec-tuner run --metrics-port N``).

The daemon reports what it believes and does; Grafana scrapes it like any exporter. Everything
lives in one :class:`TunerMetrics` with its own ``CollectorRegistry`` (never the process-wide
default, so tests and several daemons in one process do not collide). Values are kept as plain
state under a lock and rendered on each scrape, so a bucket or arm that disappears from a
policy snapshot disappears from ``/metrics`` too.

Exposed (``server`` = address, ``bucket`` = batch-size range such as ``3-4`` or ``>256``):

=============================================== ======= =======================================
name                                            type    labels
=============================================== ======= =======================================
``dynspec_chosen_arm``                          gauge   server, bucket — greedy ``k``
``dynspec_goodput_estimate_tokens_per_second``  gauge   server, bucket, arm
``dynspec_goodput_std_tokens_per_second``       gauge   server, bucket, arm — uncertainty
``dynspec_estimate_decode_steps``               gauge   server, bucket, arm — ``n`` behind it
``dynspec_policy_version``                      gauge   server — last version pushed
``dynspec_server_up``                           gauge   server — 1 reachable, 0 not
``dynspec_plugin_loaded``                       gauge   server — 0 = metrics-only mode
``dynspec_pushes_total``                        counter server — tables applied
``dynspec_rejected_updates_total``              counter server
``dynspec_outages_total``                       counter server — reachable -> unreachable
``dynspec_restarts_total``                      counter server
``dynspec_observations_total``                  counter server — observations recorded
=============================================== ======= =======================================
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from policies import PolicySnapshot

__all__ = ["DEFAULT_METRICS_ADDR", "MetricsServer", "TunerMetrics"]

# Loopback by default: the metrics name servers and reveal load; expose them on purpose
# (e.g. --metrics-addr 0.0.0.0) when Prometheus scrapes from another host.
DEFAULT_METRICS_ADDR = "127.0.0.1"

_COUNTERS = {
    "pushes": "Policy tables the server applied.",
    "rejected_updates": "Policy tables the server refused (updated=false).",
    "outages": "Times the server went from reachable to unreachable.",
    "restarts": "Server restarts detected (new start time or counters going backwards).",
    "observations": "Observations recorded to storage.",
}


@dataclass
class _ServerState:
    snapshot: PolicySnapshot | None = None
    version: int | None = None
    up: bool | None = None
    plugin: bool | None = None
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0.0))


class TunerMetrics:
    """Thread-safe holder of the tuner's metrics; the daemon updates, scrapes read.

    Args:
        registry: where to register; a fresh ``CollectorRegistry`` when None.
    """

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._servers: dict[str, _ServerState] = {}
        self.registry.register(self)

    # --- what the daemon calls ---------------------------------------------------------------

    def set_snapshot(self, server: str, snapshot: PolicySnapshot) -> None:
        """Replace the server's per-bucket beliefs (chosen arm, estimates)."""
        with self._lock:
            self._state(server).snapshot = snapshot

    def set_policy_version(self, server: str, version: int) -> None:
        with self._lock:
            self._state(server).version = int(version)

    def set_up(self, server: str, up: bool) -> None:
        """Reachability as of the last reading (outages are counted by record_outage)."""
        with self._lock:
            self._state(server).up = bool(up)

    def set_plugin_loaded(self, server: str, loaded: bool) -> None:
        with self._lock:
            self._state(server).plugin = bool(loaded)

    def record_push(self, server: str, version: int | None = None) -> None:
        self._count(server, "pushes", 1)
        if version is not None:
            self.set_policy_version(server, version)

    def record_rejected_update(self, server: str) -> None:
        self._count(server, "rejected_updates", 1)

    def record_outage(self, server: str) -> None:
        """Count one outage (the daemon calls it once per outage, not per failed read)."""
        self._count(server, "outages", 1)

    def record_restart(self, server: str) -> None:
        self._count(server, "restarts", 1)

    def record_observations(self, server: str, n: int) -> None:
        if n < 0:
            raise ValueError(f"observation count must be >= 0, got {n}")
        self._count(server, "observations", n)

    def serve(self, *, port: int, addr: str = DEFAULT_METRICS_ADDR) -> MetricsServer:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread (port 0 = any free one).

        Raises:
            OSError: the port cannot be bound (in use, no permission).
        """
        return MetricsServer(self.registry, addr=addr, port=port)

    # --- prometheus_client's collector protocol ------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            servers = {name: _copy(s) for name, s in self._servers.items()}
        chosen = GaugeMetricFamily(
            "dynspec_chosen_arm", "Arm (draft steps) the policy currently picks per bucket.",
            labels=["server", "bucket"],
        )
        goodput = GaugeMetricFamily(
            "dynspec_goodput_estimate_tokens_per_second",
            "Estimated goodput (emitted tokens per busy second) per bucket and arm.",
            labels=["server", "bucket", "arm"],
        )
        std = GaugeMetricFamily(
            "dynspec_goodput_std_tokens_per_second",
            "Uncertainty (standard deviation) of the goodput estimate.",
            labels=["server", "bucket", "arm"],
        )
        steps = GaugeMetricFamily(
            "dynspec_estimate_decode_steps",
            "Decode steps behind the goodput estimate (after any discounting).",
            labels=["server", "bucket", "arm"],
        )
        version = GaugeMetricFamily(
            "dynspec_policy_version", "Version of the last table pushed.", labels=["server"]
        )
        up = GaugeMetricFamily(
            "dynspec_server_up", "1 if the server answered the last read.", labels=["server"]
        )
        plugin = GaugeMetricFamily(
            "dynspec_plugin_loaded",
            "1 if the server runs the dynspec plugin, 0 in metrics-only mode.",
            labels=["server"],
        )
        counters = {
            name: CounterMetricFamily(f"dynspec_{name}", doc, labels=["server"])
            for name, doc in _COUNTERS.items()
        }
        for name in sorted(servers):
            s = servers[name]
            snap = s.snapshot
            if snap is not None:
                for i, k in enumerate(snap.chosen):
                    chosen.add_metric([name, snap.buckets.label(i)], k)
                for est in snap.estimates:
                    labels = [name, snap.buckets.label(est.bucket), str(est.arm)]
                    goodput.add_metric(labels, est.estimate)
                    std.add_metric(labels, est.std)
                    steps.add_metric(labels, est.n)
            if s.version is not None:
                version.add_metric([name], s.version)
            if s.up is not None:
                up.add_metric([name], 1.0 if s.up else 0.0)
            if s.plugin is not None:
                plugin.add_metric([name], 1.0 if s.plugin else 0.0)
            for key, family in counters.items():
                family.add_metric([name], s.counts[key])
        yield from (chosen, goodput, std, steps, version, up, plugin)
        yield from counters.values()

    def describe(self) -> list[Metric]:
        # Nothing to pre-declare; avoids a collect() at register time.
        return []

    # --- internals -----------------------------------------------------------------------------

    def _state(self, server: str) -> _ServerState:
        state = self._servers.get(server)
        if state is None:
            state = self._servers[server] = _ServerState()
        return state

    def _count(self, server: str, key: str, n: float) -> None:
        with self._lock:
            self._state(server).counts[key] += n


def _copy(s: _ServerState) -> _ServerState:
    return _ServerState(s.snapshot, s.version, s.up, s.plugin, dict(s.counts))


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib name)
        pass  # one line per scrape on stderr would drown the daemon's own output


class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it. Use as a context manager."""

    def __init__(self, registry: CollectorRegistry, *, addr: str, port: int) -> None:
        self._httpd = make_server(
            addr, port, make_wsgi_app(registry), _ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
            name="dynspec-metrics", daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self._httpd.server_address[0]
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

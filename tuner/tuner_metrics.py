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
``dynspec_last_tick_age_seconds``               gauge   — since the loop last completed a tick
``dynspec_gain_ratio``                          gauge   server, baseline — see below
``dynspec_gain_ratio_lower`` / ``_upper``       gauge   server, baseline — its 95 % interval
``dynspec_gain_measured_share``                 gauge   server, baseline
``dynspec_switchback_gain_ratio``               gauge   server — measured (``run --holdout``)
``dynspec_switchback_gain_ratio_lower`` / ``_upper`` gauge server — its 95 % interval
``dynspec_switchback_pairs``                    gauge   server — pairs of windows behind it
``dynspec_switchback_cost_ratio``               gauge   server — goodput the baseline cost
``dynspec_holdout_active``                      gauge   server — 1 while on the baseline table
=============================================== ======= =======================================

The gain (:mod:`tuner.gain`) is the table the server runs against ``baseline`` = ``start``
(the table it started on), ``k0`` and ``always`` (the always-speculate arm), from the
policy's estimates, each bucket weighted by its decode steps; ``measured_share`` is the
weight where the policy has seen both arms in that bucket (the rest is its model's). Its
interval is ``report``'s delete-a-group jackknife (:mod:`tuner.report_gain`) over the last
``GAIN_STRETCHES`` stretches of ``GAIN_STRETCH_S`` seconds of readings, kept as sums per
``(b, k)`` and stretch (a few hundred numbers per server): the gain is recomputed from the
measured goodputs without each stretch in turn (an arm a stretch-less remainder lacks keeps
the policy's estimate; the weights stay the policy's) and the half-width is ``t(G−1)`` times
the jackknife's standard error, or the delta method's where that is wider. Readings next to
each other share the load's and acceptance's drift, which the per-interval delta method
alone ignores (too narrow); with fewer than 3 stretches yet it is the delta method's. The
``switchback`` figures are the experiment's (:mod:`tuner.switchback`): the tuned table against
the server's starting table in randomised adjacent windows; absent until a pair is complete.
=============================================== ======= =======================================

The same port answers ``GET /healthz``: 200 with a small JSON body while the loop ticks, 503
before the first tick or once it has not ticked for ``stale_after_s`` (a stuck loop), for
Kubernetes probes and load balancers.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from policies import PolicySnapshot
from tuner.errors import ConfigError

__all__ = ["DEFAULT_METRICS_ADDR", "DEFAULT_STALE_AFTER_S", "MetricsServer", "TunerMetrics"]

# Loopback by default: the metrics name servers and reveal load; expose them on purpose
# (e.g. --metrics-addr 0.0.0.0) when Prometheus scrapes from another host.
DEFAULT_METRICS_ADDR = "127.0.0.1"
# /healthz turns 503 when the loop has not finished a tick for this long. A tick waits at
# most about an interval plus an HTTP timeout; this leaves room for a slow database too.
DEFAULT_STALE_AFTER_S = 60.0

# The /metrics gain's jackknife: stretches of readings left out in turn (fixed in advance).
GAIN_STRETCHES = 8
GAIN_STRETCH_S = 60.0

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
    start: tuple | None = None  # the table the server started on
    current: tuple | None = None  # the table it runs
    version: int | None = None
    up: bool | None = None
    plugin: bool | None = None
    switchback: Any = None  # tuner.switchback.SwitchbackGain
    holdout_active: bool | None = None
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0.0))
    # (stretch index, {(b, k): [emitted tokens, busy s]}), the newest last: the gain's jackknife
    stretches: deque = field(default_factory=lambda: deque(maxlen=GAIN_STRETCHES))


class TunerMetrics:
    """Thread-safe holder of the tuner's metrics; the daemon updates, scrapes read.

    Args:
        registry: where to register; a fresh ``CollectorRegistry`` when None.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._servers: dict[str, _ServerState] = {}
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._last_tick: float | None = None
        self._history_ok = True
        self._extra: list[Callable[[], Iterator[Metric]]] = []
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

    def record_sums(self, server: str, observations: Iterable[Any], now: float) -> None:
        """Add one reading's observations (``b``, ``k``, ``emitted_tokens``, ``busy_s``) to the
        stretch ``now`` falls in, for the gain's jackknife."""
        idx = math.floor(now / GAIN_STRETCH_S)
        with self._lock:
            st = self._state(server)
            if not st.stretches or st.stretches[-1][0] != idx:
                st.stretches.append((idx, {}))
            sums = st.stretches[-1][1]
            for o in observations:
                if o.busy_s > 0:
                    row = sums.setdefault((o.b, o.k), [0.0, 0.0])
                    row[0] += o.emitted_tokens
                    row[1] += o.busy_s

    def set_tables(self, server: str, *, start: tuple | None, current: tuple | None) -> None:
        """The tables behind the gain figures: the server's starting one and the one it runs."""
        with self._lock:
            st = self._state(server)
            st.start, st.current = start, current

    def set_switchback(self, server: str, result: Any, *, active: bool) -> None:
        """The switchback's measured gain (None before its first pair) and whether the
        server runs its baseline table now."""
        with self._lock:
            st = self._state(server)
            st.switchback, st.holdout_active = result, bool(active)

    def record_tick(self, *, history_ok: bool = True) -> None:
        """The loop finished a tick (feeds ``/healthz``)."""
        with self._lock:
            self._last_tick = self._clock()
            self._history_ok = bool(history_ok)

    def add_collector(self, collect: Callable[[], Iterator[Metric]]) -> None:
        """More families rendered on each scrape (e.g. the gain estimates)."""
        with self._lock:
            self._extra.append(collect)

    def health(self) -> tuple[bool, dict[str, object]]:
        """``(healthy, body)`` for ``/healthz``."""
        with self._lock:
            last, history_ok = self._last_tick, self._history_ok
            up = sum(1 for s in self._servers.values() if s.up)
            known = len(self._servers)
        if last is None:
            return False, {"status": "starting", "servers": known}
        age = self._clock() - last
        ok = age <= self.stale_after_s
        return ok, {"status": "ok" if ok else "stale", "last_tick_age_s": round(age, 3),
                    "servers_up": up, "servers": known, "history_ok": history_ok}

    def serve(self, *, port: int, addr: str = DEFAULT_METRICS_ADDR) -> MetricsServer:
        """Serve ``/metrics`` and ``/healthz`` on ``addr:port`` from a daemon thread (port 0 =
        any free one).

        Raises:
            ConfigError: the port is out of range or cannot be bound (in use, no permission,
                an address that is not this machine's), in one line naming both.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"--metrics-port {port!r}: a port is 0..65535 (0 = any free one)")
        try:
            return MetricsServer(self.registry, addr=addr, port=port, health=self.health)
        except (OSError, OverflowError, UnicodeError) as exc:  # gaierror is an OSError
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise ConfigError(
                f"--metrics-port {port} --metrics-addr {addr}: cannot listen there ({reason})"
            ) from exc

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
        yield from _gain_families(servers)
        yield from _switchback_families(servers)
        with self._lock:
            last, extra = self._last_tick, list(self._extra)
        if last is not None:
            age = GaugeMetricFamily("dynspec_last_tick_age_seconds",
                                    "Seconds since the tuning loop last finished a tick.")
            age.add_metric([], max(0.0, self._clock() - last))
            yield age
        for collect in extra:
            yield from collect()

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
    return _ServerState(s.snapshot, s.start, s.current, s.version, s.up, s.plugin,
                        s.switchback, s.holdout_active, dict(s.counts),
                        deque(((i, {key: list(v) for key, v in st.items()})
                               for i, st in s.stretches), maxlen=GAIN_STRETCHES))


def _switchback_families(servers: dict[str, _ServerState]) -> Iterator[Metric]:
    docs = {"gain_ratio": "Measured goodput gain of the tuned table over the starting table "
                          "(switchback).",
            "gain_ratio_lower": "Lower end of the switchback gain's 95% interval.",
            "gain_ratio_upper": "Upper end of the switchback gain's 95% interval.",
            "pairs": "Pairs of windows behind the switchback gain.",
            "cost_ratio": "Share of goodput the switchback's baseline windows cost."}
    fams = {k: GaugeMetricFamily(f"dynspec_switchback_{k}", doc, labels=["server"])
            for k, doc in docs.items()}
    active = GaugeMetricFamily("dynspec_holdout_active",
                               "1 while the server runs its baseline table (switchback).",
                               labels=["server"])
    for name in sorted(servers):
        s = servers[name]
        if s.holdout_active is not None:
            active.add_metric([name], 1.0 if s.holdout_active else 0.0)
        r = s.switchback
        if r is None:
            continue
        for k, v in (("gain_ratio", r.ratio), ("gain_ratio_lower", r.low),
                     ("gain_ratio_upper", r.high), ("pairs", r.pairs), ("cost_ratio", r.cost)):
            if math.isfinite(v):
                fams[k].add_metric([name], v)
    yield from fams.values()
    yield active


def _gain_families(servers: dict[str, _ServerState]) -> Iterator[Metric]:
    from tuner.gain import ArmValue, BucketValues, estimate_gain
    from tuner.report import always_arm
    from tuner.report_gain import _widen

    names = {"": "Estimated goodput gain of the table in effect over a baseline table.",
             "_lower": "Lower end of the gain's 95% interval.",
             "_upper": "Upper end of the gain's 95% interval.",
             "_measured_share": "Share of the weight where both arms were observed."}
    fams = {k: GaugeMetricFamily(("dynspec_gain_measured_share" if k == "_measured_share"
                                  else f"dynspec_gain_ratio{k}"), doc,
                                 labels=["server", "baseline"]) for k, doc in names.items()}
    for name in sorted(servers):
        s = servers[name]
        snap = s.snapshot
        if snap is None or s.current is None:
            continue
        buckets = []
        for i in range(len(snap.buckets)):
            low, high = snap.buckets.bounds(i)
            arms = {e.arm: ArmValue(e.estimate, e.std, e.n > 0) for e in snap.estimates
                    if e.bucket == i and math.isfinite(e.estimate) and math.isfinite(e.std)}
            weight = sum(e.n for e in snap.estimates if e.bucket == i)
            buckets.append(BucketValues(weight, high if high is not None else low, arms))
        bases = {"start": s.start, "k0": ((None, 0),) if 0 in snap.arms else None}
        always = always_arm(snap.arms)
        bases["always"] = ((None, always),) if always is not None else None
        bases = {k: v for k, v in bases.items() if v}
        jack = _jackknife(snap, buckets, list(s.stretches), s.current, bases)
        for baseline, base in bases.items():
            g = estimate_gain(baseline, buckets, s.current, base)
            if g is None:
                continue
            g = _widen(g, jack.get(baseline, ()))
            for k, v in (("", g.ratio), ("_lower", g.low), ("_upper", g.high),
                         ("_measured_share", g.measured_share)):
                fams[k].add_metric([name, baseline], v)
    yield from fams.values()


def _jackknife(snap: PolicySnapshot, buckets: list, stretches: list, table: tuple,
               bases: dict) -> dict[str, list[float]]:
    """Per baseline, the gain without each stretch in turn: measured goodputs from the other
    stretches' sums (where an arm has readings in at least two of them), the policy's
    estimate elsewhere, the policy's weights."""
    from tuner.gain import ArmValue, BucketValues, estimate_gain

    out: dict[str, list[float]] = {name: [] for name in bases}
    if len(stretches) < 3:
        return out
    for left in range(len(stretches)):
        sums: dict[tuple[int, int], list[float]] = {}
        for j, (_, st) in enumerate(stretches):
            if j == left:
                continue
            for (b, k), (e, t) in st.items():
                row = sums.setdefault((snap.buckets.index(b), k), [0.0, 0.0, 0])
                row[0] += e
                row[1] += t
            for key in {(snap.buckets.index(b), k) for b, k in st}:
                sums[key][2] += 1
        values = []
        for i, bv in enumerate(buckets):
            arms = dict(bv.arms)
            for (bi, k), (e, t, n) in sums.items():
                if bi == i and n >= 2 and t > 0:
                    arms[k] = ArmValue(e / t, 0.0, True)
            values.append(BucketValues(bv.weight, bv.high, arms))
        for name, base in bases.items():
            g = estimate_gain(name, values, table, base)
            if g is not None and math.isfinite(g.ratio):
                out[name].append(g.ratio)
    return out


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib name)
        pass  # one line per scrape on stderr would drown the daemon's own output


def _with_healthz(app: Callable, health: Callable[[], tuple[bool, dict[str, object]]] | None):
    def wsgi(environ: dict, start_response: Callable) -> list[bytes]:
        if environ.get("PATH_INFO") == "/healthz" and health is not None:
            ok, body = health()
            data = (json.dumps(body) + "\n").encode()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json"),
                            ("Content-Length", str(len(data)))])
            return [data]
        return app(environ, start_response)

    return wsgi


class MetricsServer:
    """A running ``/metrics`` (and ``/healthz``) endpoint; :meth:`close` stops it. Use as a
    context manager."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        addr: str,
        port: int,
        health: Callable[[], tuple[bool, dict[str, object]]] | None = None,
    ) -> None:
        self._httpd = make_server(
            addr, port, _with_healthz(make_wsgi_app(registry), health), _ThreadingWSGIServer,
            handler_class=_QuietHandler,
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

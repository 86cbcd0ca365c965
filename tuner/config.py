"""The daemon's configuration: one frozen, validated :class:`TunerConfig`, built once.

Precedence: command-line flag > ``DYNSPEC_*`` environment variable > ``DEFAULT_*`` constant.
Only :func:`TunerConfig.from_sources` reads the environment; everything downstream receives
the built config.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from policies import DEFAULT_POLICY as _POLICIES_DEFAULT
from tuner.errors import ConfigError

__all__ = [
    "DEFAULT_BACKOFF_MAX_S",
    "DEFAULT_DB_URL",
    "DEFAULT_DECISION_PERIOD_S",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_POLICY",
    "DEFAULT_ROLLUP_AFTER_S",
    "DEFAULT_ROLLUP_BIN_S",
    "DEFAULT_SERVER",
    "DEFAULT_SIM_DB_URL",
    "DEFAULT_SIM_DURATION_S",
    "DEFAULT_SIM_LOAD",
    "DEFAULT_SIM_MAX_RUNNING",
    "DEFAULT_SIM_PORT",
    "DEFAULT_SIM_PROFILE",
    "DEFAULT_SIM_SPEED",
    "DEFAULT_SIM_WORKLOAD",
    "DEFAULT_TIMEOUT_S",
    "ENV_PREFIX",
    "SimulateConfig",
    "TunerConfig",
    "normalize_server",
    "db_url_hint",
    "parse_duration",
    "read_api_key_file",
    "read_servers_file",
]

ENV_PREFIX = "DYNSPEC_"

# SGLang's default port.
DEFAULT_SERVER = "localhost:30000"
DEFAULT_DB_URL = "sqlite:///dynspec.db"
# The policy `run` learns with when none is named: whichever won the bench (policies says).
DEFAULT_POLICY = _POLICIES_DEFAULT
# One reading of every server per second: counters are cumulative, so a slower interval
# loses nothing but reaction time, and /server_info is cheap for SGLang to answer.
DEFAULT_INTERVAL_S = 1.0
# A new table at most this often: long enough for each proposed arm to collect a few hundred
# decode steps per busy bucket, short enough to follow a load change within seconds.
DEFAULT_DECISION_PERIOD_S = 2.0
# Per HTTP call; /server_info is answered by the tokenizer manager and normally takes ms.
DEFAULT_TIMEOUT_S = 5.0
# Retry an unreachable server with doubling waits, capped here.
DEFAULT_BACKOFF_MAX_S = 30.0

# History roll-up (Storage.rollup): observations older than a week are merged into one row
# per hour and (b, k). A week keeps every raw interval for any recent question (reports of
# the last days, warm starts; live pool readers need only the last tick); an hour still draws
# a month's goodput-over-time plot. At 1 Hz and ~20 (b, k) a tick, 72,000 raw rows per
# server-hour are kept as a few hundred, with the moments the report's intervals need.
DEFAULT_ROLLUP_AFTER_S = 7 * 86400.0
DEFAULT_ROLLUP_BIN_S = 3600.0
# run --holdout: a baseline window and its control are this long (tuner.switchback).
DEFAULT_HOLDOUT_WINDOW_S = 10.0
# Younger rows may still be unread by a pool-mate or wanted raw by a warm start.
MIN_ROLLUP_AFTER_S = 3600.0

# `run --simulate`: the built-in simulator under a concurrency sweep 1 -> 256 (one phase per
# doubling, 120 simulated seconds a sweep, repeated), accelerated so that the default run -
# ten sweeps - takes about a minute of wall time.
DEFAULT_SIM_PROFILE = "h200-llama8b"
DEFAULT_SIM_WORKLOAD = "chat"
DEFAULT_SIM_LOAD = "loop:12:1,12:2,12:4,12:8,12:16,12:32,12:64,12:128,24:256"
DEFAULT_SIM_SPEED = 20.0
DEFAULT_SIM_DURATION_S = 1200.0  # simulated seconds
# Lifted from SGLang's default of 48 under EAGLE so that the sweep reaches 256 in flight.
DEFAULT_SIM_MAX_RUNNING = 256
# A simulated run keeps its own history, apart from real servers'.
DEFAULT_SIM_DB_URL = "sqlite:///dynspec-sim.db"
# One loopback port for every `run --simulate`, so the simulated server keeps its address and
# a second run warm-starts from the first one's history (a busy port falls back to a free one).
DEFAULT_SIM_PORT = 30999

# `sweep` (here so that building the CLI's help does not import Optuna).
DEFAULT_SWEEP_LEVELS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
# Longest measured window per cell, seconds (warm-up excluded). The pruner and the precision
# rule usually stop a window sooner.
DEFAULT_SWEEP_PER_LEVEL_S = 30.0
# Seconds of load after the switch (and after every earlier request finished) before the
# window opens: the new requests' prefills are past.
DEFAULT_SWEEP_WARMUP_S = 3.0

_POOL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


def normalize_server(text: str) -> str:
    """``HOST:PORT`` (optionally with an ``http://``/``https://`` scheme) -> canonical name.

    The canonical name is ``host:port`` for plain HTTP and ``https://host:port`` for TLS.

    Raises:
        ConfigError: naming what is wrong.
    """
    raw = text.strip().rstrip("/")
    scheme = "http"
    if "://" in raw:
        scheme, _, raw = raw.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigError(f"server {text!r}: scheme must be http or https")
    m = _HOST_PORT.match(raw)
    if not m:
        raise ConfigError(f"server {text!r} must be HOST:PORT, e.g. {DEFAULT_SERVER}")
    port = int(m.group("port"))
    if not 1 <= port <= 65535:
        raise ConfigError(f"server {text!r}: port must be in 1..65535")
    name = f"{m.group('host')}:{port}"
    return name if scheme == "http" else f"https://{name}"


def read_api_key_file(path: str | os.PathLike[str]) -> str:
    """The first line of an API-key file, stripped. The key itself never appears in errors.

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"api key file {str(p)!r}: cannot read it ({type(exc).__name__})") from exc
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise ConfigError(f"api key file {str(p)!r} is empty")
    return key


def read_servers_file(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """Servers listed in a file, one ``HOST:PORT`` a line (``#`` starts a comment).

    Raises:
        ConfigError: naming the file, and the line of a bad entry.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"servers file {str(p)!r}: cannot read it ({exc})") from exc
    servers: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            servers.append(normalize_server(entry))
        except ConfigError as exc:
            raise ConfigError(f"servers file {str(p)!r} line {n}: {exc}") from exc
    if not servers:
        raise ConfigError(f"servers file {str(p)!r} lists no server")
    return tuple(servers)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float | None:
    """``90``, ``90s``, ``15m``, ``1h``, ``7d``, ``2w`` -> seconds; ``off``/``never`` -> None.

    Raises:
        ValueError: anything else.
    """
    if text.strip().lower() in ("off", "never", "none"):
        return None
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r}: expected a duration such as 3600, 30m, 1h, 7d or off")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def db_url_hint(text: str) -> str:
    """What to write instead of ``text`` when it looks like a file path, not a URL."""
    if text and "://" not in text and (text.endswith((".db", ".sqlite", ".sqlite3"))
                                       or "/" in text or text.startswith(".")):
        return f" (for an SQLite file write sqlite:///{Path(text).expanduser().resolve()})"
    return ""


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TunerConfig:
    """Everything ``dynspec-tuner run`` needs. Build with :meth:`from_sources` or directly.

    Attributes:
        servers: canonical ``host:port`` names, at least one, no duplicates.
        db_url: SQLAlchemy URL of the history.
        policy: a name in ``policies.POLICIES``.
        interval_s: seconds between readings of each server.
        decision_period_s: seconds between table proposals (>= ``interval_s``).
        buckets: upper bounds of the batch-size buckets; None = the policies' default.
        api_key: SGLang's admin API key (never printed; excluded from repr).
        dry_run: learn and record, never push.
        duration_s: stop after this many seconds; None = until SIGTERM/SIGINT.
        timeout_s: per HTTP call.
        backoff_max_s: longest wait between retries of an unreachable server.
        seed: seeds the policies.
        pool: a name for identical replicas (same model, arms and hardware): servers recorded
            under one pool learn from each other's observations; None = no pooling.
        rollup_after_s: observations older than this are rolled up into ``rollup_bin_s``
            bins (``Storage.rollup``, run by the daemon about hourly); None = never.
        rollup_bin_s: the time bin rolled-up observations are merged into.
        holdout: the switchback's share of time on the baseline table (``run --holdout``,
            :mod:`tuner.switchback`); None = no experiment.
        holdout_window_s: the length of a baseline window and of its control.
    """

    servers: tuple[str, ...] = (DEFAULT_SERVER,)
    db_url: str = DEFAULT_DB_URL
    policy: str = DEFAULT_POLICY
    interval_s: float = DEFAULT_INTERVAL_S
    decision_period_s: float = DEFAULT_DECISION_PERIOD_S
    buckets: tuple[int, ...] | None = None
    api_key: str | None = field(default=None, repr=False)
    dry_run: bool = False
    duration_s: float | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S
    seed: int = 0
    pool: str | None = None
    rollup_after_s: float | None = DEFAULT_ROLLUP_AFTER_S
    rollup_bin_s: float = DEFAULT_ROLLUP_BIN_S
    holdout: float | None = None
    holdout_window_s: float = DEFAULT_HOLDOUT_WINDOW_S

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("at least one --server is needed")
        if self.pool is not None and not _POOL_NAME.match(self.pool):
            raise ConfigError(
                f"pool {self.pool!r} must be 1-64 letters, digits or . _ - (e.g. h200-llama8b)"
            )
        servers = tuple(normalize_server(s) for s in self.servers)
        dupes = sorted({s for s in servers if servers.count(s) > 1})
        if dupes:
            raise ConfigError(f"server given twice: {', '.join(dupes)}")
        object.__setattr__(self, "servers", servers)
        if not self.db_url or "://" not in self.db_url:
            raise ConfigError(
                f"db must be a database URL such as {DEFAULT_DB_URL}, got {self.db_url!r}"
                + db_url_hint(self.db_url)
            )
        if not self.policy:
            raise ConfigError("policy must be named")
        _positive("interval", self.interval_s)
        _positive("decision period", self.decision_period_s)
        if self.decision_period_s < self.interval_s:
            raise ConfigError(
                f"decision period ({self.decision_period_s} s) must be >= the interval "
                f"({self.interval_s} s): a table needs at least one reading to be judged"
            )
        _positive("timeout", self.timeout_s)
        _positive("backoff max", self.backoff_max_s)
        if self.duration_s is not None:
            _positive("duration", self.duration_s)
        if self.buckets is not None:
            edges = tuple(self.buckets)
            if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
                raise ConfigError(
                    f"buckets must be positive, strictly increasing batch sizes, got {edges}"
                )
            object.__setattr__(self, "buckets", edges)
        _positive("rollup bin", self.rollup_bin_s)
        if self.rollup_bin_s < self.interval_s:
            raise ConfigError(f"rollup bin ({self.rollup_bin_s:g} s) must be >= the interval "
                              f"({self.interval_s:g} s): a bin merges whole intervals")
        if self.rollup_after_s is not None:
            _positive("rollup after", self.rollup_after_s)
            if self.rollup_after_s < max(MIN_ROLLUP_AFTER_S, self.rollup_bin_s):
                raise ConfigError(
                    f"rollup after ({self.rollup_after_s:g} s) must be >= 1 h and >= the rollup "
                    f"bin ({self.rollup_bin_s:g} s): younger rows may still be unread by a "
                    "pool-mate (use off to never roll up)"
                )
        if self.holdout is not None:
            from tuner.switchback import parse_fraction

            try:
                object.__setattr__(self, "holdout", parse_fraction(self.holdout))
            except ValueError as exc:
                raise ConfigError(f"holdout {exc}") from None
            _positive("holdout window", self.holdout_window_s)
            if self.holdout_window_s < 2 * self.interval_s:
                raise ConfigError(
                    f"holdout window ({self.holdout_window_s:g} s) must be >= 2 intervals "
                    f"({2 * self.interval_s:g} s): each window needs readings of its own")
            if self.dry_run:
                raise ConfigError("--holdout switches the server's table: not with --dry-run")
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ConfigError("api key must be non-empty without surrounding whitespace")

    def with_(self, **changes: Any) -> TunerConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def from_sources(
        cls,
        flags: Mapping[str, Any],
        env: Mapping[str, str] | None = None,
        *,
        defaults: Mapping[str, Any] | None = None,
    ) -> TunerConfig:
        """Merge command-line flags (None = not given) over ``DYNSPEC_*`` variables over
        ``defaults`` (fields whose default differs for this use, e.g. ``run --simulate``'s
        database) over the class defaults.

        Flags: ``servers, servers_file, db_url, policy, interval_s, decision_period_s,
        buckets, api_key_file, dry_run, duration_s, timeout_s, seed, pool, rollup_after_s,
        rollup_bin_s, holdout, holdout_window_s`` (the roll-up ones also as duration strings: ``7d``, ``1h``, ``off``).
        Variables: ``DYNSPEC_ROLLUP_AFTER``, ``DYNSPEC_ROLLUP_BIN`` (durations),
        ``DYNSPEC_SERVERS`` (comma-separated), ``DYNSPEC_SERVERS_FILE``, ``DYNSPEC_POOL``,
        ``DYNSPEC_DB``, ``DYNSPEC_POLICY``,
        ``DYNSPEC_INTERVAL``, ``DYNSPEC_DECISION_PERIOD``, ``DYNSPEC_BUCKETS``,
        ``DYNSPEC_API_KEY``, ``DYNSPEC_API_KEY_FILE``, ``DYNSPEC_DRY_RUN``,
        ``DYNSPEC_DURATION``, ``DYNSPEC_TIMEOUT``, ``DYNSPEC_SEED``, ``DYNSPEC_HOLDOUT``,
        ``DYNSPEC_HOLDOUT_WINDOW``.

        Raises:
            ConfigError: naming the flag or variable at fault.
        """
        env = os.environ if env is None else env
        out: dict[str, Any] = dict(defaults or {})

        def pick(flag: str, var: str, parse: Any) -> None:
            value = flags.get(flag)
            if value is not None and value != ():
                out[flag] = value
                return
            raw = env.get(ENV_PREFIX + var)
            if raw is None or raw.strip() == "":
                return
            try:
                out[flag] = parse(raw.strip())
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"{ENV_PREFIX}{var}={raw!r}: {exc}") from exc

        def csv_str(raw: str) -> tuple[str, ...]:
            return tuple(p.strip() for p in raw.split(",") if p.strip())

        def csv_int(raw: str) -> tuple[int, ...]:
            return tuple(int(p) for p in raw.split(",") if p.strip())

        def boolean(raw: str) -> bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected 1/0, true/false, yes/no or on/off")

        # --servers-file adds to --server; the file variable only counts without either.
        servers_file = flags.get("servers_file")
        if servers_file is None and not flags.get("servers"):
            servers_file = env.get(ENV_PREFIX + "SERVERS_FILE", "").strip() or None
        if servers_file is not None:
            listed = read_servers_file(servers_file)
            flags = {**flags, "servers": tuple(flags.get("servers") or ()) + listed}
        pick("servers", "SERVERS", csv_str)
        pick("pool", "POOL", str)
        pick("db_url", "DB", str)
        pick("policy", "POLICY", str)
        pick("interval_s", "INTERVAL", float)
        pick("decision_period_s", "DECISION_PERIOD", float)
        pick("buckets", "BUCKETS", csv_int)
        pick("duration_s", "DURATION", float)
        pick("timeout_s", "TIMEOUT", float)
        pick("seed", "SEED", int)
        pick("holdout", "HOLDOUT", str)
        pick("holdout_window_s", "HOLDOUT_WINDOW", float)
        # Roll-up: seconds or durations (7d, 1h); "off" (rollup after only) never rolls up.
        for flag, var in (("rollup_after_s", "ROLLUP_AFTER"), ("rollup_bin_s", "ROLLUP_BIN")):
            raw = flags.get(flag)
            source = f"--{flag.removesuffix('_s').replace('_', '-')} {raw!r}"
            if raw is None:
                raw = env.get(ENV_PREFIX + var)
                source = f"{ENV_PREFIX}{var}={raw!r}"
                if raw is None or raw.strip() == "":
                    continue
            try:
                value = float(raw) if isinstance(raw, (int, float)) else parse_duration(raw)
            except ValueError as exc:
                raise ConfigError(f"{source}: {exc}") from None
            if value is None and flag == "rollup_bin_s":
                raise ConfigError(f"{source}: a duration is needed, not off")
            out[flag] = value
        if flags.get("dry_run"):
            out["dry_run"] = True
        else:
            pick("dry_run", "DRY_RUN", boolean)
        # The key: --api-key-file, else DYNSPEC_API_KEY, else DYNSPEC_API_KEY_FILE. Never a
        # flag with the key itself (it would show in `ps` and shell history).
        key_file = flags.get("api_key_file")
        if key_file is not None:
            out["api_key"] = read_api_key_file(key_file)
        elif env.get(ENV_PREFIX + "API_KEY", "").strip():
            out["api_key"] = env[ENV_PREFIX + "API_KEY"].strip()
        elif env.get(ENV_PREFIX + "API_KEY_FILE", "").strip():
            out["api_key"] = read_api_key_file(env[ENV_PREFIX + "API_KEY_FILE"].strip())
        return cls(**out)


@dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    """``run --simulate``: which simulated server to start.

    Attributes:
        profile: a built-in cost profile name or a profile file.
        workload: a workload preset.
        load: a concurrency schedule ``DUR:CONC,...`` (simulated seconds : requests).
        speed: simulated seconds per wall second.
        duration_s: simulated seconds to run the tuner for.
        max_running: the simulated server's running-request cap.
        seed: seeds the simulator.
        port: the loopback port to serve on (0 = any free one).
    """

    profile: str = DEFAULT_SIM_PROFILE
    workload: str = DEFAULT_SIM_WORKLOAD
    load: str = DEFAULT_SIM_LOAD
    speed: float = DEFAULT_SIM_SPEED
    duration_s: float = DEFAULT_SIM_DURATION_S
    max_running: int = DEFAULT_SIM_MAX_RUNNING
    seed: int = 0
    port: int = DEFAULT_SIM_PORT

    def __post_init__(self) -> None:
        if not self.profile:
            raise ConfigError("profile must be named")
        if not self.workload:
            raise ConfigError("workload must be named")
        if not self.load:
            raise ConfigError("load must be a schedule such as 10:1,10:8")
        if not (math.isfinite(self.speed) and 0 < self.speed <= 10_000):
            raise ConfigError(f"speed must be in (0, 10000], got {self.speed!r}")
        _positive("duration", self.duration_s)
        if self.max_running < 1:
            raise ConfigError(f"max running must be >= 1, got {self.max_running}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"simulator port must be in 0..65535, got {self.port}")

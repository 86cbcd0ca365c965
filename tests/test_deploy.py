"""deploy/: the systemd unit (systemd-analyze verify), the alert rules (promtool check rules),
the Grafana dashboard and alerts naming only metrics that exist, the container recipe and the
Kubernetes example starting the tuner with arguments the CLI accepts. Under CI (``CI`` set)
a missing promtool or systemd-analyze fails instead of skipping (.ci/run installs them)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from policies import ArmEstimate, Buckets, PolicySnapshot
from tuner.cli import build_parser
from tuner.tuner_metrics import TunerMetrics

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "dynspec-tuner.service"
RULES = DEPLOY / "prometheus" / "dynspec-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dynspec-tuner.json"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
K8S = DEPLOY / "kubernetes" / "sglang-with-tuner.yaml"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed under CI (.ci/run installs it: scripts/ci-tools.sh)")
    pytest.skip(f"{name} is not installed (CI installs it: scripts/ci-tools.sh)")
    return ""  # pragma: no cover


def test_license_is_the_apache_2_0_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def test_systemd_unit_verifies(tmp_path):
    analyze = tool("systemd-analyze")
    # verify insists that ExecStart's program exists: point it at this environment's.
    exe = Path(sys.executable).parent / "dynspec-tuner"
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/dynspec-tuner/bin/dynspec-tuner", str(exe)))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def _parses(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.func is not None


def test_systemd_unit_starts_a_command_the_cli_accepts():
    line = next(x for x in UNIT.read_text().splitlines() if x.startswith("ExecStart="))
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[0].endswith("/dynspec-tuner")
    _parses(argv[1:])


def test_alert_rules_pass_promtool():
    promtool = tool("promtool")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _exposed_metric_names() -> set[str]:
    """Every family the tuner's /metrics serves once it has state, and SGLang's (from the
    simulator, which serves SGLang's names)."""
    from tuner.sim.server import SimServer

    m = TunerMetrics()
    snap = PolicySnapshot("model", Buckets((4,)), (0, 3), (3, 0),
                          (ArmEstimate(0, 3, 100.0, 5.0, 400), ArmEstimate(1, 0, 90.0, 3.0, 400)))
    m.set_snapshot("a:1", snap)
    m.set_up("a:1", True)
    m.set_plugin_loaded("a:1", True)
    m.record_push("a:1", 1)
    m.set_tables("a:1", start=((None, 3),), current=((4, 3), (None, 0)))
    m.record_tick()
    with m.serve(port=0) as srv:
        text = httpx.get(srv.url).text
    with SimServer(load="4", speed=50) as sim:
        text += httpx.get(sim.url + "/metrics").text
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names | {"up"}


_METRIC = re.compile(r"\b((?:dynspec_|sglang:)[A-Za-z0-9_:]+|up)\b(?!\s*\()")


def test_dashboard_and_alerts_name_only_metrics_that_exist():
    exposed = _exposed_metric_names()
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    rules = yaml.safe_load(RULES.read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert exprs
    used = {m for e in exprs for m in _METRIC.findall(e)}
    assert used - exposed == set()
    assert any(m.startswith("sglang:") for m in used) and "dynspec_gain_ratio" in used


def test_container_recipe_copies_what_exists_and_runs_a_valid_command():
    text = DOCKERFILE.read_text()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    extras = re.findall(r'"\.\[([a-z,]+)\]"', text)
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in ",".join(extras).split(","):
        assert f"\n{extra} = [" in pyproject, extra
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    _parses(cmd)
    assert "/healthz" in text and "EXPOSE 9464" in text and "--metrics-port" in cmd


def test_kubernetes_example_runs_the_tuner_as_a_sidecar_with_valid_arguments():
    docs = list(yaml.safe_load_all(K8S.read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"sglang", "dynspec-tuner"}
    tuner = containers["dynspec-tuner"]
    _parses(tuner["args"])
    assert "--server=127.0.0.1:30000" in tuner["args"]
    for probe in ("startupProbe", "livenessProbe"):
        assert tuner[probe]["httpGet"]["path"] == "/healthz"
    sglang_args = containers["sglang"]["args"]
    assert "--speculative-adaptive" in sglang_args and "--enable-metrics" in sglang_args
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert json.loads(config["data"]["adaptive.json"]) == {"1": {"candidate_steps": [0, 1, 3, 5]}}
    assert pod["terminationGracePeriodSeconds"] >= 30


def _dockerfile_env(text: str) -> dict[str, str]:
    joined = re.sub(r"\\\n\s*", " ", text)
    env: dict[str, str] = {}
    for line in joined.splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def test_the_containers_command_runs_healthchecks_and_stops_cleanly(tmp_path):
    """No image builder runs here (no Docker daemon, no registry for the base image), so this
    runs what the image would: its ENTRYPOINT + CMD with its ENV (the history path moved
    from the volume to tmp_path, the metrics port to a free one) against a loopback simulated
    server, then the HEALTHCHECK's own command, then `docker stop`'s SIGTERM."""
    import socket
    import time

    from tests._cli_proc import cli_process, sigterm
    from tests._fakes import LoopbackSim

    text = DOCKERFILE.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    health = re.search(r"^\s*CMD (python -c .*)$", text, re.M).group(1)
    env = _dockerfile_env(text)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    argv = [port if a == "9464" else a for a in entry + cmd]
    env["DYNSPEC_DB"] = env["DYNSPEC_DB"].replace("/var/lib/dynspec-tuner", str(tmp_path))
    with LoopbackSim() as sim:
        with cli_process(*argv[1:], env={**os.environ, **env, "DYNSPEC_SERVERS": sim.addr},
                         cwd=tmp_path) as proc:
            probe = shlex.split(health.replace("9464", port))
            probe[0] = sys.executable
            deadline = time.monotonic() + 60
            while True:  # the first tick: /healthz answers 503 until then
                ok = subprocess.run(probe, capture_output=True).returncode == 0
                if ok or time.monotonic() > deadline or proc.poll() is not None:
                    break
            assert ok, "the HEALTHCHECK command never passed"
            out, err = sigterm(proc)
    assert proc.returncode == 0, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines and all(json.loads(x)["level"] for x in lines)  # --log-format json
    assert (tmp_path / "dynspec.db").exists()

"""What the daemon learned, taken to real servers: a plugin server started from an
``export --format dynspec`` policy file, and stock SGLang (no plugin) following an
``export --format sglang-adaptive`` config, tuned by the daemon in metrics-only mode."""

from __future__ import annotations

import json

import pytest
from _drive import Load, Tuner, counters, run_client, tuner_args
from _server import ARMS, generate, http, readout, wait_for

from tuner.protocol import BandIndex, table_from_json, validate_band_table

# What tuner/metrics_only.py reads from /metrics (name, required label or None).
METRICS_ONLY_READS = (
    ("sglang:realtime_tokens_total", 'mode="decode"'),
    ("sglang:cuda_graph_passes_total", None),
    ("sglang:num_running_reqs", None),
    ("sglang:spec_num_steps", None),
    ("sglang:spec_accept_length", None),
)
NO_PLUGIN = "none-such-plugin"  # an empty SGLANG_PLUGINS would load every installed plugin


def _export(history_db, server, fmt: str, out) -> None:
    run_client(["export", "--db", f"sqlite:///{history_db}", "--server", server.address,
                "--format", fmt, "--out", str(out)])  # fmt: skip


@pytest.fixture(scope="module")
def exported(learned, history_db, plugin_server, servers, workdir) -> dict:
    """Both exports of the tier's history, and both servers that start from them launched
    at once (most of a start is one process's CPU: two share the cores)."""
    policy_path = workdir / "policy.dynspec.json"
    _export(history_db, plugin_server, "dynspec", policy_path)
    policy = json.loads(policy_path.read_text())
    table = table_from_json(policy["table"], ARMS)
    config = workdir / "exported.sglang-adaptive.json"
    _export(history_db, plugin_server, "sglang-adaptive", config)
    cfg = json.loads(config.read_text())
    # Start on an arm the table does not use where there is one, so the default table and
    # the file's table differ in what the counters show.
    unused = [a for a in ARMS if a not in {k for _, k in table}]
    servers.spawn("from-policy", initial_steps=(unused or [ARMS[0]])[0],
                  extra_env={"DYNSPEC_POLICY_FILE": str(policy_path)})  # fmt: skip
    # Stock SGLang (our plugin not loaded) on the exported sglang-adaptive config.
    servers.spawn("stock", adaptive_config=config, plugins=NO_PLUGIN,
                  arms=tuple(sorted({s for v in cfg.values() if isinstance(v, dict)
                                     for s in v.get("candidate_steps", ())})))  # fmt: skip
    return {"policy": policy, "table": table, "adaptive": cfg}


def test_a_server_started_from_an_exported_policy_runs_it_from_its_first_step(
    exported, servers
):
    policy = exported["policy"]
    # The learnt table with its acceptance bands where they differ (the daemon learns per
    # band from this v2 plugin), which the plugin installs whole.
    table = validate_band_table(policy.get("bands") or policy["table"], ARMS)
    server = servers("from-policy")
    state = readout(server.url)
    assert state["policy_version"] == policy["policy_version"]
    assert validate_band_table(state["table"], ARMS) == table
    assert state["updates_rejected"] == 0 and state["hooks_live"]
    for n in (1, 4):
        generate(server.url, n, max_new_tokens=12, seed=n)
    generate(server.url, 1, max_new_tokens=1, seed=9)  # settles the last decode step
    # Every decode step since the server started (its own warm-up included) ran the table:
    # at each batch size, one of its row's band arms.
    rows = counters(server.url)
    assert rows
    index = BandIndex(table)
    assert all(r.k in index.ks_for(r.b) for r in rows), (table, rows)


@pytest.fixture(scope="module")
def stock_server(exported, servers):
    """Stock SGLang (our plugin not loaded) on the exported sglang-adaptive config."""
    return servers("stock"), exported["adaptive"]


def test_export_for_stock_sglang_is_accepted_by_a_real_server(stock_server):
    server, cfg = stock_server
    slots = {k: v for k, v in cfg.items() if k.isdigit()}
    assert slots, cfg
    log = server.log_text()
    assert "AdaptiveSpeculativeParams initialized" in log
    assert "dynspec:" not in log  # the plugin is not loaded: SGLang's own policy follows it
    status, info = http(server.url, "/server_info")
    assert status == 200 and "dynspec" not in info["internal_states"][0]
    outs = generate(server.url, 2, max_new_tokens=8)
    assert all(len(o["output_ids"]) == 8 for o in outs)


def test_metrics_only_mode_against_a_real_server_without_the_plugin(stock_server, workdir):
    server, _cfg = stock_server
    status, text = http(server.url, "/metrics")
    assert status == 200
    for name, label in METRICS_ONLY_READS:
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        assert lines, f"{name} missing from SGLang 0.5.23's /metrics"
        if label:
            assert any(label in ln for ln in lines), f"{name} has no {label} sample"
    db = workdir / "metrics-only.db"
    # One request in flight: a steady batch size, so every /v1/loads window (SGLang publishes
    # one every 15 s) is usable.
    with Load(server.url, 1, seed=5), Tuner(tuner_args(server, db),
                                            workdir / "metrics-only.log") as tuner:  # fmt: skip
        wait_for(lambda: "no \"dynspec\" section" in tuner.log(), 60, "the metrics-only notice")
        wait_for(lambda: _observations(db) > 0, 180, "metrics-only observations in the history")
    log = tuner.log()
    assert log.count('no "dynspec" section') == 1
    assert ": pushed v" not in log and "Traceback" not in log, log[-3000:]


def _observations(db) -> int:
    import sqlite3

    if not db.exists():
        return 0
    with sqlite3.connect(db) as c:
        try:
            return c.execute("SELECT COUNT(*) FROM observations").fetchone()[0]
        except sqlite3.OperationalError:  # the daemon has not created the schema yet
            return 0

"""``sweep`` at two concurrency levels on a real server, and ``report`` on the history the
tier's daemon wrote."""

from __future__ import annotations

import json

from _drive import run_client
from _server import readout

LEVELS = (1, 2)
SWEEP_ARMS = (0, 3)


def test_sweep_measures_two_levels_and_restores_the_table(plugin_server, workdir):
    before = readout(plugin_server.url)
    out = workdir / "sweep.json"
    done = run_client([
        "sweep", "--server", plugin_server.address, "--endpoint", "generate",
        "--concurrency", ",".join(map(str, LEVELS)), "--arms", ",".join(map(str, SWEEP_ARMS)),
        "--max-tokens", "8", "--per-level", "4", "--warmup", "1", "--exhaustive", "--no-table",
        "--db", f"sqlite:///{workdir / 'sweep.db'}", "--out", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    text = json.dumps(result)
    print(done.stdout[-2000:])
    cells = _cells(result)
    assert {(c["level"], c["arm"]) for c in cells} >= {(lv, k) for lv in LEVELS for k in SWEEP_ARMS}, text[:2000]
    assert all(c["tokens_per_s"] > 0 for c in cells)
    after = readout(plugin_server.url)
    assert after["table"] == before["table"], "the sweep did not give the server its table back"
    assert after["updates_rejected"] == before["updates_rejected"]


def _cells(result: dict) -> list[dict]:
    """(level, arm, tokens/s) of every measured window in a sweep's JSON."""
    return [{"level": c["concurrency"], "arm": c["arm"], "tokens_per_s": c["tok_s"] or 0.0}
            for c in result["cells"]]  # fmt: skip


def test_report_on_the_tiers_history(learned, history_db, plugin_server, workdir):
    out = workdir / "report.json"
    run_client(["report", "--db", f"sqlite:///{history_db}", "--format", "json", "--no-plots",
                "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    servers = {s["server"]: s for s in report["servers"]}
    assert plugin_server.address in servers, list(servers)
    server = servers[plugin_server.address]
    assert server["buckets"], server
    text = run_client(["report", "--db", f"sqlite:///{history_db}", "--no-plots"]).stdout
    assert plugin_server.address in text

"""`dynspec-tuner run`: parsing, configuration errors, and a real SIGTERM against a simulator."""

from __future__ import annotations

import os

import pytest

from storage import Storage
from tests._cli_proc import cli_process, sigterm
from tests._imports import heavy_imports
from tuner.cli import main
from tuner.config import DEFAULT_SERVER, TunerConfig
from tuner.errors import ConfigError


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = main(["run", *argv])
    except SystemExit as exc:  # argparse usage errors
        rc = int(exc.code)
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--interval", "abc"], "argument --interval: invalid float value"),
        (["--policy", "nope"], "argument --policy: invalid choice"),
        (["--buckets", "1,x"], "expected comma-separated integers"),
        (["--interval", "-1"], "interval must be a positive number"),
        (["--interval", "5", "--decision-period", "1"], "decision period (1.0 s) must be >="),
        (["--buckets", "8,4"], "buckets must be positive, strictly increasing"),
        (["--server", "no-port"], "server 'no-port' must be HOST:PORT"),
        (["--server", "a:1", "--server", "a:1"], "server given twice: a:1"),
        (["--profile", "h200-llama8b"], "--profile needs --simulate"),
        (["--simulate", "--server", "a:1"], "--simulate starts its own server"),
        (["--api-key-file", "/nonexistent/key"], "api key file '/nonexistent/key'"),
        (["--db", "not-a-url"], "db must be a database URL"),
        (["--simulate", "--speed", "0"], "speed must be in (0, 10000]"),
    ],
)
def test_usage_and_config_errors_exit_2_with_one_line(capsys, argv, needle):
    rc, err = run_cli(capsys, *argv)
    assert rc == 2
    assert needle in err
    assert len(err.splitlines()) == 1


def test_unopenable_database_exits_1_naming_it(capsys, tmp_path):
    url = f"sqlite:///{tmp_path / 'no-such-dir' / 'h.db'}"
    rc, err = run_cli(capsys, "--server", "127.0.0.1:9", "--db", url)
    assert rc == 1
    assert "no-such-dir" in err and "cannot open" in err
    assert len(err.splitlines()) == 1


def test_env_fills_in_and_flags_win(tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret-admin\n")
    env = {
        "DYNSPEC_SERVERS": "h1:1, h2:2",
        "DYNSPEC_INTERVAL": "2",
        "DYNSPEC_DECISION_PERIOD": "4",
        "DYNSPEC_DRY_RUN": "yes",
        "DYNSPEC_API_KEY": "from-env",
        "DYNSPEC_BUCKETS": "4,16",
    }
    cfg = TunerConfig.from_sources({}, env)
    assert cfg.servers == ("h1:1", "h2:2") and cfg.interval_s == 2.0 and cfg.dry_run
    assert cfg.api_key == "from-env" and cfg.buckets == (4, 16)
    cfg = TunerConfig.from_sources(
        {"servers": ("h3:3",), "interval_s": 1.0, "api_key_file": str(key)}, env
    )
    assert cfg.servers == ("h3:3",) and cfg.interval_s == 1.0
    assert cfg.api_key == "s3cret-admin"
    assert "s3cret" not in repr(cfg)
    assert TunerConfig.from_sources({}, {}).servers == (DEFAULT_SERVER,)
    assert TunerConfig.from_sources({}, {}, defaults={"db_url": "sqlite:///x.db"}).db_url == (
        "sqlite:///x.db"
    )
    with pytest.raises(ConfigError, match="DYNSPEC_INTERVAL='soon'"):
        TunerConfig.from_sources({}, {"DYNSPEC_INTERVAL": "soon"})
    with pytest.raises(ConfigError, match="DYNSPEC_DRY_RUN"):
        TunerConfig.from_sources({}, {"DYNSPEC_DRY_RUN": "maybe"})


def test_sigterm_leaves_the_greedy_table_flushes_and_exits_0(tmp_path):
    from tuner.sim.server import SimServer

    db = tmp_path / "h.db"
    with SimServer(load="8", speed=20, seed=1) as sim:
        with cli_process("run", "--server", f"127.0.0.1:{sim.port}", "--db", f"sqlite:///{db}",
                         "--interval", "0.05", "--decision-period", "0.1",
                         env={**os.environ, "DYNSPEC_API_KEY": "never-logged"}) as proc:
            pushes = 0
            for line in proc.stderr:  # blocks until the daemon says it pushed, no sleeping
                pushes += " pushed v" in line
                if pushes >= 2:
                    break
            out, err = sigterm(proc)
        assert proc.returncode == 0, err
        with sim.lock:
            table, version = sim.core.table, sim.core.version
    assert "never-logged" not in out + err
    with Storage(f"sqlite:///{db}", read_only=True) as st:
        applied = [v for v in st.policy_versions() if v.outcome == "applied"]
        assert applied[-1].version == version and applied[-1].table == table
        assert [e.kind for e in st.events(kinds=["start", "stop"])] == ["start", "stop"]
        assert st.count_observations() > 0
    assert "left on v" in out


@pytest.mark.parametrize(
    "argv",
    [["--help"]]
    + [[c, "--help"] for c in
       ("run", "sim", "bench", "sweep", "report", "export", "sglang-args", "calibrate")],
)
def test_every_help_page_renders(argv, capsys):
    # argparse %-formats help strings: a stray "%" breaks the page only when it is shown.
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage: dynspec-tuner" in capsys.readouterr().out


def test_building_the_cli_imports_neither_optuna_nor_sqlalchemy():
    # --help stays fast, and `calibrate --shape` runs where only torch and rich are installed.
    statement = "import tuner.cli; tuner.cli.build_parser()"
    assert heavy_imports(statement, ("optuna", "sqlalchemy")) == []

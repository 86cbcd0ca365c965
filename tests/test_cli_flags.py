"""Every flag of every command, given bad values: never a traceback without --debug.

Each command runs in process up to the point where it would start its long work (the
daemon's loop, a simulator serving, a bench, a sweep); there a stub stops it, so a value that
is accepted counts as accepted and nothing runs for long. A value refused must be refused in
one line, by the flag's own check or the one-line handler of ``main`` - never by the
catch-all for bugs ("internal error").
"""

from __future__ import annotations

import argparse

import pytest

from storage import Storage
from tuner.cli import build_parser, main

BAD_VALUES = ("nonsense", "-1", "-1,3", "0", "1e400", "99999999999999999999", "",
              "/nonexistent-dir/x.json", "sqlite:////nonexistent-dir/h.db", "localhost:99999")


class _Started(BaseException):
    """The command got past its flags and started its long work."""


def _stop(*_a, **_k):
    raise _Started


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    import tuner.bench
    import tuner.daemon
    import tuner.sim.server
    import tuner.sweep

    monkeypatch.chdir(tmp_path)  # defaults such as sqlite:///dynspec.db land here
    monkeypatch.setattr(tuner.daemon.Daemon, "run", _stop)
    monkeypatch.setattr(tuner.sim.server.SimServer, "start", _stop)
    monkeypatch.setattr(tuner.bench, "run_bench", _stop)
    monkeypatch.setattr(tuner.sweep, "sweep_server", _stop)
    for var in ("DYNSPEC_DB", "DYNSPEC_SERVERS", "DYNSPEC_POLICY_FILE", "DYNSPEC_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    db = f"sqlite:///{tmp_path / 'h.db'}"
    Storage(db).close()  # an empty history for report, export and calibrate --from-db
    return {
        "run": [[], ["--simulate"]],
        "sim": [[]],
        "calibrate": [["--shape", "llama3-8b", "--out", "c.jsonl"],
                      ["--from-db", db, "--server", "a:1", "--out", "c.jsonl"]],
        "report": [["--db", db]],
        "export": [["--db", db, "--format", "dynspec", "--out", "p.json"]],
        "bench": [[]],
        "sweep": [["--simulate"]],
        "sglang-args": [[]],
    }


def _cases():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, parser in sub.choices.items():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:
                continue
            yield command, action.option_strings[0]


@pytest.mark.parametrize(("command", "flag"), sorted(set(_cases())))
def test_bad_values_never_give_a_traceback(stubbed, capsys, command, flag):
    for base in stubbed[command]:
        for value in BAD_VALUES:
            argv = [command, *base, flag, value]
            try:
                rc = main(argv)
            except _Started:
                rc = 0
            except SystemExit as exc:  # argparse: usage errors
                rc = int(exc.code)
            out, err = capsys.readouterr()
            assert "Traceback" not in out + err, argv
            assert "internal error" not in err, (argv, err)
            assert rc in (0, 1, 2, 130), (argv, rc, err)
            if rc == 2:
                lines = [ln for ln in err.splitlines() if ln.strip()]
                assert lines and "error" in lines[-1], (argv, err)

"""Plugin pieces that need no SGLang: import weight, registration without SGLang, the policy
file at start, two-phase updates, telemetry gaps, and ``sglang-args``.

Everything that touches SGLang's own classes is in ``tests/contract`` (the contract
environment, ``scripts/contract-env.sh``).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from tests._imports import heavy_imports
from tuner import policyfile
from tuner.cli import main
from tuner.plugin import _sglang
from tuner.plugin.core import PluginCore
from tuner.plugin.launch import adaptive_config, sglang_flags
from tuner.policyfile import PolicyFile
from tuner.protocol import ProtocolError, encode_update

HEAVY = ("sglang", "torch", "numpy", "optuna", "sqlalchemy", "httpx", "msgspec")


def test_importing_the_plugin_imports_nothing_heavy():
    assert heavy_imports("import tuner.plugin", HEAVY) == []


def test_register_without_sglang_logs_and_returns():
    # sys.modules[name] = None makes "import sglang" fail, as on a machine without SGLang.
    code = (
        "import sys, logging; sys.modules['sglang'] = None; logging.basicConfig(); "
        "from tuner.plugin import _sglang; _sglang.register(); "
        "print(_sglang._RT.registered, _sglang._RT.register_error)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("False ModuleNotFoundError")
    assert "could not register the SGLang hooks; SGLang runs as stock" in out.stderr


# --- the policy file at server start ---------------------------------------------------------


def _save(tmp_path, table, arms=(0, 1, 3, 5), version=4):
    return str(policyfile.save(PolicyFile(table=table, arms=arms, policy_version=version),
                               tmp_path / "policy.json"))


def test_start_without_a_policy_file_runs_the_servers_initial_step():
    core = _sglang._new_core([0, 1, 3, 5], 3, {})
    assert core.table == ((None, 3),) and core.version == 0
    # An initial step outside the arms (cannot happen with SGLang) falls back to the middle.
    assert _sglang._new_core([0, 1, 3, 5], 7, {}).table == ((None, 3),)


def test_a_good_policy_file_is_installed_with_its_version(tmp_path):
    path = _save(tmp_path, ((8, 5), (None, 0)))
    core = _sglang._new_core([0, 1, 3, 5], 3, {_sglang.POLICY_FILE_ENV: path})
    assert core.table == ((8, 5), (None, 0)) and core.version == 4
    assert (core.steps_for_batch(8), core.steps_for_batch(9)) == (5, 0)
    assert core.updates_rejected == 0
    # The daemon's next update must carry a greater version.
    assert not core.apply_update(encode_update(((None, 1),), 4))[0]
    assert core.apply_update(encode_update(((None, 1),), 5))[0]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read"),
        ("{", "not valid JSON"),
        (json.dumps({"1": {"candidate_steps": [0, 1]}}), "speculative-adaptive-config file"),
    ],
)
def test_a_bad_policy_file_leaves_the_default_table(tmp_path, caplog, content, problem):
    path = tmp_path / "policy.json"
    if content is not None:
        path.write_text(content)
    with caplog.at_level(logging.ERROR, logger=_sglang.__name__):
        core = _sglang._new_core([0, 1, 3, 5], 1, {_sglang.POLICY_FILE_ENV: str(path)})
    assert core.table == ((None, 1),) and core.version == 0
    assert core.updates_rejected == 1 and problem in core.last_rejection
    assert str(path) in core.last_rejection
    [record] = caplog.records
    assert str(path) in record.getMessage() and "default table" in record.getMessage()


def test_a_policy_file_naming_an_unbuilt_arm_changes_nothing(tmp_path):
    path = _save(tmp_path, ((8, 5), (None, 0)), arms=(0, 5))
    core = _sglang._new_core([0, 1, 3], 1, {_sglang.POLICY_FILE_ENV: path})
    assert (core.table, core.version) == (((None, 1),), 0)
    assert "k=5 is not a built arm" in core.last_rejection and path in core.last_rejection


# --- core pieces the hooks rely on -----------------------------------------------------------


def test_check_update_changes_nothing_until_committed():
    core = PluginCore((0, 1, 3), started_at=0.0, default_arm=1)
    table, version, probes = core.check_update(encode_update(((4, 3), (None, 0)), 1))
    assert (core.table, core.version, core.updates_applied) == (((None, 1),), 0, 0)
    core.commit_update(table, version, probes)
    assert (core.band_table, core.version, core.updates_applied) == (table, 1, 1)
    with pytest.raises(ProtocolError, match="not greater"):
        core.check_update(encode_update(((None, 0),), 1))

    class Hostile(dict):
        def items(self):
            raise RuntimeError("boom")

    with pytest.raises(ProtocolError, match="malformed update: RuntimeError: boom"):
        core.check_update(Hostile(dynspec_protocol=1))
    assert core.updates_rejected == 0  # counting is the caller's decision
    assert core.reject("because") == (False, "because")
    assert (core.updates_rejected, core.last_rejection) == (1, "because")


def test_a_step_after_an_idle_gap_leaves_its_predecessor_untimed():
    core = PluginCore((0, 3), started_at=0.0)
    core.record_decode(4, 3, 8, 4, 10.0, 1)
    core.record_decode(4, 3, 8, 4, 10.5, 2, True)  # scheduler idled in between
    core.record_decode(4, 3, 8, 4, 10.52, 3)
    core.record_decode(4, 3, 8, 4, 10.54, 4)
    [row] = core.telemetry.rows()
    assert (row.decode_steps, row.emitted_tokens) == (2, 16)
    assert row.busy_s == pytest.approx(0.04)
    assert core.telemetry.untimed_steps == 1


# --- sglang-args -----------------------------------------------------------------------------


def test_sglang_args_writes_the_single_slot_config_and_prints_flags(tmp_path, capsys):
    out = tmp_path / "adaptive.json"
    assert main(["sglang-args", "--arms", "5,0,3,1,2", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"1": {"candidate_steps": [0, 1, 2, 3, 5]}}
    printed = capsys.readouterr().out.split()
    assert printed == sglang_flags(config_path=out.resolve())
    assert printed[:6] == ["--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "1",
                           "--speculative-adaptive", "--speculative-adaptive-config"]
    assert "--max-running-requests" in printed


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--arms", "0,-1"], "arms must be >= 0"),
        (["--arms", "1,3", "--initial-steps", "2"], "initial steps 2 is not among the arms"),
        (["--arms", "0,40"], "larger than"),
        (["--out", "/nonexistent-dir/a.json"], "cannot write"),
    ],
)
def test_sglang_args_refuses_bad_input_with_exit_2(tmp_path, capsys, argv, problem):
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "a.json")]
    assert main(["sglang-args", *argv]) == 2
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists()


def test_adaptive_config_is_sorted_and_deduplicated():
    assert adaptive_config([3, 0, 3, 1]) == {"1": {"candidate_steps": [0, 1, 3]}}

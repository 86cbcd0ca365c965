"""The exported ``sglang-adaptive`` file through SGLang 0.5.23's own config loader and router.

Stock SGLang reads this file without our plugin, so the class under test is SGLang's own
``AdaptiveSpeculativeParams`` (``stock_adaptive_params``), even in a session where
``load_plugins()`` has replaced it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _contract_env import need, stock_adaptive_params

need()

from sglang.srt.speculative import adaptive_spec_params as adaptive  # noqa: E402

from storage import PolicyVersionRecord, ServerSeen, Storage  # noqa: E402
from tuner.export import export  # noqa: E402
from tuner.protocol import lookup  # noqa: E402
from tuner.sim.graphs import cuda_graph_bs  # noqa: E402

pytestmark = pytest.mark.contract

SERVER = "10.0.0.9:30000"
TABLE = ((2, 5), (16, 3), (48, 1), (None, 0))


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    with Storage(url) as st:
        st.record_tick(
            servers=[ServerSeen(SERVER, (0, 1, 3, 5), 1000.0)],
            policy_versions=[PolicyVersionRecord(SERVER, 1001.0, 7, TABLE, "thompson", "greedy")],
        )
        res = export(st, fmt="sglang-adaptive", out=tmp_path / "adaptive.json", now=1002.0)
    assert res.warnings == ()
    return res.path


def test_sglang_loads_the_file_and_builds_exactly_the_table_arms(exported: Path) -> None:
    cfg, slots = adaptive._load_adaptive_config(str(exported))
    assert sorted(slots) == [1, 3, 17, 49]
    assert all(len(entry["candidate_steps"]) == 1 for entry in slots.values())
    # The union SGLang pre-builds runtime state for (and sizes its buffers by).
    assert adaptive.resolve_candidate_steps_from_config(str(exported)) == [0, 1, 3, 5]
    assert cfg["_dynspec"]["prebuilt_arms"] == [0, 1, 3, 5]


def test_sglang_routes_every_batch_size_to_the_table_arm(exported: Path) -> None:
    params = stock_adaptive_params()(initial_steps=3, cfg_path=str(exported))
    graphs = list(cuda_graph_bs(256))
    params.set_cuda_graph_bs(graphs)
    assert params.candidate_steps == [0, 1, 3, 5]
    for b in range(1, 300):
        assert params.get_steps_for_batch(b) == lookup(TABLE, b), b
    # Each arm gets CUDA graphs exactly at the captured sizes its rows cover.
    for k in (0, 1, 3, 5):
        assert params.cuda_graph_bs_for_step(k) == [g for g in graphs if lookup(TABLE, g) == k]


def test_sglang_ema_cannot_override_a_single_candidate(exported: Path) -> None:
    params = stock_adaptive_params()(initial_steps=3, cfg_path=str(exported))
    params.set_cuda_graph_bs(list(cuda_graph_bs(256)))
    for b, accepted in ((1, 5), (1, 0), (8, 3), (8, 0), (32, 1), (32, 0), (100, 0)):
        for _ in range(200):  # far beyond warmup_batches and update_interval
            assert params.on_verify_complete([accepted] * b, b) is None
        assert params.get_steps_for_batch(b) == lookup(TABLE, b)

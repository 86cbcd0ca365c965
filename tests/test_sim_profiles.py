"""Cost profiles: the calibration table reproduced, interpolation, refusal, bad files."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from tuner.errors import ConfigError
from tuner.sim.profiles import (
    ParametricProfile,
    ProfileRangeError,
    TableProfile,
    list_profiles,
    load_profile,
)

SHIPPED_TABLE = resources.files("tuner.sim").joinpath("profiles", "h200-llama8b.jsonl")
# The measurement the shipped table was copied from (present in the project's workspace).
# The measured table the shipped profile was copied from, where a checkout has it beside it.
CALIBRATION = (
    Path(__file__).resolve().parents[2] / "shared" / "calibration"
    / "h200-llama8b-bf16-ctx1024.jsonl"
)


def _cost_rows(text: str) -> list[dict]:
    return [r for r in map(json.loads, text.splitlines()) if r.get("kind") == "cost"]


def _write(tmp_path, name: str, lines: list[object]) -> str:
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(p)


def test_shipped_profiles_load():
    assert set(list_profiles()) == {
        "h200-llama8b",
        "h100-llama8b",
        "seed-kimi-pcie",
        "h200-moe-qwen3-30b-a3b",
        "h200-moe-mixtral-8x7b",
        "h200-llama8b-q16",
        "h200-moe-qwen3-30b-a3b-q16",
    }
    for name in list_profiles():
        p = load_profile(name)
        assert p.name == name
        assert p.step_s(1, 0) > 0


def test_shipped_h200_table_equals_the_calibration_file():
    prof = load_profile("h200-llama8b")
    assert isinstance(prof, TableProfile)
    rows = _cost_rows(SHIPPED_TABLE.read_text())
    assert len(rows) == 84
    if CALIBRATION.exists():
        assert rows == _cost_rows(CALIBRATION.read_text())
    for r in rows:
        assert prof.target_ms(r["b"], r["q"]) == r["target_ms"]
        assert prof.draft_ms(r["b"], r["q"]) == r["draft_ms"]


def test_step_composition_at_measured_points():
    prof = load_profile("h200-llama8b")
    t, d = prof.target_ms, prof.draft_ms
    # spec step = k·draft(b,1) + target(b,k+1) + draft(b,k+1)
    assert prof.step_s(32, 3) * 1000 == pytest.approx(
        3 * d(32, 1) + t(32, 4) + d(32, 4), rel=1e-12
    )
    # k=0: SGLang still runs the one-token draft extend unless told to skip it
    assert prof.step_s(32, 0) * 1000 == pytest.approx(t(32, 1) + d(32, 1), rel=1e-12)
    assert prof.step_s(32, 0, skip_zero_draft_extend=True) * 1000 == pytest.approx(t(32, 1))
    assert prof.base_step_s(32) * 1000 == pytest.approx(t(32, 1))


def test_interpolates_linearly_in_b_and_q():
    prof = TableProfile(
        rows=[(1, 1, 10.0, 1.0), (1, 3, 14.0, 2.0), (9, 1, 18.0, 3.0), (9, 3, 30.0, 6.0)],
        name="toy",
    )
    assert prof.target_ms(5, 1) == pytest.approx(14.0)
    assert prof.target_ms(1, 2) == pytest.approx(12.0)
    # (5, 2): midway in q at b=1 (12) and b=9 (24), then midway in b
    assert prof.target_ms(5, 2) == pytest.approx(18.0)
    assert prof.step_s(5, 1) * 1000 == pytest.approx(1 * 2.0 + 18.0 + prof.draft_ms(5, 2))


def test_extrapolation_is_refused_with_a_clear_error():
    prof = load_profile("h200-llama8b")
    with pytest.raises(ProfileRangeError, match=r"measured batch sizes 1\.\.256; batch size 300"):
        prof.step_s(300, 1)
    with pytest.raises(ProfileRangeError, match=r"q=9 \(arm k=8\)"):
        prof.step_s(16, 8)
    assert isinstance(ProfileRangeError("x"), ConfigError)


def test_clamp_and_linear_extrapolation_when_asked():
    clamp = load_profile("h200-llama8b", extrapolate="clamp")
    linear = load_profile("h200-llama8b", extrapolate="linear")
    at_max = clamp.step_s(256, 1)
    assert clamp.step_s(300, 1) == pytest.approx(at_max)
    assert linear.step_s(300, 1) > at_max
    assert clamp.max_batch is None and load_profile("h200-llama8b").max_batch == 256


def test_seed_profile_reproduces_its_headline_numbers():
    # τ(3) = 1 + .7 + .49 + .343 for the Kimi chat preset (anchors §3.2 P3)
    prof = load_profile("seed-kimi-pcie")
    tau3 = 1 + 0.7 + 0.7**2 + 0.7**3
    assert tau3 / prof.step_s(1, 3) == pytest.approx(96, rel=0.01)
    assert 64 * tau3 / prof.step_s(64, 3) == pytest.approx(354, rel=0.01)
    assert 64 / prof.base_step_s(64) == pytest.approx(773, rel=0.01)
    assert prof.max_running == 64 and prof.acceptance == "kimi-eagle3"


def test_seed_profile_reads_the_experts_kimi_k25_touches():
    """Kimi-K2.5 routes each token to 8 of 384 experts: a step of N tokens reads the expected
    distinct experts of N tokens (the verify's b·(k+1) tokens, not b), the shared expert always."""
    from dataclasses import replace

    from tuner.calibrate import expected_experts

    prof = load_profile("seed-kimi-pcie")
    dense = replace(prof, t_e=0.0, expert_frac=0.0)
    for b in (1, 4, 16, 64):
        routed_ms = 1000 * (prof.base_step_s(b) - dense.base_step_s(b))
        assert routed_ms == pytest.approx(prof.t_e * expected_experts(384, 8, b) / 384, rel=1e-9)
    # The verify of k+1 tokens per request pays for the experts of b·(k+1) tokens.
    extra = 1000 * (prof.step_s(4, 3) - dense.step_s(4, 3))
    assert extra == pytest.approx(prof.t_e * expected_experts(384, 8, 16) / 384, rel=1e-9)


def test_a_user_written_parametric_profile(tmp_path):
    path = _write(
        tmp_path,
        "mine.json",
        [
            {
                "kind": "parametric",
                "t_o": 1.0,
                "t_w": 4.0,
                "c_f": 0.1,
                "kv_seq": 0.0,
                "d_o": 0.5,
                "e_o": 0.5,
                "v_o": 0.0,
                "d_n": 0.0,
                "e_n": 0.0,
            }
        ],
    )
    prof = load_profile(path)
    assert isinstance(prof, ParametricProfile) and prof.name == "mine"
    # k=2: fwd over 3 tokens (1 + 4 + 0.3) + 2 drafts (1.0) + extend (0.5)
    assert prof.step_s(1, 2) * 1000 == pytest.approx(6.8)
    assert prof.step_s(1, 0) * 1000 == pytest.approx(5.6)
    assert prof.step_s(1, 0, skip_zero_draft_extend=True) * 1000 == pytest.approx(5.1)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], "empty"),
        (["{not json"], r"bad.jsonl:1: not a JSON object"),
        ([[1, 2]], r"bad.jsonl:1: each line must be a JSON object"),
        ([{"b": 1, "q": 1, "target_ms": 1, "draft_ms": 1}], r"bad.jsonl:1: missing field 'kind'"),
        (
            [{"kind": "cost", "q": 1, "target_ms": 1, "draft_ms": 1}],
            r"bad.jsonl:1: missing field 'b'",
        ),
        (
            [{"kind": "info"}, {"kind": "cost", "b": 1, "q": 1, "target_ms": -2, "draft_ms": 1}],
            r"bad.jsonl:2: field 'target_ms' must be > 0",
        ),
        (
            [{"kind": "cost", "b": 1.5, "q": 1, "target_ms": 2, "draft_ms": 1}],
            r"field 'b' must be an integer",
        ),
        (
            [{"kind": "cost", "b": 1, "q": 1, "target_ms": "2", "draft_ms": 1}],
            r"field 'target_ms' must be a finite",
        ),
        ([{"kind": "info"}], "no cost rows"),
        (
            [{"kind": "cots", "b": 1, "q": 1, "target_ms": 2, "draft_ms": 1}],
            r"bad.jsonl:1: unknown row kind 'cots'",
        ),
        ([{"kind": "cost", "b": 4, "q": 2, "target_ms": 2, "draft_ms": 1}], "b=4 has no q=1 row"),
        (
            [{"kind": "cost", "b": 1, "q": 1, "target_ms": 2, "draft_ms": 1}] * 2,
            "duplicate cost row for b=1, q=1",
        ),
        (
            [
                {"kind": "info", "max_running": 0},
                {"kind": "cost", "b": 1, "q": 1, "target_ms": 2, "draft_ms": 1},
            ],
            "field 'max_running' must be an integer >= 1",
        ),
        (
            [
                {"kind": "info", "acceptance": "vibes"},
                {"kind": "cost", "b": 1, "q": 1, "target_ms": 2, "draft_ms": 1},
            ],
            "acceptance must be one of",
        ),
    ],
)
def test_bad_table_files_name_file_line_and_field(tmp_path, lines, message):
    path = _write(tmp_path, "bad.jsonl", lines)
    with pytest.raises(ConfigError, match=message):
        load_profile(path)


# A valid parametric profile's fields; each bad file below changes or adds one.
_PARAMETRIC = {"t_o": 1, "t_w": 1, "c_f": 0, "kv_seq": 0, "d_o": 0, "e_o": 0, "v_o": 0, "d_n": 0,
               "e_n": 0}


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"t_w": 1.0}, "lacks field 't_o'"),
        ({**_PARAMETRIC, "t_q": 3}, "unknown field 't_q'"),
        ({**_PARAMETRIC, "t_o": -1}, "field 't_o' must be a number >= 0"),
        ({**_PARAMETRIC, "t_o": "1"}, "field 't_o' must be a number >= 0"),
        ({**_PARAMETRIC, "expert_frac": 2}, "field 'expert_frac' must be in"),
    ],
)
def test_bad_parametric_files(tmp_path, obj, message):
    path = _write(tmp_path, "p.json", [{"kind": "parametric", **obj}])
    with pytest.raises(ConfigError, match=message) as info:
        load_profile(path)
    assert "p.json" in str(info.value)


def test_unknown_profile_name():
    with pytest.raises(ConfigError, match="unknown profile 'h300'.*h200-llama8b"):
        load_profile("h300")


def test_a_file_in_the_calibration_format_loads(tmp_path):
    # The measurement's own file: info row without our extra fields.
    lines = SHIPPED_TABLE.read_text().splitlines()
    info = {"kind": "info", "gpu": "NVIDIA H200", "ctx": 1024}
    path = _write(tmp_path, "h200-llama8b-bf16-ctx1024.jsonl", [info, *lines[1:]])
    prof = load_profile(path)
    assert prof.name == "h200-llama8b-bf16-ctx1024"
    assert prof.acceptance == "eagle3-dense"
    assert prof.step_s(48, 5) == load_profile("h200-llama8b").step_s(48, 5)


# --- mixture-of-experts tables --------------------------------------------------------------

MOE_TABLES = ("h200-moe-qwen3-30b-a3b", "h200-moe-mixtral-8x7b")
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("name", MOE_TABLES)
def test_shipped_moe_tables_are_the_measured_files(name):
    shipped = resources.files("tuner.sim").joinpath("profiles", f"{name}.jsonl").read_text()
    assert _cost_rows(shipped) == _cost_rows((RESULTS / f"{name}.jsonl").read_text())
    prof = load_profile(name)
    assert isinstance(prof, TableProfile) and len(prof.batch_sizes) == 12
    info = json.loads(shipped.splitlines()[0])
    assert info["experts"] > 0 and info["gpu"] == "NVIDIA H200" and info["complete"] is True


def _gain(prof, b: int, arms=(0, 1, 2, 3, 4, 5, 7), workload: str = "chat") -> tuple[int, float]:
    """Best arm at ``b`` and its goodput over no speculation."""
    from tuner.sim.oracle import expected_goodput, oracle_arm

    k = oracle_arm(prof, workload, b, arms)
    return k, expected_goodput(prof, workload, b, k) / expected_goodput(prof, workload, b, 0)


@pytest.mark.parametrize("name", MOE_TABLES)
def test_moe_tables_pay_least_at_few_requests_and_most_at_mid_batch(name):
    """The MoE signature: a verify of k+1 tokens per request touches more experts at few
    requests, so speculation's gain rises from 1 request to 16-32, and the deepest arm is best
    somewhere in the middle; a dense table's gain only falls with the batch."""
    prof = load_profile(name)
    gains = {b: _gain(prof, b) for b in (1, 4, 8, 16, 32, 64, 256)}
    mid = max(gains[16][1], gains[32][1])
    assert mid > 1.3 * gains[1][1]
    assert mid > gains[256][1]
    assert any(gains[b][0] == 7 for b in (8, 16, 32))
    dense = load_profile("h200-llama8b")
    assert _gain(dense, 1)[1] > _gain(dense, 16)[1] > _gain(dense, 64)[1]


def test_moe_verify_costs_most_relative_to_decode_at_few_requests():
    prof = load_profile("h200-moe-qwen3-30b-a3b")
    ratio = {b: prof.step_s(b, 7) / prof.step_s(b, 0) for b in (4, 32)}
    assert ratio[4] > 1.4 * ratio[32]


@pytest.mark.parametrize(
    "base", ["h200-llama8b", "h200-moe-qwen3-30b-a3b"],
)
def test_q16_tables_repeat_the_shipped_ones_and_reach_a_16_token_tree(base):
    """The q-16 re-measurements agree with the shipped tables where both measured (same GPU
    model, another day; repeat runs stayed within 10 %) and price a 16-token verify the shipped
    tables refuse."""
    old, new = load_profile(base), load_profile(f"{base}-q16")
    for b in (1, 4, 16, 64, 256):
        for k in range(8):
            assert new.step_s(b, k) == pytest.approx(old.step_s(b, k), rel=0.10)
        with pytest.raises(ProfileRangeError):
            old.target_ms(b, 16)
        assert new.target_ms(b, 16) >= new.target_ms(b, 8)

"""calibrate: shapes, the grid, the table file, the CLI without a GPU, and the torch boundary."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.calibrate import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_TOKENS_PER_SEQ,
    KIMI_K2,
    LLAMA3_8B,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    QWEN25_32B,
    CalibrationGrid,
    CalibrationSettings,
    CostRow,
    ModelShape,
    expected_experts,
    read_table,
    resolve_shape,
    touched_experts,
    write_table,
)
from tuner.calibrate._moe import balanced_routing, layer_split
from tuner.calibrate.gpu import cuda_problem
from tuner.cli import main
from tuner.errors import ConfigError
from tuner.sim.profiles import load_profile

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tuner" / "sim" / "profiles" / "h200-llama8b.jsonl"
MEASURED = ROOT / "benchmarks" / "results" / "h200-llama8b-calibrated.jsonl"


# --- the torch boundary -------------------------------------------------------------------


def test_importing_the_package_and_cli_never_imports_torch():
    code = (
        "import sys, tuner.calibrate, tuner.calibrate.gpu, tuner.cli;"
        "tuner.cli.build_parser();"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_only_calibrate_gpu_imports_torch():
    pattern = re.compile(r"^\s*(import torch|from torch)", re.MULTILINE)
    offenders = [
        str(p.relative_to(ROOT))
        for pkg in ("tuner", "policies", "storage")
        for p in (ROOT / pkg).rglob("*.py")
        if pattern.search(p.read_text(encoding="utf-8"))
        and p != ROOT / "tuner" / "calibrate" / "gpu.py"
    ]
    assert offenders == []


# --- shapes ---------------------------------------------------------------------------------


def test_presets_have_the_published_sizes():
    # Llama-3-8B: 8.03 B parameters with the (untied) embedding.
    total = LLAMA3_8B.target_params() + LLAMA3_8B.vocab * LLAMA3_8B.hidden
    assert total == pytest.approx(8.03e9, rel=0.005)
    assert LLAMA3_8B.head_dim == 128 and LLAMA3_8B.group == 4
    assert QWEN25_32B.qkv_bias and QWEN25_32B.group == 5
    assert resolve_shape("llama3-8b") is LLAMA3_8B


def test_shape_file_with_our_fields_or_a_hugging_face_config(tmp_path: Path):
    ours = tmp_path / "mine.json"
    ours.write_text(json.dumps(
        {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "inter": 8192, "vocab": 128256}
    ))
    s = resolve_shape(str(ours))
    assert (s.name, s.hidden, s.head_dim, s.kv_heads) == ("mine", 2048, 64, 8)
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({
        "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40,
        "num_key_value_heads": 8, "intermediate_size": 27648, "vocab_size": 152064,
        "attention_bias": True, "torch_dtype": "bfloat16",
    }))
    s = resolve_shape(str(hf))
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.inter, s.vocab, s.qkv_bias) == (
        5120, 64, 40, 8, 27648, 152064, True)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"hidden": 4096, "layers": 2, "heads": 32}', "missing field(s) inter, vocab"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"hidden": 4096, "layers": 2, "heads": 32, "kv_heads": 5, "inter": 8, "vocab": 9}',
         "multiple of kv_heads"),
        ('{"hidden": 4096, "layers": 0, "heads": 32, "inter": 8, "vocab": 9}', "layers"),
    ],
)
def test_bad_shape_file_names_the_file_and_the_problem(tmp_path: Path, content: str, needle: str):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        resolve_shape(str(f))
    assert str(f) in str(info.value)


def test_unknown_shape_name_lists_the_presets():
    presets = "kimi-k2, llama3-8b, mixtral-8x7b, qwen2.5-32b, qwen3-30b-a3b"
    with pytest.raises(ConfigError, match=presets):
        resolve_shape("llama9")


# --- mixture of experts ---------------------------------------------------------------------


def test_moe_presets_have_the_published_sizes():
    # Total parameters with the untied embedding: 30.5 B, 46.7 B, 1.04 T.
    for shape, total in ((QWEN3_30B_A3B, 30.5e9), (MIXTRAL_8X7B, 46.7e9), (KIMI_K2, 1.04e12)):
        assert shape.target_params() + shape.vocab * shape.hidden == pytest.approx(total, rel=0.01)
    assert QWEN3_30B_A3B.shared_experts == 0 and QWEN3_30B_A3B.head_dim == 128
    assert MIXTRAL_8X7B.moe_inter == MIXTRAL_8X7B.inter == 14336  # per expert, no separate size
    assert (KIMI_K2.experts, KIMI_K2.experts_per_tok, KIMI_K2.shared_experts) == (384, 8, 1)
    assert KIMI_K2.shared_inter == KIMI_K2.moe_inter == 2048
    # The draft layer is dense whatever the target: Kimi's MLP of 18432, not 384 experts.
    assert KIMI_K2.draft_params() < KIMI_K2.layer_params() / 10
    assert "experts" in KIMI_K2.to_info() and "experts" not in LLAMA3_8B.to_info()


def _hf(tmp_path: Path, name: str, config: dict) -> ModelShape:
    f = tmp_path / f"{name}.json"
    f.write_text(json.dumps(config))
    return resolve_shape(str(f))


def test_hugging_face_moe_configs_parse(tmp_path: Path):
    base = {"num_hidden_layers": 4, "vocab_size": 1000, "torch_dtype": "bfloat16"}
    qwen3 = _hf(tmp_path, "qwen3", {
        **base, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    })
    assert (qwen3.experts, qwen3.experts_per_tok, qwen3.moe_inter) == (128, 8, 768)
    assert qwen3.inter == 6144  # the dense draft's MLP
    assert qwen3.shared_experts == 0
    mixtral = _hf(tmp_path, "mixtral", {
        **base, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
    })
    assert (mixtral.experts, mixtral.experts_per_tok, mixtral.moe_inter) == (8, 2, 14336)
    qwen2 = _hf(tmp_path, "qwen2moe", {
        **base, "hidden_size": 2048, "num_attention_heads": 16, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "num_experts": 60, "num_experts_per_tok": 4,
        "shared_expert_intermediate_size": 5632,
    })
    assert (qwen2.shared_experts, qwen2.shared_inter) == (1, 5632)
    # Kimi-K2.5 nests its text model; DeepSeek-V3 layout with MLA attention.
    kimi = _hf(tmp_path, "kimi", {"architectures": ["KimiK25ForConditionalGeneration"],
                                  "text_config": {
        **base, "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "first_k_dense_replace": 1,
    }})
    assert (kimi.experts, kimi.experts_per_tok, kimi.shared_experts, kimi.shared_inter) == (
        384, 8, 1, 2048)
    # MLA's 576-value latent per token and layer -> 2 KV heads of 128 (512 values), not 64.
    assert (kimi.kv_heads, kimi.head_dim) == (2, 128)
    assert kimi.kv_bytes_per_token(layers=1) == KIMI_K2.kv_bytes_per_token(layers=1)
    dense = _hf(tmp_path, "dense", {
        **base, "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 1024,
        "num_experts": 0, "num_experts_per_tok": 2,
    })
    assert not dense.is_moe and dense.experts_per_tok == 0


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"num_experts": 8, "num_experts_per_tok": 9}, "experts_per_tok must be in 1..8"),
        ({"num_experts": 8}, "experts_per_tok must be in 1..8"),
        ({"num_experts": -2, "num_experts_per_tok": 1}, "experts must be a non-negative"),
    ],
)
def test_bad_moe_fields_name_the_file_and_the_field(tmp_path: Path, extra: dict, needle: str):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"hidden": 64, "layers": 2, "heads": 4, "inter": 8, "vocab": 9,
                             **extra}))
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        resolve_shape(str(f))
    assert str(f) in str(info.value)
    with pytest.raises(ValueError, match="need experts > 0"):
        ModelShape(name="x", hidden=64, layers=2, heads=4, kv_heads=4, inter=8, vocab=9,
                   experts_per_tok=2)


def test_expected_experts_matches_random_top_k_routing():
    rng = random.Random(7)
    cases = ((128, 8, 1), (128, 8, 4), (128, 8, 24), (8, 2, 3), (384, 8, 64))
    for experts, top_k, tokens in cases:
        trials = 400
        seen = sum(
            len({e for _ in range(tokens) for e in rng.sample(range(experts), top_k)})
            for _ in range(trials)
        ) / trials
        assert expected_experts(experts, top_k, tokens) == pytest.approx(seen, rel=0.02)
    assert expected_experts(128, 8, 1) == pytest.approx(8)
    assert expected_experts(8, 8, 3) == 8
    assert expected_experts(128, 8, 10_000) == pytest.approx(128)
    with pytest.raises(ValueError, match="top_k 9 exceeds"):
        expected_experts(8, 9, 1)
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        expected_experts(8, 2, 0)


def test_touched_experts_and_layer_split_stay_possible_and_average_to_the_expectation():
    assert touched_experts(128, 8, 1) == 8 and touched_experts(128, 8, 2048) == 128
    assert touched_experts(8, 2, 2) == 4  # 3.5 rounds half up
    for experts, top_k in ((128, 8), (8, 2), (384, 8)):
        prev = 0
        for tokens in (1, 2, 3, 5, 8, 16, 64, 512):
            split = layer_split(experts, top_k, tokens, 48)
            assert max(split) - min(split) <= 1 and split == tuple(sorted(split, reverse=True))
            assert top_k <= min(split) and max(split) <= min(experts, tokens * top_k)
            mean = sum(split) / len(split)
            want = expected_experts(experts, top_k, tokens)
            assert mean == pytest.approx(want, abs=0.5 / 48 + 1e-9)
            assert mean >= prev
            prev = mean


def test_balanced_routing_gives_each_token_distinct_experts_and_each_expert_a_fair_share():
    for experts, top_k, tokens in ((128, 8, 1), (128, 8, 5), (8, 2, 3), (16, 4, 40)):
        r = balanced_routing(experts, top_k, tokens)
        assert r.experts == touched_experts(experts, top_k, tokens)
        slots = tokens * top_k
        per_token: dict[int, list[int]] = {}
        loads = []
        for e in range(r.experts):
            cell = range(e * r.per_expert, (e + 1) * r.per_expert)
            real = [i for i in cell if r.choice_of[i] < slots]
            loads.append(len(real))
            for i in real:
                per_token.setdefault(r.token_of[i], []).append(e)
                assert r.choice_of[i] // top_k == r.token_of[i]
        assert sorted(per_token) == list(range(tokens))
        assert all(len(set(es)) == len(es) == top_k for es in per_token.values())
        assert sum(loads) == slots and max(loads) - min(loads) <= 1 and min(loads) >= 1
        assert r.padding == r.experts * r.per_expert - slots
        assert sorted(c for c in r.choice_of if c < slots) == list(range(slots))
    with pytest.raises(ValueError, match="touched must be in 2..6"):
        balanced_routing(8, 2, 3, touched=7)


def test_layers_fitting_builds_what_half_the_memory_holds():
    gib = 1 << 30
    assert LLAMA3_8B.layers_fitting(70 * gib) == 32  # the dense tables are built whole
    assert QWEN3_30B_A3B.layers_fitting(70 * gib) == 48
    assert MIXTRAL_8X7B.layers_fitting(70 * gib) == 25
    assert KIMI_K2.layers_fitting(70 * gib) == 2 and KIMI_K2.layers_fitting(1) == 1
    assert KIMI_K2.built_params(2) < KIMI_K2.built_params(61)


# --- the grid -------------------------------------------------------------------------------


def test_default_grid_is_the_reference_tables_grid():
    ref = read_table(REFERENCE)
    assert DEFAULT_BATCH_SIZES == tuple(sorted({r.b for r in ref.rows}))
    assert DEFAULT_TOKENS_PER_SEQ == tuple(sorted({r.q for r in ref.rows}))


def test_grid_sorts_dedupes_and_runs_batch_size_by_batch_size():
    g = CalibrationGrid(batch_sizes=(8, 1, 8, 2), tokens_per_seq=(4, 1, 2))
    assert g.batch_sizes == (1, 2, 8) and g.tokens_per_seq == (1, 2, 4)
    assert len(g) == 9
    assert list(g.points())[:4] == [(1, 1), (1, 2), (1, 4), (2, 1)]
    assert g.priced_arms() == (0, 1, 3)
    assert CalibrationGrid(batch_sizes=(1,), tokens_per_seq=(2, 3)).priced_arms() == ()


@pytest.mark.parametrize(
    "kw",
    [
        {"batch_sizes": ()},
        {"batch_sizes": (0, 1)},
        {"tokens_per_seq": (1, 65)},
        {"tokens_per_seq": (1.5,)},
    ],
)
def test_bad_grid_is_refused(kw):
    with pytest.raises(ValueError):
        CalibrationGrid(**kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"ctx": -1},
        {"dtype": "fp8"},
        {"replays": 0},
        {"rounds": 0},
        {"point_cooldown_s": -1},
        {"layers": 0},
        {"layers": 2.5},
    ],
)
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        CalibrationSettings(**kw)


# --- the table file -------------------------------------------------------------------------


def _rows() -> list[CostRow]:
    return [
        CostRow(b=b, q=q, target_ms=5.0 + 0.01 * b * q, draft_ms=0.25 + 0.001 * b * q)
        for b in (4, 1) for q in (3, 1, 2, 4)
    ]


def test_written_table_reads_back_and_loads_in_the_simulator(tmp_path: Path):
    out = write_table(tmp_path / "t.jsonl", {"gpu": "X", "ctx": 1024}, _rows())
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0] == {"kind": "info", "gpu": "X", "ctx": 1024}
    assert [(r["b"], r["q"]) for r in lines[1:4]] == [(1, 1), (1, 2), (1, 3)]
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left behind
    table = read_table(out)
    assert table.info == {"gpu": "X", "ctx": 1024}
    prof = load_profile(out)
    for b in (1, 4):
        for k in (0, 1, 3):
            want = table.step_ms(b, k) + (table.cell(b, 1).draft_ms if k == 0 else 0.0)
            assert prof.step_s(b, k) * 1000 == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{oops", "not a JSON object"),
        ('{"kind": "cost", "b": 1, "q": 1, "target_ms": 5}', "missing field 'draft_ms'"),
        ('{"kind": "cost", "b": 1, "q": 1, "target_ms": -5, "draft_ms": 1}', "target_ms"),
        ('{"kind": "cost", "b": 1, "q": 1, "target_ms": 5, "draft_ms": 1}', "duplicate"),
        ('{"kind": "bogus"}', "unknown row kind"),
    ],
)
def test_bad_table_line_is_named(tmp_path: Path, line: str, needle: str):
    f = tmp_path / "t.jsonl"
    f.write_text('{"kind": "cost", "b": 1, "q": 1, "target_ms": 5, "draft_ms": 1}\n' + line + "\n")
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        read_table(f)
    assert f"{f}:2" in str(info.value)


def test_h200_table_measured_by_calibrate_loads_unchanged_and_covers_the_reference():
    mine, ref = read_table(MEASURED), read_table(REFERENCE)
    assert mine.info["gpu"] == "NVIDIA H200" and mine.info["complete"] is True
    assert set(mine.as_dict()) == set(ref.as_dict())
    prof = load_profile(MEASURED)
    assert prof.batch_sizes == DEFAULT_BATCH_SIZES


def test_h200_table_measured_by_calibrate_is_within_10_percent_of_the_reference_everywhere():
    mine, ref = read_table(MEASURED).as_dict(), read_table(REFERENCE).as_dict()
    assert read_table(MEASURED).info["draft_timing"] == "before"
    off = {
        (point, col): getattr(mine[point], col) / getattr(ref[point], col)
        for point in ref
        for col in ("target_ms", "draft_ms")
        if abs(getattr(mine[point], col) / getattr(ref[point], col) - 1) > 0.10
    }
    assert not off


# --- the CLI without a GPU ------------------------------------------------------------------


@pytest.mark.skipif(cuda_problem() is None, reason="a CUDA device is present: would measure")
def test_cli_refuses_to_measure_without_a_cuda_device(tmp_path: Path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["calibrate", "--shape", "llama3-8b", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and ("not installed" in err or "no CUDA device" in err)
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--shape", "nope"], "unknown shape 'nope'"),
        (["--shape", "llama3-8b", "--batch-sizes", "0,4"], "batch sizes must be positive"),
        (["--shape", "llama3-8b", "--server", "h:1"], "--server goes with --from-db"),
        (["--from-db", "sqlite:///x.db"], "--from-db needs --server"),
        (["--shape", "kimi-k2", "--layers", "0"], "layers must be a positive integer"),
    ],
)
def test_cli_usage_errors_exit_2(tmp_path: Path, capsys, argv, needle):
    assert main(["calibrate", *argv, "--out", str(tmp_path / "t.jsonl")]) == 2
    assert needle in capsys.readouterr().err


def test_draft_timing_takes_before_or_after(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--shape", "llama3-8b", "--draft-timing", "during", "--out", "x"])
    assert exc.value.code == 2
    assert "invalid choice: 'during'" in capsys.readouterr().err


def test_shape_and_from_db_are_exclusive(tmp_path: Path):
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--shape", "llama3-8b", "--from-db", "sqlite://", "--out", "x"])
    assert exc.value.code == 2

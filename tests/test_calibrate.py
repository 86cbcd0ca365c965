"""calibrate: shapes, the grid, the table file, the CLI without a GPU, and the torch boundary."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.calibrate import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_TOKENS_PER_SEQ,
    LLAMA3_8B,
    QWEN25_32B,
    CalibrationGrid,
    CalibrationSettings,
    CostRow,
    read_table,
    resolve_shape,
    write_table,
)
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
    with pytest.raises(ConfigError, match="kimi-k2, llama3-8b, mixtral-8x7b, qwen2.5-32b, qwen3-30b-a3b"):
        resolve_shape("llama9")


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
    "kw", [{"ctx": -1}, {"dtype": "fp8"}, {"replays": 0}, {"rounds": 0}, {"point_cooldown_s": -1}]
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

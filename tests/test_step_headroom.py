"""The bands' ceiling (benchmarks/step_headroom.py --bands): what a table over the plugin's
live acceptance estimate could take of the per-step oracle's headroom at most."""

from __future__ import annotations

import json

import pytest

from tests._bench_scripts import load_benchmark

sh = load_benchmark("step_headroom")


@pytest.fixture(scope="module")
def one_request() -> dict[str, dict[str, float]]:
    return {wl: sh.band_ceiling("h100-llama8b", wl, 1, 40.0, 5.0, 0, 3)
            for wl in ("chat", "diverse")}


def test_finer_cuts_take_more_and_none_beats_the_per_step_oracle(one_request):
    for c in one_request.values():
        # The 1/40 cuts refine the protocol's bands (edges 0.55, 0.70, 0.85 fall on them), and
        # any rule from the batch's acceptance is one per-step choice among the oracle's.
        assert 0.0 <= c["bands"] <= c["fine"] + 1e-9 <= c["step_oracle"] + 2e-9
        assert 0.0 <= c["exact_bands"] <= c["exact_fine"] + 1e-9 <= c["step_oracle"] + 2e-9


def test_at_one_request_the_bands_can_take_most_of_the_headroom_where_requests_differ(
        one_request):
    chat, diverse = one_request["chat"], one_request["diverse"]
    assert diverse["step_oracle"] > chat["step_oracle"] + 2.0
    assert diverse["bands"] > 0.5 * diverse["step_oracle"]


def test_the_shadow_estimate_leaves_the_run_as_the_per_bucket_table_runs_it():
    # The shadow draws come from a stream of their own: the engine's steps, and so the
    # per-step oracle's headroom, are those of the plain headroom measurement.
    c = sh.band_ceiling("h100-llama8b", "diverse", 2, 20.0, 5.0, 1, 3)
    assert c["step_oracle"] == pytest.approx(sh.headroom("h100-llama8b", "diverse", 2, 20.0,
                                                         5.0, 1), rel=1e-9)


def test_bands_mode_prints_a_row_per_profile_and_workload(capsys, tmp_path):
    out = tmp_path / "ceiling.json"
    assert sh.main(["--bands", "--profiles", "h100-llama8b", "--workloads", "diverse",
                    "--concurrency", "1", "--seconds", "10", "--warmup", "2", "--seeds", "1",
                    "--jobs", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "h100-llama8b" in text and "diverse" in text
    assert '"probe_arm": 3' in out.read_text()


def test_band_capture_prints_each_cell_with_the_ceiling_beside_it(capsys, tmp_path):
    capture = load_benchmark("band_capture")
    ceiling = tmp_path / "ceiling.json"
    assert sh.main(["--bands", "--profiles", "h100-llama8b", "--workloads", "diverse",
                    "--concurrency", "1", "--seconds", "10", "--warmup", "2", "--seeds", "1",
                    "--jobs", "1", "--json", str(ceiling)]) == 0
    capsys.readouterr()
    out = tmp_path / "capture.json"
    assert capture.main(["--profiles", "h100-llama8b", "--workloads", "diverse",
                         "--concurrency", "1", "--seeds", "1", "--seconds", "10", "--warmup",
                         "2", "--jobs", "1", "--ceiling", str(ceiling), "--json",
                         str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("h100"))
    assert "diverse" in line and "|" in line  # the ceiling's cell found
    (cell,) = json.loads(out.read_text())
    assert cell["cell"] == ["h100-llama8b", "diverse", 1]
    (gain, head), = cell["gain_headroom"]
    assert head >= 0.0  # the per-step oracle is never below the per-bucket one

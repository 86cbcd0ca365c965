"""calibrate's torch side. The model math runs on torch's CPU backend when torch is installed;
timing runs only on a CUDA device (CI has neither: these skip there and say why)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tuner.calibrate import CalibrationGrid, CalibrationSettings, ModelShape, measure, read_table
from tuner.calibrate.gpu import ForwardOptions, _Decoder, cuda_problem
from tuner.errors import ConfigError
from tuner.sim.profiles import load_profile

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (the [gpu] extra)")
needs_cuda = pytest.mark.skipif(
    cuda_problem() is not None, reason=f"needs a CUDA device: {cuda_problem()}"
)

TINY = ModelShape(name="tiny", hidden=64, layers=2, heads=8, kv_heads=2, inter=96, vocab=300,
                  draft_vocab=100, qkv_bias=True)
CTX = 20


def _outputs(opts: ForwardOptions, b: int, q: int):
    import torch

    model = _Decoder(torch, TINY, torch.float32, opts, seed=0, device="cpu")
    state = model.alloc_state(b, CTX, 8, seed=0)
    inp = model.inputs(state, b, q, CTX)
    return model.target(state, inp, b, q, CTX), model.draft(state, inp, b, q, CTX)


@needs_torch
@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_packed_attention_computes_what_grouped_query_attention_computes(q, causal, layout):
    import torch

    packed = _outputs(ForwardOptions(causal=causal, weight_layout=layout, rope=True), 2, q)
    naive = _outputs(
        ForwardOptions(attention="gqa", causal=causal, weight_layout=layout, rope=True), 2, q
    )
    for a, b in zip(packed, naive):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert packed[0].shape == (2 * q, TINY.vocab) and packed[1].shape == (2 * q, TINY.draft_vocab)


@needs_torch
def test_causal_mask_matters_only_between_new_tokens():
    import torch

    for q, differs in ((1, False), (3, True)):
        plain = _outputs(ForwardOptions(), 2, q)[0]
        causal = _outputs(ForwardOptions(causal=True), 2, q)[0]
        assert (not torch.allclose(plain, causal, atol=1e-6)) is differs


@needs_torch
def test_unfused_projections_build_the_same_shapes():
    t, d = _outputs(ForwardOptions(fused=False, rope=True), 3, 2)
    assert t.shape == (6, TINY.vocab) and d.shape == (6, TINY.draft_vocab)


@pytest.mark.skipif(cuda_problem() is None, reason="a CUDA device is present")
def test_measure_refuses_without_a_cuda_device():
    with pytest.raises(ConfigError, match="CUDA"):
        measure(TINY, CalibrationGrid(batch_sizes=(1,), tokens_per_seq=(1,)), CalibrationSettings())


@pytest.mark.gpu
@needs_cuda
def test_measure_times_a_small_grid_and_the_simulator_loads_it(tmp_path: Path):
    from tuner.calibrate import write_table

    grid = CalibrationGrid(batch_sizes=(1, 4), tokens_per_seq=(1, 2))
    settings = CalibrationSettings(ctx=256, point_cooldown_s=0, batch_cooldown_s=0, rounds=1)
    seen = []
    res = measure(TINY, grid, settings, progress=seen.append)
    assert res.complete and len(res.rows) == 4 and [p.done for p in seen] == [1, 2, 3, 4]
    assert all(r.target_ms > r.draft_ms > 0 for r in res.rows)
    out = write_table(tmp_path / "t.jsonl", res.info, res.rows)
    assert read_table(out).info["shape"] == "tiny"
    assert load_profile(out).step_s(4, 1) > 0


@pytest.mark.gpu
@needs_cuda
def test_out_of_memory_stops_cleanly_keeping_smaller_batch_sizes():
    huge = ModelShape(name="huge-kv", hidden=1024, layers=64, heads=8, kv_heads=8, inter=2048,
                      vocab=1000)
    # KV cache at b=4096 over 32k tokens: petabytes; b=1 fits.
    grid = CalibrationGrid(batch_sizes=(1, 4096), tokens_per_seq=(1,))
    settings = CalibrationSettings(ctx=32768, point_cooldown_s=0, batch_cooldown_s=0, rounds=1)
    res = measure(huge, grid, settings)
    assert not res.complete and res.stopped_at == (4096, 1)
    assert "out of device memory at b=4096" in res.stopped
    assert [(r.b, r.q) for r in res.rows] == [(1, 1)] and res.skipped == ((4096, 1),)
    assert res.info["complete"] is False and res.info["measured_points"] == 1


# --- mixture of experts -----------------------------------------------------------------------

TINY_MOE = ModelShape(name="tiny-moe", hidden=64, layers=3, heads=8, kv_heads=2, inter=96,
                      vocab=300, draft_vocab=100, experts=16, experts_per_tok=4, moe_inter=32,
                      shared_experts=1, shared_inter=24)


@needs_torch
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_moe_block_computes_each_token_through_its_own_experts(tokens):
    """The batched dispatch equals a per-token loop over the experts the fixed routing names,
    weighted by the router's renormalised top-k weights, plus the shared expert."""
    import torch

    from tuner.calibrate._moe import balanced_routing
    from tuner.calibrate._moe_torch import moe_forward, moe_weights, routing_tensors

    s = TINY_MOE
    gen = torch.Generator().manual_seed(0)
    L = moe_weights(torch, s, torch.float32, torch.device("cpu"), gen, 0.1)
    # Distinct experts (the builder copies one), so a wrong expert index shows.
    L["w_gu"].normal_(0.0, 0.1, generator=gen)
    L["w_down"].normal_(0.0, 0.1, generator=gen)
    h = torch.randn(tokens, s.hidden, generator=gen)
    route = routing_tensors(torch, s, tokens, torch.device("cpu"))
    got = moe_forward(torch, s, h, L, route)

    r = balanced_routing(s.experts, s.experts_per_tok, tokens)
    top_w = torch.topk(torch.softmax(h @ L["router"], -1), s.experts_per_tok, -1).values
    top_w = top_w / top_w.sum(-1, keepdim=True)
    F = torch.nn.functional
    want = torch.zeros_like(h)
    for t in range(tokens):
        for j in range(s.experts_per_tok):
            e = (t * s.experts_per_tok + j) % r.experts
            g, u = (h[t] @ L["w_gu"][e]).chunk(2)
            want[t] += top_w[t, j] * ((F.silu(g) * u) @ L["w_down"][e])
        g, u = (h[t] @ L["s_gu"]).chunk(2)
        want[t] += (F.silu(g) * u) @ L["s_down"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_torch
def test_moe_target_uses_experts_and_a_dense_draft_and_scaled_builds_fewer_layers():
    import torch

    full = _Decoder(torch, TINY_MOE, torch.float32, ForwardOptions(), seed=0, device="cpu")
    part = _Decoder(torch, TINY_MOE, torch.float32, ForwardOptions(), seed=0, device="cpu",
                    layers=1)
    assert "router" in full.layers[0] and "router" not in full.d_layer and "wgu" in full.d_layer
    assert len(full.layers) == 3 and len(part.layers) == 1
    state = part.alloc_state(2, CTX, 8, seed=0)
    assert len(state["kv"]) == 1
    inp = part.inputs(state, 2, 4, CTX)
    # 2 x 4 tokens touch 16 * (1 - (3/4)^8) = 14.4 experts: 14 in the one built layer, 14 in
    # two of three layers and 15 in one when all are built.
    assert [r["touched"] for r in inp["routes"]] == [14]
    routes = full.inputs(full.alloc_state(2, CTX, 8, seed=0), 2, 4, CTX)["routes"]
    assert [r["touched"] for r in routes] == [15, 14, 14]
    assert part.stack(state, inp, 2, 4, CTX).shape == (8, TINY_MOE.hidden)
    assert part.head(state, inp, 2, 4, CTX).shape == (8, TINY_MOE.vocab)
    assert part.weight_bytes() < full.weight_bytes()


@pytest.mark.gpu
@needs_cuda
def test_measure_scales_a_moe_built_with_fewer_layers(tmp_path: Path):
    from tuner.calibrate import write_table

    grid = CalibrationGrid(batch_sizes=(1, 8), tokens_per_seq=(1, 4))
    settings = CalibrationSettings(ctx=128, point_cooldown_s=0, batch_cooldown_s=0, rounds=1,
                                   layers=1)
    res = measure(TINY_MOE, grid, settings)
    assert res.complete and res.info["layers_timed"] == 1 and res.info["experts"] == 16
    assert all(r.target_ms > 0 and r.draft_ms > 0 for r in res.rows)
    out = write_table(tmp_path / "moe.jsonl", res.info, res.rows)
    assert load_profile(out).step_s(8, 3) > load_profile(out).step_s(8, 0)

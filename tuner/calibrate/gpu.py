"""Times a random-weight target decoder and its EAGLE-3-style draft on a CUDA device.

The only module of the package that imports torch, and only inside functions, so importing it
costs nothing on a machine without torch.

For each batch size ``b`` and ``q`` tokens per sequence, over a KV cache of ``ctx`` tokens per
sequence, one full target forward (embedding, every layer, final norm, LM head over all
``b * q`` tokens) and one draft forward (fused ``3 * hidden`` input projection, one decoder
layer, draft head) are each captured in a CUDA graph, replayed ``warmup`` times, then timed
with device events over ``replays`` replays; a cell is the mean replay time.

Attention packs the ``group`` query heads that share a KV head together with the ``q`` tokens of
a sequence into one query block of ``q * group`` rows (``[b, kv_heads, q * group, head_dim]``),
as serving kernels do, so the KV cache is read once per sequence and KV head. A plain
grouped-query call would read it once per query head.

A mixture-of-experts shape replaces each target layer's MLP with a router and the experts its
``b * q`` tokens touch (:mod:`tuner.calibrate._moe_torch`); the draft layer stays dense.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tuner.calibrate._grid import CalibrationGrid, CalibrationSettings
from tuner.calibrate._moe_torch import layer_routes, moe_forward, moe_weights
from tuner.calibrate._shapes import ModelShape
from tuner.calibrate._table import CostRow
from tuner.errors import ConfigError, DynspecError

__all__ = [
    "ATTENTION_MODES",
    "CalibrationResult",
    "ForwardOptions",
    "Progress",
    "cuda_problem",
    "measure",
]

log = logging.getLogger(__name__)

# packed: the q * group rows that share a KV head form one query block per sequence
#         ([b, kv_heads, q * group, head_dim]), so KV is read once per sequence and KV head.
# gqa:    the naive grouped-query call ([b, heads, q, head_dim] with enable_gqa), for contrast:
#         it reads KV once per query head.
ATTENTION_MODES = ("packed", "gqa")
SDPA_BACKENDS = ("flash", "efficient", "cudnn")
_INSTALL_HINT = "pip install 'dynspec-tuner[gpu]'"
_INIT_STD = 0.02
_RMS_EPS = 1e-5
_ROPE_THETA = 500_000.0
# Device time of warm-up replays before timing a graph (the first graph of a run: longer).
_MIN_WARM_MS = 50.0
_FIRST_WARM_MS = 1000.0
# Bytes of device memory left free beyond our estimate (allocator slack, cuBLAS workspaces).
_HEADROOM_BYTES = 2 << 30


@dataclass(frozen=True, kw_only=True)
class ForwardOptions:
    """How the forwards are built; the defaults are what the shipped tables use."""

    attention: str = "packed"
    # True: an explicit additive mask makes the q new tokens causal among themselves (runs on
    # the memory-efficient kernel, which reads the mask). False: no mask, so the flash kernel
    # runs and each new token also sees the later new tokens' keys: q extra keys of ctx + q,
    # the same bytes as serving kernels' in-kernel causal mask. Exact for q = 1 either way.
    causal: bool = False
    # Off by default: serving engines apply RoPE in one fused kernel (or inside attention);
    # its unfused torch form (3 kernels a layer) adds ~4 % at small batch that they never pay.
    rope: bool = False
    # True: one QKV projection and one gate-up projection per layer, as serving engines load
    # them. False: separate q, k, v, gate and up projections.
    fused: bool = True
    # "in_out": weights [in, out], applied as x @ W (cuBLAS "NN"); "out_in": [out, in], as
    # F.linear(x, W) ("TN"). cuBLAS picks kernels per layout and token count, so cells move by
    # up to ~10 % between the two where its choice changes (e.g. 128 tokens).
    weight_layout: str = "in_out"
    # None: SDPA's own choice; else force "flash", "efficient" or "cudnn".
    sdpa_backend: str | None = None
    # True: the draft layer's QKV projection reads [norm(embedding), norm(hidden)] (2 * hidden),
    # as EAGLE-3's midlayer does. False: a plain decoder layer over the projected hidden state.
    eagle3_qkv: bool = False
    # The draft's own weight layout and projection fusion; None: the same as the target's.
    # The draft runs a few small GEMMs (M = b * q tokens) where cuBLAS's kernel choice per
    # layout moves a cell by up to ~20 %, so it is set apart from the target's.
    draft_weight_layout: str | None = None
    draft_fused: bool | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}"
            )
        for name in ("weight_layout", "draft_weight_layout"):
            value = getattr(self, name)
            if value not in ("out_in", "in_out") and (name == "weight_layout" or value is not None):
                raise ValueError(f"{name} must be out_in or in_out, got {value!r}")
        if self.sdpa_backend not in (None, *SDPA_BACKENDS):
            raise ValueError(
                f"sdpa_backend must be one of {', '.join(SDPA_BACKENDS)} or None, "
                f"got {self.sdpa_backend!r}"
            )

    def describe(self) -> str:
        parts = [
            f"attention={self.attention}{'-causal' if self.causal else ''}",
            f"rope={'on' if self.rope else 'off'}",
        ]
        if not self.fused:
            parts.append("fused=off")
        if self.weight_layout != "in_out":
            parts.append(f"weights={self.weight_layout}")
        if self.sdpa_backend:
            parts.append(f"sdpa={self.sdpa_backend}")
        if self.eagle3_qkv:
            parts.append("draft-qkv=2x")
        if self.draft_layout != self.weight_layout:
            parts.append(f"draft-weights={self.draft_layout}")
        if self.draft_fusion != self.fused:
            parts.append(f"draft-fused={'on' if self.draft_fusion else 'off'}")
        return ",".join(parts)

    @property
    def draft_layout(self) -> str:
        """The weight layout the draft's projections use."""
        return self.draft_weight_layout or self.weight_layout

    @property
    def draft_fusion(self) -> bool:
        """Whether the draft layer's QKV and gate-up projections are fused."""
        return self.fused if self.draft_fused is None else self.draft_fused


@dataclass(frozen=True, kw_only=True)
class Progress:
    """One finished (or abandoned) grid point, for a progress display."""

    done: int
    total: int
    b: int
    q: int
    row: CostRow | None


@dataclass(frozen=True, kw_only=True)
class CalibrationResult:
    """Measured rows plus the table's info row; ``stopped`` says why the grid ended early."""

    info: dict[str, Any]
    rows: tuple[CostRow, ...]
    stopped: str | None = None
    interrupted: bool = False
    stopped_at: tuple[int, int] | None = None
    skipped: tuple[tuple[int, int], ...] = field(default=())

    @property
    def complete(self) -> bool:
        return self.stopped is None


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ConfigError(f"calibrate needs PyTorch with CUDA ({_INSTALL_HINT})") from exc
    return torch


def cuda_problem() -> str | None:
    """Why CUDA timing cannot run here (no torch, no device), or None when it can."""
    try:
        import torch
    except ImportError:
        return f"PyTorch is not installed ({_INSTALL_HINT})"
    if not torch.cuda.is_available():
        return f"no CUDA device is visible to PyTorch {torch.__version__}"
    return None


# --- the model --------------------------------------------------------------------------------


class _Decoder:
    """Random weights and the two forwards; tensors live on one CUDA device."""

    def __init__(self, torch: Any, shape: ModelShape, dtype: Any, opts: ForwardOptions, seed: int,
                 device: str = "cuda", layers: int | None = None):
        self.t = torch
        self.F = torch.nn.functional
        self.shape = shape
        # Target layers built and timed; fewer than the shape's when scaled (see measure).
        self.n_layers = shape.layers if layers is None else layers
        self.dtype = dtype
        self.opts = opts
        dev = self.dev = torch.device(device)
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        s = shape

        def w(*dims: int) -> Any:
            return torch.empty(dims, dtype=dtype, device=dev).normal_(0.0, _INIT_STD, generator=gen)

        def proj(out_f: int, in_f: int, layout: str = opts.weight_layout) -> Any:
            # "out_in": [out, in], used as F.linear(x, W) (cuBLAS "TN"); "in_out": [in, out],
            # used as x @ W ("NN"). cuBLAS picks kernels per layout, so cells can differ.
            return w(out_f, in_f) if layout == "out_in" else w(in_f, out_f)

        def ones(n: int) -> Any:
            return torch.ones(n, dtype=dtype, device=dev)

        nq, nkv = s.heads * s.head_dim, s.kv_heads * s.head_dim

        def layer(qkv_in: int, layout: str, fused: bool, moe: bool = False) -> dict[str, Any]:
            # "layout" and "fused" travel with the layer: the draft's may differ from the target's.
            L = {
                "layout": layout,
                "fused": fused,
                "ln1": ones(s.hidden),
                "wo": proj(s.hidden, nq, layout),
                "ln2": ones(s.hidden),
            }
            if fused:
                L["wqkv"] = proj(s.qkv_out, qkv_in, layout)
                L["bqkv"] = w(s.qkv_out) if s.qkv_bias else None
            else:
                for name, n in (("q", nq), ("k", nkv), ("v", nkv)):
                    L[f"w{name}"] = proj(n, qkv_in, layout)
                    L[f"b{name}"] = w(n) if s.qkv_bias else None
            if moe:  # router and stacked experts in place of the dense MLP
                L.update(moe_weights(torch, s, dtype, dev, gen, _INIT_STD))
                return L
            L["wd"] = proj(s.hidden, s.inter, layout)
            if fused:
                L["wgu"] = proj(2 * s.inter, s.hidden, layout)
            else:
                L["wg"] = proj(s.inter, s.hidden, layout)
                L["wu"] = proj(s.inter, s.hidden, layout)
            return L

        self.embed = w(s.vocab, s.hidden)
        self.layers = [
            layer(s.hidden, opts.weight_layout, opts.fused, moe=s.is_moe)
            for _ in range(self.n_layers)
        ]
        for i, L in enumerate(self.layers):
            L["index"] = i  # which of the input's per-layer MoE dispatches it takes
        self.norm = ones(s.hidden)
        self.lm_head = proj(s.vocab, s.hidden)
        dl = opts.draft_layout
        self.d_fc = proj(s.hidden, 3 * s.hidden, dl)
        self.d_layer = layer(2 * s.hidden if opts.eagle3_qkv else s.hidden, dl, opts.draft_fusion)
        self.d_hnorm = ones(s.hidden)
        self.d_norm = ones(s.hidden)
        self.d_head = proj(s.draft_vocab, s.hidden, dl)
        half = s.head_dim // 2
        self.inv_freq = 1.0 / (
            _ROPE_THETA ** (torch.arange(0, half, device=dev, dtype=torch.float32) / half)
        )

    def weight_bytes(self) -> int:
        size = self.t.tensor([], dtype=self.dtype).element_size()
        return self.shape.built_params(self.n_layers) * size

    # -- per-batch state -------------------------------------------------------------------

    def alloc_state(self, b: int, ctx: int, max_q: int, seed: int) -> dict[str, Any]:
        """KV caches (one per layer, and the draft's) for ``b`` sequences, random-filled."""
        torch, s = self.t, self.shape
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(seed + b)
        length = ctx + max_q

        def cache() -> Any:
            return torch.empty(
                (b, s.kv_heads, length, s.head_dim), dtype=self.dtype, device=self.dev
            ).normal_(0.0, 1.0, generator=gen)

        return {
            "kv": [(cache(), cache()) for _ in range(self.n_layers)],
            "d_kv": (cache(), cache()),
            "gen": gen,
        }

    def inputs(self, state: dict[str, Any], b: int, q: int, ctx: int) -> dict[str, Any]:
        torch, s = self.t, self.shape
        gen = state["gen"]
        ids = torch.randint(0, min(s.vocab, s.draft_vocab), (b * q,), device=self.dev, generator=gen)
        hidden3 = torch.empty((b * q, 3 * s.hidden), dtype=self.dtype, device=self.dev).normal_(
            0.0, 1.0, generator=gen
        )
        pos = torch.arange(ctx, ctx + q, device=self.dev, dtype=torch.float32)
        ang = torch.outer(pos, self.inv_freq)  # [q, d/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(self.dtype)
        sin = torch.cat([-ang.sin(), ang.sin()], -1).to(self.dtype)  # sign folded in
        rope = (
            cos.view(1, q, 1, s.head_dim).expand(b, q, 1, s.head_dim).reshape(b * q, 1, s.head_dim),
            sin.view(1, q, 1, s.head_dim).expand(b, q, 1, s.head_dim).reshape(b * q, 1, s.head_dim),
        )
        mask = None
        if self.opts.causal and q > 1:
            # Token t sees the context and new tokens 0..t. In a packed block, row r is token
            # r // group; in the gqa layout row r is token r.
            rows = q * s.group if self.opts.attention == "packed" else q
            per_token = s.group if self.opts.attention == "packed" else 1
            padded = -(-(ctx + q) // 16) * 16  # the kernel wants an aligned row stride
            m = torch.zeros((rows, padded), dtype=self.dtype, device=self.dev)
            tok = torch.arange(rows, device=self.dev) // per_token
            key = torch.arange(padded, device=self.dev)
            m.masked_fill_(key.view(1, -1) > (ctx + tok).view(-1, 1), float("-inf"))
            mask = m[:, : ctx + q].view(1, 1, rows, ctx + q)
        out = {"ids": ids, "hidden3": hidden3, "rope": rope, "mask": mask}
        if s.is_moe:
            out["routes"] = layer_routes(torch, s, b * q, self.n_layers, self.dev)
        if self.n_layers < s.layers:  # the layer stack is timed from a hidden state
            out["x0"] = torch.empty((b * q, s.hidden), dtype=self.dtype, device=self.dev).normal_(
                0.0, 1.0, generator=gen
            )
        return out

    # -- building blocks -------------------------------------------------------------------

    def _rope(self, qk: Any, rope: tuple[Any, Any]) -> Any:
        # qk: [M, heads + kv_heads, d], rotate-half convention; 3 kernels for q and k together.
        half = self.shape.head_dim // 2
        cos, sin = rope
        rot = qk.view(qk.shape[0], qk.shape[1], 2, half).flip(2).view_as(qk)
        return self.t.addcmul(qk * cos, rot, sin)

    def _attention(self, h: Any, L: dict[str, Any], kv: tuple[Any, Any], b: int, q: int,
                   ctx: int, inp: dict[str, Any]) -> Any:
        s = self.shape
        d, kvh, g = s.head_dim, s.kv_heads, s.group
        m = h.shape[0]
        lay = L["layout"]
        if L["fused"]:
            qkv = self._lin(h, L["wqkv"], L["bqkv"], lay)  # [M, (heads + 2 kvh) d]
            nqk = (s.heads + kvh) * d
            qk = qkv[:, :nqk].view(m, s.heads + kvh, d)
            if self.opts.rope:
                qk = self._rope(qk, inp["rope"])
            xq, xk = qk[:, : s.heads], qk[:, s.heads :]
            xv = qkv[:, nqk:].view(m, kvh, d)
        else:
            xq = self._lin(h, L["wq"], L["bq"], lay).view(m, s.heads, d)
            xk = self._lin(h, L["wk"], L["bk"], lay).view(m, kvh, d)
            xv = self._lin(h, L["wv"], L["bv"], lay).view(m, kvh, d)
            if self.opts.rope:
                xq, xk = self._rope(xq, inp["rope"]), self._rope(xk, inp["rope"])
        kc, vc = kv
        # Append this step's keys and values after the context, in place.
        kc[:, :, ctx : ctx + q].copy_(xk.view(b, q, kvh, d).transpose(1, 2))
        vc[:, :, ctx : ctx + q].copy_(xv.view(b, q, kvh, d).transpose(1, 2))
        keys = kc[:, :, : ctx + q]
        values = vc[:, :, : ctx + q]
        if self.opts.attention == "gqa":
            qh = xq.reshape(b, q, s.heads, d).transpose(1, 2)  # [b, heads, q, d]
            o = self._sdpa(qh, keys, values, inp["mask"], gqa=True)
            return o.transpose(1, 2).reshape(m, s.heads * d)
        # [b, q, kvh, g, d] -> [b, kvh, q * g, d]: one query block per sequence and KV head.
        qp = xq.reshape(b, q, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(b, kvh, q * g, d)
        o = self._sdpa(qp, keys, values, inp["mask"])
        return o.view(b, kvh, q, g, d).permute(0, 2, 1, 3, 4).reshape(m, s.heads * d)

    def _sdpa(self, q: Any, k: Any, v: Any, mask: Any, *, gqa: bool = False) -> Any:
        kw = {"attn_mask": mask, "enable_gqa": True} if gqa else {"attn_mask": mask}
        if self.opts.sdpa_backend is None:
            return self.F.scaled_dot_product_attention(q, k, v, **kw)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
        }[self.opts.sdpa_backend]
        with sdpa_kernel(backend):
            return self.F.scaled_dot_product_attention(q, k, v, **kw)

    def _mlp(self, h: Any, L: dict[str, Any], inp: dict[str, Any]) -> Any:
        if "router" in L:
            return moe_forward(self.t, self.shape, h, L, inp["routes"][L["index"]])
        F, lay = self.F, L["layout"]
        if L["fused"]:
            gate, up = self._lin(h, L["wgu"], None, lay).chunk(2, dim=-1)
        else:
            gate, up = self._lin(h, L["wg"], None, lay), self._lin(h, L["wu"], None, lay)
        return self._lin(F.silu(gate) * up, L["wd"], None, lay)

    def _lin(self, x: Any, weight: Any, bias: Any = None, layout: str | None = None) -> Any:
        if (layout or self.opts.weight_layout) == "out_in":
            return self.F.linear(x, weight, bias)
        return x @ weight if bias is None else self.t.addmm(bias, x, weight)

    def _norm(self, x: Any, weight: Any) -> Any:
        return self.F.rms_norm(x, (x.shape[-1],), weight, _RMS_EPS)

    def _layer(self, x: Any, L: dict[str, Any], kv: tuple[Any, Any], b: int, q: int, ctx: int,
               inp: dict[str, Any], attn_in: Any = None) -> Any:
        h = self._norm(x, L["ln1"]) if attn_in is None else attn_in
        x = x + self._lin(self._attention(h, L, kv, b, q, ctx, inp), L["wo"], None, L["layout"])
        return x + self._mlp(self._norm(x, L["ln2"]), L, inp)

    # -- the two forwards ------------------------------------------------------------------

    def target(self, state: dict[str, Any], inp: dict[str, Any], b: int, q: int, ctx: int) -> Any:
        x = self.F.embedding(inp["ids"], self.embed)
        for L, kv in zip(self.layers, state["kv"]):
            x = self._layer(x, L, kv, b, q, ctx, inp)
        return self._lin(self._norm(x, self.norm), self.lm_head)

    def stack(self, state: dict[str, Any], inp: dict[str, Any], b: int, q: int, ctx: int) -> Any:
        """The built layers alone, from a hidden state: the part a scaled target multiplies."""
        x = inp["x0"]
        for L, kv in zip(self.layers, state["kv"]):
            x = self._layer(x, L, kv, b, q, ctx, inp)
        return x

    def head(self, state: dict[str, Any], inp: dict[str, Any], b: int, q: int, ctx: int) -> Any:
        """Embedding, final norm and LM head: the part of a target forward outside the layers."""
        x = self.F.embedding(inp["ids"], self.embed)
        return self._lin(self._norm(x, self.norm), self.lm_head)

    def draft(self, state: dict[str, Any], inp: dict[str, Any], b: int, q: int, ctx: int) -> Any:
        dl = self.opts.draft_layout
        x = self._lin(inp["hidden3"], self.d_fc, None, dl)  # fused 3 * hidden -> hidden
        attn_in = None
        if self.opts.eagle3_qkv:
            e = self.F.embedding(inp["ids"], self.embed)
            attn_in = self.t.cat(
                [self._norm(e, self.d_layer["ln1"]), self._norm(x, self.d_hnorm)], dim=-1
            )
        x = self._layer(x, self.d_layer, state["d_kv"], b, q, ctx, inp, attn_in)
        return self._lin(self._norm(x, self.d_norm), self.d_head, None, dl)


# --- timing -----------------------------------------------------------------------------------


def _graph_ms(
    torch: Any,
    fn: Callable[[], Any],
    *,
    warmup: int,
    replays: int,
    rounds: int,
    warm_ms: float = _MIN_WARM_MS,
) -> float:
    """Device time of one replay of ``fn`` captured in a CUDA graph: the median over
    ``rounds`` of the mean over ``replays`` back-to-back replays.

    Warm-up is at least ``warmup`` replays and ``warm_ms`` of device time, so clocks that
    dropped while idle are back up before timing starts."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up off the capture stream (cuBLAS handles etc.)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # A private memory pool per graph: it goes back to the allocator with the graph.
    with torch.cuda.graph(graph):
        out = fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(warmup, math.ceil(warm_ms / once))):
        graph.replay()
    means = []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        means.append(start.elapsed_time(end) / replays)
    del graph, out
    return float(statistics.median(means))


def _state_bytes(shape: ModelShape, b: int, ctx: int, max_q: int, dtype_bytes: int,
                 layers: int | None = None) -> int:
    """Device memory one batch size needs: KV caches plus the largest forward's activations."""
    n_layers = shape.layers if layers is None else layers
    kv = shape.kv_bytes_per_token(dtype_bytes=dtype_bytes, layers=n_layers + 1)
    kv *= b * (ctx + max_q)
    m = b * max_q
    act = m * (shape.vocab + 2 * shape.inter + 3 * shape.hidden + shape.qkv_out) * dtype_bytes
    if shape.is_moe:  # dispatched copies and the experts' SwiGLU, per routed slot
        act += m * shape.experts_per_tok * (3 * shape.hidden + 3 * shape.moe_inter) * dtype_bytes
    return kv + 3 * act


def _gpu_state() -> dict[str, Any]:
    """Power limit and clock ceilings, where NVML answers: two GPUs of one name can differ."""
    try:
        import pynvml  # nvidia-ml-py; optional

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return {
                "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
                "sm_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                "mem_clock_max_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "driver": pynvml.nvmlSystemGetDriverVersion(),
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML missing or unsupported: the table is still valid
        return {}


def _torch_dtype(torch: Any, name: str) -> Any:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def measure(
    shape: ModelShape,
    grid: CalibrationGrid,
    settings: CalibrationSettings,
    *,
    options: ForwardOptions | None = None,
    progress: Callable[[Progress], None] | None = None,
    draft_first: bool = True,
) -> CalibrationResult:
    """Time the grid on the current CUDA device.

    ``draft_first`` (the default) times each point's draft before its target. Timed right after
    the target's replays, the draft runs on a GPU the target has just heated and reads 5-20 %
    slower at b >= 32 on an H200 (benchmarks/results/h200-llama8b-draft-*).

    Stops cleanly, keeping every finished point, when the device runs out of memory at a batch
    size (``stopped`` says where and why) or on Ctrl-C (``interrupted``).

    A model whose weights do not fit in half the free device memory (a MoE of hundreds of
    experts) is built with ``settings.layers`` target layers, or as many as fit: then each point
    times the built layers alone (``stack``, from a hidden state) and the embedding plus LM head
    (``head``) as two graphs, and ``target_ms = head + layers / built · stack``. Layers are
    identical in shape, so the stack scales linearly; the info row says so (``layers_timed``).

    Raises:
        ConfigError: no torch or no CUDA device, or more layers asked for than the shape has.
        DynspecError: the weights themselves do not fit on the device.
    """
    problem = cuda_problem()
    if problem is not None:
        raise ConfigError(f"calibrate times forwards on a CUDA GPU: {problem}")
    torch = _import_torch()
    opts = options or ForwardOptions()
    dtype = _torch_dtype(torch, settings.dtype)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info: dict[str, Any] = {
        "gpu": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **shape.to_info(),
        "ctx": settings.ctx,
        "dtype": settings.dtype,
        "warmup": settings.warmup,
        "replays": settings.replays,
        "rounds": settings.rounds,
        "cooldown_s": [settings.point_cooldown_s, settings.batch_cooldown_s],
        "forward": opts.describe(),
    }
    info["draft_timing"] = "before" if draft_first else "after"
    info.update(_gpu_state())
    free, total = torch.cuda.mem_get_info()
    n_layers = settings.layers or shape.layers_fitting(free // 2, dtype_bytes=settings.dtype_bytes)
    if n_layers > shape.layers:
        raise ConfigError(f"{shape.name} has {shape.layers} layers; cannot build {n_layers}")
    weight_bytes = shape.built_params(n_layers) * settings.dtype_bytes
    if weight_bytes + _HEADROOM_BYTES > free:
        raise DynspecError(
            f"the {shape.name} weights with {n_layers} layers need {weight_bytes / 2**30:.1f} GiB;"
            f" {props.name} has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free "
            "(fewer layers: --layers N)"
        )
    scaled = n_layers < shape.layers
    if shape.is_moe:
        info["routing"] = (
            "fixed, balanced over the expected number of distinct experts E(1-(1-k/E)^n), "
            "ceil in a share of the layers and floor in the rest"
        )
    if scaled:
        info["layers_timed"] = n_layers
        info["layer_scaling"] = f"target = head + {shape.layers}/{n_layers} x {n_layers} layers"
    log.info("building %s (%d of %d layers) with random %s weights on %s", shape.name,
             n_layers, shape.layers, settings.dtype, props.name)
    t0 = time.monotonic()
    model = _Decoder(torch, shape, dtype, opts, settings.seed, layers=n_layers)
    torch.cuda.synchronize()
    log.info("weights ready in %.1f s (%.1f GiB)", time.monotonic() - t0, model.weight_bytes() / 2**30)

    rows: list[CostRow] = []
    total_points = len(grid)
    done = 0
    stopped: str | None = None
    stopped_at: tuple[int, int] | None = None
    interrupted = False
    first = True
    try:
        for b in grid.batch_sizes:
            need = _state_bytes(shape, b, settings.ctx, grid.max_q, settings.dtype_bytes,
                                n_layers)
            free, _ = torch.cuda.mem_get_info()
            if need + _HEADROOM_BYTES > free:
                stopped = (
                    f"out of device memory at b={b}: needs about {need / 2**30:.1f} GiB for the KV "
                    f"cache and activations, {free / 2**30:.1f} GiB free"
                )
                stopped_at = (b, grid.tokens_per_seq[0])
                break
            state = None
            q_now = grid.tokens_per_seq[0]
            try:
                state = model.alloc_state(b, settings.ctx, grid.max_q, settings.seed)
                for q in grid.tokens_per_seq:
                    q_now = q
                    inp = model.inputs(state, b, q, settings.ctx)
                    torch.cuda.synchronize()
                    pause = settings.point_cooldown_s
                    if q == grid.tokens_per_seq[0] and not first:
                        pause += settings.batch_cooldown_s
                    if pause > 0:
                        time.sleep(pause)
                    timed = {}
                    parts = ("stack", "head") if scaled else ("target",)
                    for which in ("draft", *parts) if draft_first else (*parts, "draft"):
                        timed[which] = _graph_ms(
                            torch,
                            partial(getattr(model, which), state, inp, b, q, settings.ctx),
                            warmup=settings.warmup,
                            replays=settings.replays,
                            rounds=settings.rounds,
                            warm_ms=_FIRST_WARM_MS if first else _MIN_WARM_MS,
                        )
                        first = False
                    d_ms = timed["draft"]
                    if scaled:
                        t_ms = timed["head"] + timed["stack"] * shape.layers / n_layers
                    else:
                        t_ms = timed["target"]
                    row = CostRow(b=b, q=q, target_ms=t_ms, draft_ms=d_ms)
                    rows.append(row)
                    done += 1
                    log.debug("b=%d q=%d target %.4f ms draft %.4f ms", b, q, t_ms, d_ms)
                    if progress is not None:
                        progress(Progress(done=done, total=total_points, b=b, q=q, row=row))
                    del inp
            except torch.cuda.OutOfMemoryError as exc:
                stopped = f"out of device memory at b={b}, q={q_now}: {str(exc).splitlines()[0]}"
                stopped_at = (b, q_now)
            finally:
                del state
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            if stopped is not None:
                break
    except KeyboardInterrupt:
        interrupted = True
        stopped = "interrupted"
    if stopped is not None:
        log.warning("calibration stopped early: %s", stopped)
        info["stopped"] = stopped
    info["complete"] = stopped is None
    info["measured_points"] = len(rows)
    info["grid_points"] = total_points
    measured = {(r.b, r.q) for r in rows}
    skipped = tuple(p for p in grid.points() if p not in measured)
    return CalibrationResult(
        info=info,
        rows=tuple(rows),
        stopped=stopped,
        interrupted=interrupted,
        stopped_at=stopped_at,
        skipped=skipped,
    )

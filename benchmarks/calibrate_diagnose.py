"""Component timings behind a calibration table (needs a CUDA GPU).

    python benchmarks/calibrate_diagnose.py [--out diag.json]

Times, each in a CUDA graph over rotating copies of the operands (so nothing stays in L2 as it
would not inside a 32-layer forward):

- every projection shape of the Llama-3-8B target and draft (fused and unfused) at many token
  counts M = b·q: where cuBLAS changes kernels shows as steps in a table's cells;
- one layer's attention over a 1024-token KV cache at several (b, q): packed query blocks
  under each SDPA backend, and the naive grouped-query call.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, KVH, HEADS, D, INTER, VOCAB, DVOCAB = 4096, 8, 32, 128, 14336, 128256, 32000
GEMMS = {
    "qkv": (H, (HEADS + 2 * KVH) * D),
    "q|o": (H, H),
    "k|v": (H, KVH * D),
    "gate_up": (H, 2 * INTER),
    "gate|up": (H, INTER),
    "down": (INTER, H),
    "lm_head": (H, VOCAB),
    "draft_head": (H, DVOCAB),
    "draft_fc": (3 * H, H),
}
MS = (1, 16, 64, 96, 128, 160, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def graph_ms(fn, calls: int, warmup: int = 3, replays: int = 10) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / replays / calls * 1000.0  # microseconds per call


def _linears(x, weights) -> None:
    for w in weights:
        F.linear(x, w)


def _attend(q, kv, length: int, backend, *, gqa: bool) -> None:
    for kc, vc in kv:
        kk, vv = kc[:, :, :length], vc[:, :, :length]
        if backend is None:
            F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)
        else:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    out: dict = {"gemm_us": {}, "attention_us": {}}
    # Warm the clocks.
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        x @ x
    torch.cuda.synchronize()
    del x
    for name, (k, n) in GEMMS.items():
        copies = max(2, min(16, (400 << 20) // (k * n * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        row = {}
        for m in MS:
            xin = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row[m] = round(graph_ms(partial(_linears, xin, ws), copies), 2)
        out["gemm_us"][name] = row
        print(f"gemm {name:<10} K={k:<6} N={n:<6} " + " ".join(f"{m}:{t}" for m, t in row.items()),
              flush=True)
        del ws
    ctx = 1024
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    for b in (1, 16, 64, 128, 256):
        copies = 4
        kv = [
            (
                torch.randn(b, KVH, ctx + 8, D, device="cuda", dtype=torch.bfloat16),
                torch.randn(b, KVH, ctx + 8, D, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(copies)
        ]
        for q in (1, 2, 4, 8):
            qp = torch.randn(b, KVH, q * HEADS // KVH, D, device="cuda", dtype=torch.bfloat16)
            qh = torch.randn(b, HEADS, q, D, device="cuda", dtype=torch.bfloat16)
            res = {}
            for bname, be in backends.items():
                run = partial(_attend, qp, kv, ctx + q, be, gqa=False)
                try:
                    res[f"packed-{bname}"] = round(graph_ms(run, copies), 2)
                except RuntimeError as exc:  # a backend that refuses this shape
                    res[f"packed-{bname}"] = f"n/a ({type(exc).__name__})"
            try:
                res["gqa-default"] = round(
                    graph_ms(partial(_attend, qh, kv, ctx + q, None, gqa=True), copies), 2
                )
            except RuntimeError as exc:
                res["gqa-default"] = f"n/a ({type(exc).__name__})"
            out["attention_us"][f"{b}/{q}"] = res
            print(f"attn b={b:<4} q={q} " + " ".join(f"{k}:{v}" for k, v in res.items()), flush=True)
        del kv
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

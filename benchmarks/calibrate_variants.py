"""Time how forward-construction choices move a calibration table (needs a CUDA GPU).

    python benchmarks/calibrate_variants.py --out variants.json [--reference REF.jsonl]

For each variant of :class:`tuner.calibrate.gpu.ForwardOptions` (packed vs naive grouped-query
attention, explicit causal mask or none, RoPE on or off, EAGLE-3's 2×hidden draft QKV), times
the Llama-3-8B shape at a few (b, q) points over a KV cache of 1024 tokens and prints each
point's ratio to the reference table (default: the measured H200 table shipped with the
simulator) and, for contrast, the naive grouped-query call's cost against packed attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tuner.calibrate import (
    LLAMA3_8B,
    CalibrationGrid,
    CalibrationSettings,
    ModelShape,
    read_table,
)
from tuner.calibrate.gpu import ForwardOptions, measure

VARIANTS = {
    "default": ForwardOptions(),
    "rope": ForwardOptions(rope=True),
    "tn-layout": ForwardOptions(weight_layout="out_in"),
    "causal-mask": ForwardOptions(causal=True),
    "unfused": ForwardOptions(fused=False),
    "draft-qkv-2x": ForwardOptions(eagle3_qkv=True),
    "naive-gqa": ForwardOptions(attention="gqa"),
}


def parse_variant(spec: str) -> tuple[str, ForwardOptions, ModelShape]:
    """``NAME`` of :data:`VARIANTS`, or ``NAME:field=value,...`` of ForwardOptions fields
    (integer fields of the shape, e.g. ``draft_vocab=32768``, change the shape)."""
    if ":" not in spec:
        return spec, VARIANTS[spec], LLAMA3_8B
    name, fields = spec.split(":", 1)
    kw: dict[str, object] = {}
    shape_kw: dict[str, int] = {}
    shape_fields = {f.name for f in dataclasses.fields(ModelShape)}
    for item in fields.split(","):
        key, value = item.split("=", 1)
        if key in shape_fields:
            shape_kw[key] = int(value)
        elif value in ("0", "1"):
            kw[key] = value == "1"
        elif value == "none":
            kw[key] = None
        else:
            kw[key] = value
    return name, ForwardOptions(**kw), dataclasses.replace(LLAMA3_8B, **shape_kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reference", default=str(ROOT / "tuner/sim/profiles/h200-llama8b.jsonl"))
    ap.add_argument("--batch-sizes", default="1,16,32,64,256")
    ap.add_argument("--tokens-per-seq", default="1,4,8")
    ap.add_argument(
        "--variants",
        default=";".join(VARIANTS),
        help="';'-separated NAME or NAME:field=value,... (e.g. 'a:rope=0,sdpa_backend=cudnn')",
    )
    ap.add_argument("--point-cooldown", type=float, default=0.25)
    ap.add_argument("--batch-cooldown", type=float, default=2.0)
    args = ap.parse_args(argv)
    grid = CalibrationGrid(
        batch_sizes=tuple(int(x) for x in args.batch_sizes.split(",")),
        tokens_per_seq=tuple(int(x) for x in args.tokens_per_seq.split(",")),
    )
    ref = read_table(args.reference).as_dict() if Path(args.reference).exists() else {}
    settings = CalibrationSettings(
        point_cooldown_s=args.point_cooldown, batch_cooldown_s=args.batch_cooldown
    )
    results: dict[str, list[dict]] = {}
    for spec in args.variants.split(";"):
        name, opts, shape = parse_variant(spec)
        try:
            res = measure(shape, grid, settings, options=opts)
        except RuntimeError as exc:  # e.g. an SDPA backend that refuses a shape
            print(f"{name:<20} failed: {str(exc).splitlines()[0]}", flush=True)
            continue
        results[name] = [r.to_json() for r in res.rows]
        worst = 0.0
        cells = []
        for r in res.rows:
            if (r.b, r.q) in ref:
                rr = ref[(r.b, r.q)]
                tr, dr = r.target_ms / rr.target_ms, r.draft_ms / rr.draft_ms
                worst = max(worst, abs(tr - 1), abs(dr - 1))
                cells.append((max(abs(tr - 1), abs(dr - 1)), f"{r.b}/{r.q}:{tr:.3f}/{dr:.3f}"))
            else:
                cells.append((0.0, f"{r.b}/{r.q}:{r.target_ms:.3f}/{r.draft_ms:.4f}ms"))
        if len(cells) > 16:  # a full grid: the worst points only
            cells = sorted(cells, reverse=True)[:8]
        print(f"{name:<20} max|r-1|={worst:.3f} " + " ".join(c for _, c in cells), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if "naive-gqa" in results and "default" in results:
        base = {(r["b"], r["q"]): r for r in results["default"]}
        cells = [
            f"{r['b']}/{r['q']}:{r['target_ms'] / base[(r['b'], r['q'])]['target_ms']:.2f}"
            for r in results["naive-gqa"]
        ]
        print("naive gqa / packed target: " + " ".join(cells))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

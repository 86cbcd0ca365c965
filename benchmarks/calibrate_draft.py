"""Time the draft forward alone over a whole grid under several draft options (needs a CUDA GPU).

    python benchmarks/calibrate_draft.py --out draft.json [--reference REF.jsonl]
        [--variants 'nn;tn:draft_weight_layout=out_in'] [--calibrate-best TABLE.jsonl]
    python benchmarks/calibrate_draft.py --out unused.json --order PREFIX

The draft is cheap (under 3 ms a forward), so every (b, q) of the default grid is timed under
each variant, the variants interleaved cell by cell (a clock drift hits them alike), with the
same graph-and-events timing as ``calibrate``. Prints each variant's ratio to the reference table
(default: the measured H200 table shipped with the simulator) and its worst |ratio − 1|. With
``--calibrate-best``, then times the full table (target and draft, as ``calibrate`` does) with
the variant closest to the reference and writes it there. With ``--order PREFIX`` instead, times
the full grid as ``calibrate`` does, with the draft timed before the target, right after it
(``calibrate``'s order) and after it with a long warm-up, and writes one table per order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tuner.calibrate import (
    LLAMA3_8B,
    CalibrationGrid,
    CalibrationSettings,
    CostRow,
    gpu,
    read_table,
    write_table,
)
from tuner.calibrate.gpu import ForwardOptions

DEFAULT_VARIANTS = (
    "nn:draft_weight_layout=in_out;"
    "tn:draft_weight_layout=out_in;"
    "tn-unfused:draft_weight_layout=out_in,draft_fused=0"
)


def parse_variant(spec: str) -> tuple[str, ForwardOptions]:
    """``NAME:field=value,...`` of ForwardOptions fields (0/1 for booleans, none for None)."""
    name, _, fields = spec.partition(":")
    kw: dict[str, object] = {}
    for item in filter(None, fields.split(",")):
        key, value = item.split("=", 1)
        kw[key] = {"0": False, "1": True, "none": None}.get(value, value)
    return name, ForwardOptions(**kw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reference", default=str(ROOT / "tuner/sim/profiles/h200-llama8b.jsonl"))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="';'-separated NAME:field=value,...")
    ap.add_argument("--calibrate-best", default=None, metavar="TABLE")
    ap.add_argument("--order", default=None, metavar="PREFIX",
                    help="instead: the full grid with the draft timed before the target, after it "
                    "(as calibrate does) and after it with a long warm-up; writes PREFIX-*.jsonl")
    args = ap.parse_args(argv)
    import torch

    if args.order:
        return order_experiment(torch, args.order, read_table(args.reference).as_dict())

    ref = read_table(args.reference).as_dict()
    grid = CalibrationGrid()
    settings = CalibrationSettings()
    variants = [parse_variant(s) for s in args.variants.split(";")]
    # The draft reads nothing of the target's layers: one layer keeps weights and KV small.
    shape = dataclasses.replace(LLAMA3_8B, layers=1)
    dtype = torch.bfloat16
    models = {n: gpu._Decoder(torch, shape, dtype, o, settings.seed) for n, o in variants}
    torch.cuda.synchronize()
    rows: dict[str, list[dict]] = {n: [] for n, _ in variants}
    t0 = time.monotonic()
    first = True
    for b in grid.batch_sizes:
        # One KV cache and one input set for all variants: the same bytes for each.
        any_model = next(iter(models.values()))
        state = any_model.alloc_state(b, settings.ctx, grid.max_q, settings.seed)
        for q in grid.tokens_per_seq:
            inp = any_model.inputs(state, b, q, settings.ctx)
            cells = []
            for name, model in models.items():
                ms = gpu._graph_ms(
                    torch,
                    partial(model.draft, state, inp, b, q, settings.ctx),
                    warmup=settings.warmup,
                    replays=settings.replays,
                    rounds=settings.rounds,
                    warm_ms=gpu._FIRST_WARM_MS if first else gpu._MIN_WARM_MS,
                )
                first = False
                r = ms / ref[(b, q)].draft_ms
                rows[name].append({"b": b, "q": q, "draft_ms": round(ms, 4), "ratio": round(r, 4)})
                cells.append(f"{name}={ms:.4f}({r:.3f})")
            print(f"b={b:<4} q={q} ref={ref[(b, q)].draft_ms:.4f} " + " ".join(cells), flush=True)
        del state
        torch.cuda.empty_cache()
    print(f"draft grid: {time.monotonic() - t0:.1f} s", flush=True)
    summary = {}
    for name, opts in variants:
        worst = max(rows[name], key=lambda c: abs(c["ratio"] - 1))
        over = [f"{c['b']}/{c['q']}:{c['ratio']:.3f}" for c in rows[name] if abs(c["ratio"] - 1) > 0.10]
        summary[name] = {"options": opts.describe(), "max_dev": round(abs(worst["ratio"] - 1), 4),
                         "worst": [worst["b"], worst["q"]], "over_10pct": over}
        print(f"{name:<12} {opts.describe():<60} max|r-1|={summary[name]['max_dev']:.4f} at "
              f"{worst['b']}/{worst['q']}; over 10 %: {len(over)} {' '.join(over)}", flush=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    del models
    torch.cuda.empty_cache()
    if args.calibrate_best:
        best_name = min(summary, key=lambda n: summary[n]["max_dev"])
        best = dict(variants)[best_name]
        print(f"calibrating the full table with {best_name}: {best.describe()}", flush=True)
        t1 = time.monotonic()

        def on_point(p: gpu.Progress) -> None:
            if p.row is not None and p.q == grid.tokens_per_seq[-1]:
                print(f"  b={p.b} done ({p.done}/{p.total}, {time.monotonic() - t1:.0f} s)",
                      flush=True)

        res = gpu.measure(LLAMA3_8B, grid, settings, options=best, progress=on_point)
        write_table(args.calibrate_best, res.info, res.rows)
        print(f"wrote {args.calibrate_best}: {len(res.rows)} points in "
              f"{time.monotonic() - t1:.0f} s", flush=True)
    return 0


# Device time of draft warm-up replays for the "post-long" column.
LONG_WARM_MS = 300.0


def order_experiment(torch, prefix: str, ref: dict) -> int:
    """The full grid as ``measure`` runs it (same cooldowns and warm-ups), with three draft
    columns per cell: timed before the target, right after it, and after it with a long
    warm-up; one table per column (each with the same target column)."""
    grid, settings = CalibrationGrid(), CalibrationSettings()
    opts = ForwardOptions()
    model = gpu._Decoder(torch, LLAMA3_8B, torch.bfloat16, opts, settings.seed)
    torch.cuda.synchronize()
    cols = ("pre", "post", "post-long")
    rows: dict[str, list] = {c: [] for c in cols}
    t0 = time.monotonic()
    first = True
    timing = {"warmup": settings.warmup, "replays": settings.replays, "rounds": settings.rounds}
    try:
        for b in grid.batch_sizes:
            state = model.alloc_state(b, settings.ctx, grid.max_q, settings.seed)
            for q in grid.tokens_per_seq:
                inp = model.inputs(state, b, q, settings.ctx)
                torch.cuda.synchronize()
                pause = settings.point_cooldown_s
                if q == grid.tokens_per_seq[0] and not first:
                    pause += settings.batch_cooldown_s
                time.sleep(pause)
                draft = partial(model.draft, state, inp, b, q, settings.ctx)
                d = {"pre": gpu._graph_ms(torch, draft, **timing,
                                          warm_ms=gpu._FIRST_WARM_MS if first else gpu._MIN_WARM_MS)}
                first = False
                t = gpu._graph_ms(torch, partial(model.target, state, inp, b, q, settings.ctx),
                                  **timing)
                d["post"] = gpu._graph_ms(torch, draft, **timing)
                d["post-long"] = gpu._graph_ms(torch, draft, **timing, warm_ms=LONG_WARM_MS)
                for c in cols:
                    rows[c].append(CostRow(b=b, q=q, target_ms=t, draft_ms=d[c]))
                r = ref[(b, q)]
                print(f"b={b:<4} q={q} target {t / r.target_ms:.3f} draft "
                      + " ".join(f"{c}={d[c] / r.draft_ms:.3f}" for c in cols), flush=True)
            del state
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    print(f"order experiment: {time.monotonic() - t0:.0f} s", flush=True)
    props = torch.cuda.get_device_properties(0)
    for c in cols:
        info = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
                **LLAMA3_8B.to_info(), "ctx": settings.ctx, "dtype": settings.dtype,
                "forward": opts.describe(), "draft_timing": c, **timing}
        write_table(f"{prefix}-{c}.jsonl", info, rows[c])
        devs = [(abs(x.draft_ms / ref[(x.b, x.q)].draft_ms - 1), x.b, x.q) for x in rows[c]]
        tdev = max(abs(x.target_ms / ref[(x.b, x.q)].target_ms - 1) for x in rows[c])
        worst = max(devs)
        over = sum(1 for dv, _, _ in devs if dv > 0.10)
        print(f"draft {c:<10} max|r-1|={worst[0]:.4f} at {worst[1]}/{worst[2]}, over 10 %: {over};"
              f" target max|r-1|={tdev:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

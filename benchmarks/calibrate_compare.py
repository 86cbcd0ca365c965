"""Compare a calibration table against a reference, point by point.

    python benchmarks/calibrate_compare.py REFERENCE.jsonl NEW.jsonl [--tolerance 0.10]

Prints, for every (b, q) in both tables, new/reference for the target and the draft forward,
and for every (b, k) the speculative step ``k·draft(b,1) + target(b,k+1) + draft(b,k+1)``
(what the simulator charges). Ends with the worst |ratio − 1| of each and exits 1 when one
exceeds the tolerance or the new table misses reference points.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuner.calibrate import read_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference")
    ap.add_argument("new")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--quiet", action="store_true", help="only the summary lines")
    args = ap.parse_args(argv)
    ref = read_table(args.reference)
    new = read_table(args.new)
    rc, nc = ref.as_dict(), new.as_dict()
    common = sorted(set(rc) & set(nc))
    missing = sorted(set(rc) - set(nc))
    print(f"reference: {args.reference} ({ref.info.get('gpu')}, torch {ref.info.get('torch')})")
    print(f"new:       {args.new} ({new.info.get('gpu')}, torch {new.info.get('torch')}, "
          f"{new.info.get('forward', '')})")
    worst = {"target": (0.0, None), "draft": (0.0, None), "step": (0.0, None)}

    def note(what: str, ratio: float, where: tuple[int, int]) -> None:
        if abs(ratio - 1) > worst[what][0]:
            worst[what] = (abs(ratio - 1), where)

    if not args.quiet:
        print(f"{'b':>4} {'q':>2} {'ref target':>11} {'new target':>11} {'ratio':>6} "
              f"{'ref draft':>10} {'new draft':>10} {'ratio':>6}")
    for b, q in common:
        r, n = rc[(b, q)], nc[(b, q)]
        tr, dr = n.target_ms / r.target_ms, n.draft_ms / r.draft_ms
        note("target", tr, (b, q))
        note("draft", dr, (b, q))
        if not args.quiet:
            flag = " !" if max(abs(tr - 1), abs(dr - 1)) > args.tolerance else ""
            print(f"{b:>4} {q:>2} {r.target_ms:>11.4f} {n.target_ms:>11.4f} {tr:>6.3f} "
                  f"{r.draft_ms:>10.4f} {n.draft_ms:>10.4f} {dr:>6.3f}{flag}")
    steps = []
    for b in sorted({b for b, _ in common}):
        for k in range(16):
            try:
                rs, ns = ref.step_ms(b, k), new.step_ms(b, k)
            except KeyError:
                continue
            steps.append((b, k, rs, ns))
            note("step", ns / rs, (b, k))
    if not args.quiet:
        print("spec step ratios (b: k=ratio ...):")
        for b in sorted({s[0] for s in steps}):
            cells = " ".join(f"k{k}={ns / rs:.3f}" for bb, k, rs, ns in steps if bb == b)
            print(f"  b={b:<4} {cells}")
    print(f"points compared: {len(common)}; reference points missing from new: {len(missing)}")
    for what, (dev, where) in worst.items():
        print(f"max |ratio-1| {what:<6}: {dev:.4f} at {where}")
    bad = any(dev > args.tolerance for dev, _ in worst.values()) or bool(missing)
    print("WITHIN" if not bad else "OUTSIDE", f"tolerance {args.tolerance:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

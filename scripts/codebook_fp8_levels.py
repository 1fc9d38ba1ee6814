#!/usr/bin/env python3
"""What the rotated formats' codebooks would lose if their levels were FP8 (e4m3) numbers.

The CUDA decode turns each 3- or 4-bit code into its level through a table in shared memory (two
dependent loads a pair of codes; issue 44, docs/kernels.md).  Levels that are e4m3 values times one
scale per width could instead sit in registers: a byte permute (``prmt``) looks up four codes at
once among 8 bytes (the 8 magnitudes of a symmetric 4-bit codebook, or all 8 levels of a 3-bit one),
and one ``cvt.rn.f16x2.e4m3x2`` makes two f16 of them; the scale folds into the norm.  This prints,
per width and head dim, the mean squared error of one rotated coordinate (kvq.formats.codebook's
exact density) for the Lloyd-Max levels and for the best e4m3 levels: each Lloyd-Max level times a
scale ``s`` rounded to e4m3 and divided back, ``s`` searched over one octave, thresholds the
midpoints; then a coordinate descent moving single levels to neighbouring e4m3 values (times
``1/s``).  A measurement of the format's error, not of speed.

    python scripts/codebook_fp8_levels.py [--out docs/results/codebook_fp8_levels.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvq.formats import codebook  # noqa: E402

STEPS = 512  # scales tried in [1, 2)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(torch.float64)


def neighbours(v: float) -> list[float]:
    """The e4m3 values next to ``v`` (below and above) and ``v`` itself."""
    bits = torch.tensor([v], dtype=torch.float64).to(torch.float8_e4m3fn).view(torch.uint8).int().item()
    out = []
    for b in (bits - 1, bits, bits + 1):
        if 0 <= b < 256 and (b & 0x7F) != 0x7F:  # not NaN
            out.append(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64).item())
    return out


def best_fp8(bits: int, D: int) -> dict:
    lm, _ = codebook.lloyd_max(bits, D)
    lm_t = torch.tensor(lm, dtype=torch.float64)
    base = codebook.mse(lm, D)
    best = None
    for k in range(STEPS):
        s = 2.0 ** (k / STEPS)
        lv = (e4m3(lm_t * s) / s).tolist()
        m = codebook.mse(lv, D)
        if best is None or m < best[0]:
            best = (m, s, lv)
    m, s, lv = best
    rounded = m
    # coordinate descent over the positive half (the codebook stays symmetric)
    half = len(lv) // 2
    pos = [x * s for x in lv[half:]]
    improved = True
    while improved:
        improved = False
        for i in range(half):
            for cand in neighbours(pos[i]):
                trial = pos[:i] + [cand] + pos[i + 1:]
                if sorted(trial) != trial or len(set(trial)) != half:
                    continue
                full = [-x / s for x in reversed(trial)] + [x / s for x in trial]
                mt = codebook.mse(full, D)
                if mt < m - 1e-15:
                    m, pos, improved = mt, trial, True
    return dict(bits=bits, head_dim=D, lloyd_max_mse=base, scale=s, rounded_mse=rounded, fp8_mse=m,
                fp8_mse_increase_pct=100 * (m / base - 1), fp8_levels_times_scale=pos)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)
    rows = []
    for bits in (2, 3, 4):
        for D in (64, 128, 256):
            r = best_fp8(bits, D)
            rows.append(r)
            print(f"{bits}-bit D={D:3d}: Lloyd-Max MSE {r['lloyd_max_mse']:.6f}; e4m3 levels x 1/{r['scale']:.4f}: "
                  f"rounded {r['rounded_mse']:.6f}, after descent {r['fp8_mse']:.6f} "
                  f"(+{r['fp8_mse_increase_pct']:.2f}%); positive levels x scale {r['fp8_levels_times_scale']}",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(script="scripts/codebook_fp8_levels.py", rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Instruction mix of the CUDA decode's main loop for one KV format, without a GPU (nvcc + cuobjdump).

Builds decode8.cu for sm_90a with the macros the launcher would pass for a Llama-3-8B-shaped layer
(32 query heads, 8 KV heads, head_dim 128, bf16 model, no hp pages), disassembles it and prints the
instructions of its largest loop (the quantized chunks: one 16-token chunk a warp per trip for the
rotated formats), by opcode, and the registers ptxas reports.  A static count, not a measurement of
time: what a kernel change removes from the loop before a GPU times it.

    python scripts/sass_loop.py rot3_kc [--source OTHER.cu] [--define ROT_REG_LUT=0]

cuobjdump: CUDA's, or the one Triton's wheel ships (found next to ``triton``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def macros(fmt: str) -> list[str]:
    """The launcher's nvcc options for ``fmt`` (its CuPy module creation intercepted)."""
    from kvq.attention.cuda import decode8
    from kvq.cache.plan import bare_model, make_plan
    from kvq.cache.pool import KVPool

    bs = 32 if "kivi" in fmt or fmt.endswith("_kc") else 16
    plan = make_plan(bare_model(1, 8, 128, num_attention_heads=32), fmt, block_size=bs, sink_tokens=0,
                     residual_tokens=0)
    layer = KVPool.create(plan, 4, 1).layers[0]
    fk, fv = layer.fmt.k, layer.fmt.v
    seen: list[list[str]] = []

    class RawModule:  # noqa: D401 - CuPy's, capturing the options
        def __init__(self, code, options, backend):
            seen.append(list(options))
            raise RuntimeError("captured")

    fake = types.ModuleType("cupy")
    fake.RawModule = RawModule
    sys.modules["cupy"] = fake
    rot = bool(decode8.rot_bits(fv))
    kivi = decode8.rot_bits(fk) or decode8.rot_bits(fv) or decode8.kivi_bits(fk)
    k_token = decode8.k_per_token(fk)
    try:
        decode8._kernel(128, layer.block_size, 4, kivi, decode8._KIND.get(fk.storage, 0),
                        decode8._KIND.get(fv.storage, 0), decode8.scale_mode(fk), decode8.scale_mode(fv), False, True,
                        decode8.NWARPS, decode8.NSTAGES, decode8.min_blocks_for(128),
                        bool(kivi and not k_token and not rot and decode8.KIVI_STEP32), k_token, rot,
                        decode8.centred(fk), decode8.rot_bits(fv), decode8.fp8_k_rot_v(fk, fv))
    except RuntimeError:
        pass
    return seen[0]


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("format")
    ap.add_argument("--source", default=str(ROOT / "kvq" / "attention" / "cuda" / "decode8.cu"))
    ap.add_argument("--define", action="append", default=[], help="extra NAME=VALUE macros")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cmd = ["nvcc", "-cubin", "-arch=sm_90a", "-O3", "-x", "cu", *macros(args.format),
               *(f"-D{d}" for d in args.define), "-Xptxas", "-v", "-o", str(cubin), args.source]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return 1
        regs = re.search(r"Used (\d+) registers", r.stderr)
        sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    total, n, ops = main_loop(sass)
    print(f"{args.format}: {total} instructions, {regs.group(1) if regs else '?'} registers; "
          f"main loop {n}: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
    return 0


def main_loop(sass: str) -> tuple[int, int, Counter]:
    """(instructions, the main loop's length, its opcodes) of cuobjdump's SASS: the main loop is the largest
    backward branch's body that holds no other loop's whole body."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    index = {a: i for i, (a, _) in enumerate(ins)}
    loops = []  # (length, first, last) of each backward branch's body
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a:
            loops.append((i - index[int(m.group(1), 16)] + 1, index[int(m.group(1), 16)], i))
    inner = [lp for lp in loops if not any(o is not lp and lp[1] <= o[1] and o[2] <= lp[2] for o in loops)]
    n, first, last = max(inner)
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in ins[first:last + 1])
    return len(ins), n, ops


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Registers, spills and shared memory of the prefill kernel's launches for sm_90, without a GPU.

    python scripts/kernel_resources.py                    # the Triton installed here
    PYTHONPATH=/tmp/t36 python scripts/kernel_resources.py   # e.g. the device's Triton (3.6), unpacked there

Records the launches kvq makes for a Llama-3-8B-shaped layer (32 query heads, 8 KV heads,
head_dim 128) -- plain prefill over a bf16 cache, and the windowed prefill over f16 page
scratches (KIVI's 32-token pages, 4 sinks, 128 recent tokens) -- and compiles each for an
H100/H200 with the hints a real launch gets (16-byte divisible pointers and strides), then
prints the shared memory Triton allocates and what the cubin uses (ptxas registers, stack).
Shared memory per CTA and registers per thread decide how many CTAs an SM holds (228 KB and
64K registers per SM on the H200): the first thing to read when a kernel variant is slower.
Not a measurement of time."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import aot_compile  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiles", default=None, help="comma-separated BLOCK_MxBLOCK_NxWARPSxSTAGES launches to compile "
                   "(default: the ones kvq launches, kvq.attention.triton.prefill.TILES), e.g. 64x64x4x3,128x64x8x3")
    args = p.parse_args(argv)
    JITFunction.run = aot_compile._record
    from kvq.attention.triton import prefill

    keys = ("block_m", "block_n", "num_warps", "num_stages")
    tiles = [dict(zip(keys, (int(x) for x in c.split("x")))) for c in args.tiles.split(",")] if args.tiles else [None]
    print(f"Triton {triton.__version__}, sm_90")
    for tile in tiles:
        _report(prefill, tile or prefill.TILES["dense"], tile or prefill.TILES["window"])
    return 0


def _report(prefill, dense: dict, window: dict) -> None:
    """Compile the plain kernel over a bf16 cache with tile ``dense`` and the windowed one with ``window``."""

    D, H, group = 128, 8, 4
    q = torch.zeros(3, H * group, D, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([40, 3], dtype=torch.int32)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name, page, dtype, window, tile in (("prefill, bf16 cache (page 16)", 16, torch.bfloat16, False, dense),
                                            ("windowed prefill, f16 scratch (page 32)", 32, torch.float16, True,
                                             window)):
        aot_compile.recorded.clear()
        kp = torch.zeros(8, H, page, D, dtype=dtype)
        dargs, dmeta = prefill._dense_args(kp, kp)
        dot = tl.float16 if dtype == torch.float16 else tl.bfloat16
        prefill._launch(q, torch.empty_like(q), cu, dargs, dmeta, tables, tables if window else None, lens, 0.1, 2,
                        False, dot, tile, page, H, sink_tokens=4 if window else 0,
                        residual=128 if window else 0)
        (fn, bound), = aot_compile.recorded
        num_warps, num_stages = tile["num_warps"], tile["num_stages"]
        sig, consts, attrs = aot_compile.launch_signature(fn, bound, hints=True)
        ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvq_{fn.__name__}_{os.getpid()}.cubin"
        cubin.write_bytes(ck.asm["cubin"])
        use = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                             text=True).stdout
        cubin.unlink()
        res = dict(kv.split(":") for line in use.splitlines() if "REG:" in line for kv in line.split())
        smem = ck.metadata.shared
        ctas = min(228 * 1024 // max(1, smem + 1024), 65536 // (32 * num_warps * -(-int(res["REG"]) // 8) * 8))
        print(f"{name:42s} {tile['block_m']}x{tile['block_n']}, {num_warps} warps, {num_stages} stages: "
              f"shared {smem / 1024:6.1f} KB  registers {res['REG']:>3s}  stack {res['STACK']:>4s} B"
              f"  -> {ctas} CTA(s) per SM")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Issue rates of the instructions that turn KV codes into MMA operands, measured on the GPU (issue 44).

The rotated decode is bound by the instructions of its main loop (docs/kernels.md: ncu, 60.6% of issue
slots, Math Pipe Throttle among its stalls), so which pipe each instruction uses decides what a rewrite
saves.  Two candidate rewrites hinge on rates the programming guide does not list for sm_90: codes to
levels through e4m3 bytes (one byte permute for four codes, then `cvt.rn.f16x2.e4m3x2`, two levels an
instruction) instead of f16 bytes (four permutes for four codes), and FP8 tensor-core products
(m16n8k32 e4m3, no conversion) instead of f16 ones.  This times each instruction alone and in the mixes a
decode loop would issue, in lanes per clock per SM (32 a warp instruction; the SM's four schedulers issue
at most 128 a clock): each instruction of a case's round, and all it issues (a cvt case also xors its
result, so that nothing is dropped).

Each thread runs ``CHAINS`` independent dependency chains of the instruction for ``ITERS`` rounds (inline
PTX, so nothing is folded away) and XORs its chains into one output word; every SM holds ``WARPS``
warps a block and ``BLOCKS_PER_SM`` blocks.  Each block times itself with ``clock64`` between two
barriers; the rate is the block's instructions over its cycles, times the blocks an SM runs at once.

    python scripts/probe_pipes.py [--out docs/results/probe_pipes_h200.json]   # on the GPU (CuPy)
    python scripts/probe_pipes.py --compile-only                              # nvcc for sm_90a, no GPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHAINS = 8
ITERS = 2048
WARPS = 8
BLOCKS_PER_SM = 2


def _asm(ptx: str, outs: str, ins: str) -> str:
    return f'asm volatile("{ptx}" : {outs} : {ins});'


_NEXT = '"r"(x[(c + 1) % CHAINS])'  # another chain's word: the chains stay distinct
_PRMT = _asm("prmt.b32 %0, %0, %1, %2;", '"+r"(x[c])', f'"r"(k), {_NEXT}')
_LOP3 = _asm("lop3.b32 %0, %0, %1, %2, 0x96;", '"+r"(x[c])', f'"r"(k), {_NEXT}')
_CVT = "{ u32 t; " + _asm("{ .reg .b16 l, h;\\n mov.b32 {l, h}, %1;\\n cvt.rn.f16x2.e4m3x2 %0, l; }", '"=r"(t)',
                          '"r"(x[c])') + " x[c] ^= t; }"  # the cvt, and the xor that keeps it live
_ACC = '"+f"(f[c][0]), "+f"(f[c][1]), "+f"(f[c][2]), "+f"(f[c][3])'
_AB = '"r"(a), "r"(k), "r"(a), "r"(k), "r"(a), "r"(k)'


def _mma(shape: str) -> str:
    # the A operand changes every round (one xor a chain): otherwise ptxas takes the product once and adds it
    ptx = f"mma.sync.aligned.{shape}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
    return "{ const u32 a = x[c] ^ v; " + _asm(ptx, _ACC, _AB) + " }"


# one round of one chain, per case: inline PTX on registers x (the chain) and k (loop-invariant), and how
# many instructions of the loop it is; tensor cores count warp instructions x 32 like the others (an
# m16n8k16 is 4096 multiply-adds)
OPS = {
    "prmt": (_PRMT, 1),
    "lop3": (_LOP3, 1),
    "shf": (_asm("shf.r.wrap.b32 %0, %0, %1, %2;", '"+r"(x[c])', f'"r"(k), {_NEXT}'), 1),
    "hfma2": (_asm("fma.rn.f16x2 %0, %0, %1, %1;", '"+r"(x[c])', '"r"(k)'), 1),
    "cvt_e4m3x2_f16x2": (_CVT, 2),
    "prmt+cvt": (_PRMT + " " + _CVT, 3),
    "prmt+lop3": (_PRMT + " " + _LOP3, 2),
    "prmt+hfma2": (_PRMT + " " + _asm("fma.rn.f16x2 %0, %0, %1, %1;", '"+r"(y[c])', '"r"(k)'), 2),
    "mma_f16_m16n8k16": (_mma("m16n8k16.row.col.f32.f16.f16"), 1),
    "mma_e4m3_m16n8k32": (_mma("m16n8k32.row.col.f32.e4m3.e4m3"), 1),
}

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
#define CHAINS %(chains)d
#define ITERS %(iters)d
extern "C" __global__ void __launch_bounds__(%(threads)d) probe(const u32* __restrict__ seed, u32* __restrict__ out,
                                                              u64* __restrict__ cycles) {
    u32 x[CHAINS], y[CHAINS];
    float f[CHAINS][4];
    const u32 k = seed[threadIdx.x & 31];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
        x[c] = seed[(threadIdx.x + c) & 31];
        y[c] = x[c] ^ 0x3c003c00u;
        f[c][0] = f[c][1] = f[c][2] = f[c][3] = 0.f;
    }
    __syncthreads();
    const u64 t0 = clock64();
#pragma unroll 1
    for (int i = 0; i < ITERS; ++i) {
        const u32 v = k + u32(i);  // (the MMA cases' operands: new every round)
        (void)v;
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
            %(op)s
        }
    }
    __syncthreads();
    const u64 t1 = clock64();
    u32 acc = 0u;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) acc ^= x[c] ^ y[c] ^ __float_as_uint(f[c][0] + f[c][1] + f[c][2] + f[c][3]);
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
    if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
"""


def source(op: str) -> str:
    return SOURCE % dict(chains=CHAINS, iters=ITERS, threads=32 * WARPS, op=OPS[op][0])


def loops() -> dict[str, Counter]:
    """Each case built by nvcc for sm_90a (the FP8 MMA needs it): its timed loop's SASS opcodes (what the rate
    divides by).  Raises RuntimeError where nvcc fails."""
    from scripts.sass_loop import cuobjdump, main_loop

    out = {}
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "probe.cu"
        for op in OPS:
            cu.write_text(source(op))
            r = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-o", str(cu.with_suffix(".cubin")), str(cu)],
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{op}: nvcc failed\n{r.stderr[-3000:]}")
            sass = subprocess.run([cuobjdump(), "-sass", str(cu.with_suffix(".cubin"))], capture_output=True,
                                  text=True, check=True).stdout
            out[op] = main_loop(sass)[2]
    return out


def compile_only() -> int:
    if shutil.which("nvcc") is None:
        print("nvcc not found", file=sys.stderr)
        return 2
    for op, ops in loops().items():
        mix = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
        print(f"{op}: loop of {sum(ops.values())} for {CHAINS} chains: {mix}")
    return 0


def measure(op: str, num_sms: int) -> dict:
    import cupy

    kern = cupy.RawModule(code=source(op), backend="nvrtc").get_function("probe")  # (CuPy targets the device)
    threads, blocks = 32 * WARPS, BLOCKS_PER_SM * num_sms
    seed = cupy.arange(32, dtype=cupy.uint32) * cupy.uint32(2654435761) + cupy.uint32(0x3c00)
    out = cupy.empty(blocks * threads, dtype=cupy.uint32)
    cyc = cupy.empty(blocks, dtype=cupy.uint64)
    rates = []
    for _ in range(5):
        kern((blocks,), (threads,), (seed, out, cyc))
        cupy.cuda.runtime.deviceSynchronize()
        c = cyc.get().astype(float)
        rounds = threads * ITERS * CHAINS  # lane rounds of the timed loop, one block
        rates.append(float(BLOCKS_PER_SM * rounds / statistics.median(c)))  # (a Python float: prints plainly)
    rate = statistics.median(rates)
    # each instruction of a round runs `rate` lanes a clock; the SM issues `rate x instructions a round`
    return {"op": op, "instructions_per_round": OPS[op][1], "each_per_clock_per_sm": round(rate, 2),
            "issued_per_clock_per_sm": round(rate * OPS[op][1], 2),
            "spread": [round(min(rates), 2), round(max(rates), 2)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help="cases, comma-separated (default: all)")
    ap.add_argument("--compile-only", action="store_true", help="build each case with nvcc for sm_90a, no GPU")
    ap.add_argument("--out", default=None, help="JSON path for the rates")
    args = ap.parse_args(argv)
    if args.compile_only:
        return compile_only()
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    num_sms = props["multiProcessorCount"]
    rows = []
    for op in args.ops.split(","):
        row = measure(op, num_sms)
        rows.append(row)
        print(f"{op:20s} each {row['each_per_clock_per_sm']:7.2f} lanes/clock/SM, issued "
              f"{row['issued_per_clock_per_sm']:7.2f} ({row['instructions_per_round']} instruction(s) a round; "
              f"spread {row['spread']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(script="scripts/probe_pipes.py", device=props["name"].decode(),
                                                  sms=num_sms, warps=WARPS, blocks_per_sm=BLOCKS_PER_SM,
                                                  chains=CHAINS, iters=ITERS, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

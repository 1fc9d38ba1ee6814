"""Quick decode timing probe on the GPU (not the benchmark: see benchmarks/).

Times kvq's Triton paged decode per format against dense bf16 SDPA at one shape,
with L2 flushed and CUDA events, to steer kernel work.  Prints one line per case.
"""

import argparse
import itertools
import statistics

import torch

from kvq.attention.triton.decode import paged_decode
from kvq.attention import reference
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool


SLEEP_CYCLES = 1_000_000  # ~0.5 ms of GPU sleep before each timed call, longer than any call's host time


def bench(fn, iters=30):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)  # the GPU waits while the host enqueues fn: kernel time, not launch time
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--formats", default="bfloat16,fp8_e4m3,fp8_per_token_head,int8,int4_kivi")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--splits", default="0")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="2")
    ap.add_argument("--gpad", default="0", help="query rows padded to (0: auto)")
    ap.add_argument("--has-hp", action="store_true", help="compile the hp path in (the engine's KIVI case)")
    ap.add_argument("--cuda", action="store_true", help="also time the CUDA 8-bit decode (decode8.cu)")
    ap.add_argument("--cuda-warps", default="4", help="CUDA kernel: warps per CTA")
    ap.add_argument("--cuda-stages", default="3", help="CUDA kernel: pipeline stages per warp")
    ap.add_argument("--cuda-min-blocks", default="3", help="CUDA kernel: CTAs per SM the registers allow")
    ap.add_argument("--triton", default="1", help="0: skip the Triton sweep")
    ap.add_argument("--kivi-step32", default="0", help="CUDA kernel, KIVI: 0,1 = both variants (KIVI_STEP32)")
    ap.add_argument("--cuda-defines", default="",
                    help="CUDA kernel: also time it with these compile-time switches (e.g. ROT_REG_LUT=0; "
                         "space-separated NAME=VALUE), beside the default build")
    ap.add_argument("--cuda-defines-only", action="store_true",
                    help="with --cuda-defines: that build alone (e.g. under ncu, which profiles the first launches)")
    ap.add_argument("--cuda-source", default="",
                    help="comma-separated decode8.cu variants to time side by side (default: the package's); "
                         "NAME=PATH labels one")

    args = ap.parse_args()
    B, L, H, Hq, D = args.B, args.L, 8, 32, 128
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qq = q.view(B, Hq, 1, D)
    t = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qq, k, v, enable_gqa=True))
    dense_bytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
    print(f"sdpa dense bf16 {B}x{L}: {t:.1f} us  {dense_bytes / t / 1e3:.0f} GB/s", flush=True)
    k = v = None  # free
    for fmt in args.formats.split(","):
        bs = 32 if "kivi" in fmt or fmt.endswith("_kc") else 16  # K grouped over 32 tokens needs whole groups
        plan = make_plan(bare_model(1, H, D, num_attention_heads=Hq), fmt, block_size=bs, sink_tokens=0,
                         residual_tokens=0)
        nblk = B * L // bs
        pool = KVPool.create(plan, nblk, 16, "cuda")
        layer = pool.layers[0]
        layer.k_hp.normal_()
        layer.v_hp.normal_()
        layer.k_hp[..., 5] += 8
        from kvq.attention.triton.store import seal_blocks

        ids = torch.arange(nblk, device="cuda")
        seal_blocks(layer, ids % 16, ids)
        tables = torch.randperm(nblk, device="cuda").to(torch.int32).view(B, L // bs)
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        kv_bytes = nblk * plan.layers[0].block_bytes(H, D, bs)
        total = kv_bytes + 2 * q.numel() * 2
        # correctness on two sequences
        o_ref = reference.paged_decode(q[:2], layer, tables[:2], lens[:2], D ** -0.5)
        errs = []
        for gp in map(int, args.gpad.split(",")):
            o = paged_decode(q[:2], layer, tables[:2], lens[:2], D ** -0.5, max_seq_len=L, has_hp=False,
                             g_pad=gp or None)
            errs.append(((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item())
        err = max(errs)
        combos = itertools.product(*(map(int, a.split(",")) for a in (
            args.block_n, args.splits, args.warps, args.stages, args.gpad)))
        for bn, sp, nw, ns, gp in [] if args.triton == "0" else combos:
            kw = dict(max_seq_len=L, has_hp=args.has_hp, block_n=bn, num_splits=sp or None, num_warps=nw, num_stages=ns,
                      g_pad=gp or None)
            try:
                t = bench(lambda: paged_decode(q, layer, tables, lens, D ** -0.5, **kw))
            except Exception as e:  # e.g. out of shared memory for a config
                print(f"{fmt:20s} bn={bn} splits={sp} w={nw} s={ns}: failed {type(e).__name__}", flush=True)
                continue
            print(f"{fmt:20s} bn={bn:3d} splits={sp or 'auto':>4} w={nw} s={ns} gpad={gp}: "
                  f"{t:7.1f} us  "
                  f"{total / t / 1e3:6.0f} GB/s  err {err:.1e}", flush=True)
        if args.cuda:
            from kvq.attention.cuda import decode8

            why = decode8.unsupported_reason(layer, Hq // H, q.dtype)
            if why:
                print(f"{fmt:20s} cuda: {why}", flush=True)
            for label, src in ([] if why else _sources(args.cuda_source, decode8)):
                decode8._SOURCE = src
                decode8._kernel.cache_clear()
                defines = ([] if args.cuda_defines_only and args.cuda_defines else [()]) + (
                    [tuple(args.cuda_defines.split())] if args.cuda_defines else [])
                for nw, ns, mb, sp, s32, dfn in itertools.product(*(list(map(int, a.split(","))) for a in (
                        args.cuda_warps, args.cuda_stages, args.cuda_min_blocks, args.splits, args.kivi_step32)),
                        defines):
                    kw = dict(max_seq_len=L, has_hp=args.has_hp, nwarps=nw, nstages=ns, min_blocks=mb,
                              num_splits=sp or None, kivi_step32=bool(s32), defines=dfn)
                    try:
                        oc = decode8.paged_decode(q[:2], layer, tables[:2], lens[:2], D ** -0.5, **kw)
                        cerr = ((oc.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
                        t = bench(lambda: decode8.paged_decode(q, layer, tables, lens, D ** -0.5, **kw))
                    except Exception as e:
                        print(f"{fmt:20s} CUDA{label} {dfn} w={nw} s={ns} mb={mb} s32={s32} splits={sp}: failed {e}",
                              flush=True)
                        continue
                    print(f"{fmt:20s} CUDA{label}{'[' + ' '.join(dfn) + ']' if dfn else ''} w={nw} s={ns} mb={mb} "
                          f"s32={s32} splits={sp or 'auto':>4}: "
                          f"{t:7.1f} us  {total / t / 1e3:6.0f} GB/s  err {cerr:.1e}", flush=True)
        del pool
        layer = None  # the timed closures refer to it
        torch.cuda.empty_cache()


def _sources(spec: str, decode8):
    """(label, path) of each kernel source to time: the package's when ``spec`` is empty."""
    from pathlib import Path

    if not spec:
        return [("", decode8._SOURCE)]
    out = []
    for item in spec.split(","):
        label, _, path = item.rpartition("=")
        out.append((f"[{label or Path(path).stem}]", Path(path)))
    return out


if __name__ == "__main__":
    main()

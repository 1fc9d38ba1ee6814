"""Prefill-kernel timing probe on the GPU (not the benchmark): a chunk of new tokens
per sequence attending causally over its cached past, per KV format, with the f16
and the model-dtype dot for 8-bit formats.  Prints one line per case.

``--window``: what the engine runs instead, prompts through the block manager with each
format's default sinks and recent window, attention through ``kvq.models.llama.attend``
(the windowed prefill: page scratch, exact and sealed extra pages, the kernel's runs),
beside bf16 in the same process; with ``--profile`` the kernels of one call each."""

import argparse

import torch

from kvq.attention import reference
from kvq.attention.triton import dequant
from kvq.attention.triton.decode import layer_args
from kvq.attention.triton.prefill import paged_attention
from kvq.attention.triton.store import seal_blocks
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool
from scripts.probe_decode import bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--past", type=int, default=0, help="cached tokens before the chunk")
    ap.add_argument("--chunk", type=int, default=1024, help="new tokens per sequence")
    ap.add_argument("--formats", default="bfloat16,fp8_e4m3,int8_per_token_head,fp8_per_token_head")
    ap.add_argument("--dequant-first", default="0,1", help="prefill schedules to time: 0 in-loop, 1 scratch first")
    ap.add_argument("--window", action="store_true", help="the engine's windowed prefill (formats: default "
                    "bfloat16,int4_kivi,int2_kivi,fp8_e4m3), --past tokens prefilled first, then --chunk")
    ap.add_argument("--profile", action="store_true", help="with --window: device time per kernel of one call")
    ap.add_argument("--lib", action="store_true", help="with --window: the library split (FlashInfer's FA3 for the "
                    "bulk and the exact tail; the Triton band, whose tile --tiles then sets) instead of the Triton "
                    "prefill")
    ap.add_argument("--tiles", default=None, help="with --window: BLOCK_MxBLOCK_NxWARPSxSTAGES launches to time, "
                    "comma-separated, each used for every kind of read (default: kvq.attention.triton.prefill.TILES, "
                    "a tile per kind), e.g. 64x64x4x3,128x64x8x3")
    args = ap.parse_args()
    if args.window:
        return windowed(args)
    B, H, Hq, D = args.B, 8, 32, 128
    L = args.past + args.chunk
    q = torch.randn(B * args.chunk, Hq, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, B + 1, dtype=torch.int32, device="cuda") * args.chunk
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    flops = 4 * B * Hq * D * (args.chunk * args.past + args.chunk * args.chunk / 2)
    for fmt in args.formats.split(","):
        bs = 32 if "kivi" in fmt else 16
        plan = make_plan(bare_model(1, H, D, num_attention_heads=Hq), fmt, block_size=bs, sink_tokens=0,
                         residual_tokens=0)
        nblk = B * -(-L // bs)
        pool = KVPool.create(plan, nblk, 16, "cuda")
        layer = pool.layers[0]
        layer.k_hp.normal_()
        layer.v_hp.normal_()
        ids = torch.arange(nblk, device="cuda")
        seal_blocks(layer, ids % 16, ids)
        tables = torch.randperm(nblk, device="cuda").to(torch.int32).view(B, -1)
        ref = reference.paged_attention(q[:args.chunk].float(), layer, cu[:2], tables[:1], lens[:1], D ** -0.5)
        dots = (False, True) if plan.layers[0].k.bits == 8 else (False,)
        firsts = [bool(int(x)) for x in args.dequant_first.split(",")] if plan.is_quantized else [False]
        cases = [(f16, False) for f16 in dots if False in firsts] + [(False, True)] * (True in firsts)
        for f16, first in cases:
            kw = dict(has_hp=False, dot_f16=f16, dequant_first=first, max_seq_len=L)
            o = paged_attention(q[:args.chunk], layer, cu[:2], tables[:1], lens[:1], D ** -0.5, **kw)
            err = ((o.float() - ref).norm() / ref.norm()).item()
            t = bench(lambda: paged_attention(q, layer, cu, tables, lens, D ** -0.5, max_q_len=args.chunk, **kw),
                      iters=20)
            how = "scratch f16" if first else f"dot {'f16 ' if f16 else 'bf16'}"
            print(f"{fmt:22s} {how:12s} B={B} past={args.past} chunk={args.chunk}: "
                  f"{t:8.1f} us  {flops / t / 1e6:6.1f} TFLOP/s  err {err:.1e}", flush=True)
        if plan.is_quantized and True in firsts:
            largs, meta = layer_args(layer)
            nb = -(-L // bs)
            for w in (1, 2, 4, 8):
                t = bench(lambda: dequant.dequantize_pages(largs, meta, tables, lens, nb, H, bs, D, w))
                print(f"{fmt:22s} dequant pass only, {w} warps: {t:8.1f} us", flush=True)
        del pool
        layer = None  # the timed closures refer to it
        torch.cuda.empty_cache()


def windowed(args):
    """Time the windowed prefill of ``B`` sequences (``past`` cached tokens, then a ``chunk``) per
    format, bf16 first (correctness is the tests' job: tests/test_prefill_window.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.bench_prefill import fill
    from kvq.attention.triton import kernels, prefill
    from kvq.models.llama import attend

    B, H, group, D = args.B, 8, 4, 128
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run under TRITON_INTERPRET=1
    timer = bench if dev == "cuda" else _wall
    formats = "bfloat16,int4_kivi,int2_kivi,fp8_e4m3" if "--formats" not in sys.argv else args.formats
    gen = torch.Generator().manual_seed(0)
    flops = 4 * B * H * group * D * (args.chunk * args.past + args.chunk * args.chunk / 2)
    default = {kind: dict(t) for kind, t in prefill.TILES.items()}
    if args.lib:
        from kvq.attention.backends import with_prefill
        from kvq.attention.flashinfer_lib import FlashInferLib
        from kvq.attention.split_prefill import SplitPrefill

        kernels = with_prefill(kernels, SplitPrefill(FlashInferLib(dev)).paged_attention)
    keys = ("block_m", "block_n", "num_warps", "num_stages")
    tiles = [tuple(int(x) for x in c.split("x")) for c in args.tiles.split(",")] if args.tiles else [None]
    base = {}
    for fmt in formats.split(","):
        h, meta, q, k, v = fill(fmt, kernels, B, args.past, args.chunk, H, D, group, dev, gen)
        layer = h.layer
        sm = D ** -0.5
        win = meta.window
        rows = f"{len(win.exact_rows)} exact + {len(win.sealed_rows)} sealed extra pages" if win else "no window"
        for tile in tiles:
            for kind in prefill.TILES:
                prefill.TILES[kind].update(zip(keys, tile) if tile else default[kind])
            t = timer(lambda: attend(kernels, q, layer, meta, sm, k, v), iters=10)
            base[tile] = t if fmt == "bfloat16" else base.get(tile)
            x = f"  {base[tile] / t:.2f}x bf16" if base.get(tile) else ""
            name = "x".join(map(str, tile)) if tile else "default"
            print(f"{fmt:22s} {name:11s} B={B} past={args.past} chunk={args.chunk}: {t:9.1f} us "
                  f"{flops / t / 1e6:6.1f} TFLOP/s{x}  ({rows})", flush=True)
        for kind in prefill.TILES:
            prefill.TILES[kind].update(default[kind])
        if args.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                attend(kernels, q, layer, meta, sm, k, v)
                torch.cuda.synchronize()
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:6]:
                print(f"    {e.self_device_time_total:9.1f} us  {e.count:3d} x  {e.key[:70]}")
        h = layer = meta = win = None  # the pool goes before the next format's
        if dev == "cuda":
            torch.cuda.empty_cache()


def _wall(fn, iters=1):
    import time

    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


if __name__ == "__main__":
    main()

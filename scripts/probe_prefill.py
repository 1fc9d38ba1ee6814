"""Prefill-kernel timing probe on the GPU (not the benchmark): a chunk of new tokens
per sequence attending causally over its cached past, per KV format, with the f16
and the model-dtype dot for 8-bit formats.  Prints one line per case."""

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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()

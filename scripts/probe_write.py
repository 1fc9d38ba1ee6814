"""Write/seal kernel timing probe on the GPU (not the benchmark: see benchmarks/).

Times kvq's Triton ``write_kv`` on a prefill-sized write (T tokens filling
whole, scattered blocks, as bench_decode.py does) per format over a sweep of
tokens-per-program and warps, and the block seal alone for block-sealed
formats; then, where the CUDA block seal (seal.cu) serves the layer, the cuda backend's
``write_kv`` and its parts: the per-token kernel alone, and each role's CUDA and Triton
seal.  Prints GB/s (bytes read + written) and the share of copy bandwidth.

    python3 scripts/probe_write.py --formats int4_kivi,int2_kivi --tb 16 --warps 2"""

import argparse
import itertools

import torch

from benchmarks.bench_decode import FULL, Config, KVGen, block_size_for, make_layer
from kvq.attention.triton import store
from scripts.probe_decode import bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--formats", default="bfloat16,fp8_e4m3,int8,int8_per_token_head,fp8_per_block,int4_kivi")
    ap.add_argument("--tb", default="16,32,64")
    ap.add_argument("--warps", default="2,4,8")
    args = ap.parse_args()
    cfg = Config(**FULL)
    dev = torch.device("cuda")
    buf = torch.empty(2, 1 << 30, dtype=torch.uint8, device=dev)
    copy = (2 << 30) / bench(lambda: buf[1].copy_(buf[0])) / 1e3
    print(f"copy {copy:.0f} GB/s", flush=True)
    buf = None
    for fmt_name in args.formats.split(","):
        bs = block_size_for(fmt_name, cfg)
        T = args.T - args.T % bs
        nb = T // bs
        plan, pool, layer, _ = make_layer(fmt_name, cfg, nb, 1, dev)
        gen = KVGen(cfg.d, dev, 7)
        k = gen.k((T, cfg.hkv, cfg.d))
        v = gen.v((T, cfg.hkv, cfg.d))
        perm = torch.randperm(nb, device=dev)
        tok = torch.arange(T, device=dev)
        slots = (perm[tok // bs] * bs + tok % bs).to(torch.int64)
        full = torch.stack([perm, torch.arange(nb, device=dev) * bs], dim=1).to(torch.int64).contiguous()
        nbytes = 2 * k.numel() * k.element_size() + nb * plan.layers[0].block_bytes(cfg.hkv, cfg.d, bs)
        for tb, w in itertools.product(map(int, args.tb.split(",")), map(int, args.warps.split(","))):
            t = bench(lambda: store.write_kv(layer, k, v, slots, full, tokens_per_program=tb, num_warps=w,
                                             seal_warps=w))
            gbps = nbytes / t / 1e3
            print(f"{fmt_name:20s} write tb={tb:3d} warps={w}: {t:7.1f} us {gbps:6.0f} GB/s "
                  f"{100 * gbps / copy:5.1f}%", flush=True)
        if not plan.layers[0].write_direct:
            for role, x in (("k", k), ("v", v)):
                if layer.tensor_format(role).write_direct:
                    continue
                for w in map(int, args.warps.split(",")):
                    t = bench(lambda: store.seal_from(layer, role, x, full[:, 1], x.stride(0), x.stride(1),
                                                      x.stride(0), full[:, 0], w))
                    print(f"{fmt_name:20s} seal {role} warps={w}: {t:7.1f} us", flush=True)
        cuda_parts(layer, k, v, slots, full, nbytes, copy, fmt_name)
        del pool
        layer = None
        torch.cuda.empty_cache()


def cuda_parts(layer, k, v, slots, full, nbytes, copy, fmt_name):
    """The cuda backend's write (Triton per-token kernel + seal.cu) and its parts, where it differs."""
    from kvq.attention.cuda import seal
    from kvq.attention.cuda import kernels as cuda_kernels

    if seal.layer_reason(layer) is not None:
        return
    parts = {"write_kv cuda": lambda: cuda_kernels.write_kv(layer, k, v, slots, full),
             # full[:-1]: not every token in a listed whole block, so the per-token kernel runs; no seal
             "token kernel only": lambda: store.write_kv(layer, k, v, slots, full[:-1], sealer=lambda *a: None)}
    for role, x in (("k", k), ("v", v)):
        a = (layer, role, x, full[:, 1], x.stride(0), x.stride(1), x.stride(0), full[:, 0])
        parts[f"seal {role} cuda"] = (lambda a=a: seal.seal_from(*a))
    parts["seal k+v cuda"] = lambda: seal.seal_both_from(layer, k, v, full[:, 1], k.stride(0), k.stride(1),
                                                         k.stride(0), full[:, 0])
    for label, fn in parts.items():
        t = bench(fn)
        gbps = nbytes / t / 1e3
        print(f"{fmt_name:20s} {label:18s}: {t:7.1f} us {gbps:6.0f} GB/s {100 * gbps / copy:5.1f}% "
              "(of the whole write's bytes)", flush=True)


if __name__ == "__main__":
    main()

"""Sampling kernel timing probe on the GPU (not the benchmark: see benchmarks/).

Times ``kvq.models.sampling_triton.sample_rows`` on a decode step's logits (B rows of a V-wide
vocabulary, Llama-3's 128256 by default) in bf16 (what the model returns) and float32, greedy and
drawing, and the float32 copy of bf16 logits for comparison; prints us and the logits' GB/s.
Run it from another tree with that tree's package first on PYTHONPATH to time its kernel.

    python3 scripts/probe_sample.py --B 512"""

import argparse

import torch

from kvq.models.sampling_triton import sample_rows
from scripts.probe_decode import bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=512)
    ap.add_argument("--V", type=int, default=128256)
    args = ap.parse_args()
    B, V, dev = args.B, args.V, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x32 = torch.randn(B, V, device=dev, generator=g) * 3
    t, greedy = torch.full((B,), 0.8, device=dev), torch.zeros(B, dtype=torch.bool, device=dev)
    seeds = torch.arange(B, dtype=torch.int64, device=dev)
    xb = x32.to(torch.bfloat16)
    us = bench(lambda: xb.float())
    print(f"float32 copy of bf16 logits {B}x{V}: {us:7.1f} us {B * V * 6 / us / 1e3:6.0f} GB/s", flush=True)
    for x in (xb, x32):
        for all_greedy in (True, False):
            us = bench(lambda: sample_rows(x, t, greedy, seeds, all_greedy=all_greedy))
            print(f"sample_rows {str(x.dtype)[6:]:8s} {'greedy' if all_greedy else 'draw':6s} {B}x{V}: {us:7.1f} us "
                  f"{x.numel() * x.element_size() / us / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()

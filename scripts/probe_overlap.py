"""Probe: does a decode step gain from running two halves of the batch on two streams, one half's
memory-bound attention beside the other half's compute-bound GEMMs (nano-batch overlap)?

Llama-3-8B decode layers (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336) with their own
weights and their own KV cache per layer, B sequences of L tokens, attention through the CUDA
decode kernel; rope, the KV write and the norms are left out (about 5% of the step at c512).
Each mode is captured in one CUDA graph and timed with CUDA events:

* serial: the whole batch, layer after layer (what the engine does now);
* halves: two half batches one after the other on one stream (what halving costs the GEMMs);
* overlap: the halves on two streams, the second half's layer i waiting only for its own
  layer i-1, so that one half's attention can run beside the other's GEMMs.

Prints one line per mode; --out saves JSON.  Not a benchmark of kvq: a design probe.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool
from kvq.models.fused import add_rms_norm, silu_mul

HID, HQ, HKV, D, INTER = 4096, 32, 8, 128, 14336


def build(fmt: str, layers: int, B: int, L: int):
    plan = make_plan(bare_model(layers, HKV, D, num_attention_heads=HQ), fmt, sink_tokens=0, residual_tokens=0)
    bs = plan.block_size
    per_seq = L // bs
    pool = KVPool.create(plan, B * per_seq, 16, "cuda")
    from kvq.attention.triton.store import seal_blocks

    for layer in pool.layers:
        layer.k_hp.normal_()
        layer.v_hp.normal_()
        ids = torch.arange(B * per_seq, device="cuda")
        seal_blocks(layer, ids % 16, ids)
    tables = torch.randperm(B * per_seq, device="cuda").to(torch.int32).view(B, per_seq)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(o, i):
        return (torch.randn(o, i, device="cuda", generator=g, dtype=torch.bfloat16) * i ** -0.5)

    weights = [dict(qkv=w((HQ + 2 * HKV) * D, HID), o=w(HID, HQ * D), gu=w(2 * INTER, HID), d=w(HID, INTER),
                    norm=torch.ones(HID, device="cuda", dtype=torch.bfloat16))
               for _ in range(layers)]
    return pool, tables, lens, weights


def layer_fwd(x, wt, layer, tables, lens, L, kernels, after_qkv=None):
    """One decode layer (its input RMS-normed, residual left out); ``after_qkv`` (a callable) runs
    between the QKV GEMM and attention."""
    x, _ = add_rms_norm(x, None, wt["norm"], 1e-5)
    qkv = x @ wt["qkv"].T
    if after_qkv is not None:
        after_qkv()
    q = qkv[:, :HQ * D].view(x.shape[0], HQ, D)
    o = kernels.paged_decode(q, layer, tables, lens, D ** -0.5, max_seq_len=L, has_hp=False)
    h = o.reshape(x.shape[0], HQ * D) @ wt["o"].T
    return silu_mul(h @ wt["gu"].T) @ wt["d"].T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="int4_kivi,bfloat16")
    ap.add_argument("--B", type=int, default=512)
    ap.add_argument("--L", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--profile", action="store_true", help="print the serial graph's kernels (torch.profiler)")
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="then replay the serial graph for this many seconds, printing ms/layer each second "
                         "(does the step slow down as the GPU heats? log nvidia-smi beside it)")
    args = ap.parse_args()
    results = []
    for fmt in args.formats.split(","):
        results.append(probe(fmt, args))
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), results=results), f, indent=1)


def probe(fmt: str, args) -> dict:
    B, L, N = args.B, args.L, args.layers
    if fmt == "bfloat16":
        from kvq.attention.triton import kernels
    else:
        from kvq.attention.cuda import kernels
    pool, tables, lens, weights = build(fmt, N, B, L)
    x0 = torch.randn(B, HID, device="cuda", dtype=torch.bfloat16)
    h = B // 2
    halves = [(slice(0, h), tables[:h], lens[:h]), (slice(h, B), tables[h:], lens[h:])]
    s2 = torch.cuda.Stream()

    def serial():
        x = x0
        for i in range(N):
            x = layer_fwd(x, weights[i], pool.layers[i], tables, lens, L, kernels)
        return x

    def two_halves():
        outs = []
        for rows, tb, ln in halves:
            x = x0[rows]
            for i in range(N):
                x = layer_fwd(x, weights[i], pool.layers[i], tb, ln, L, kernels)
            outs.append(x)
        return outs

    def overlap(stagger: bool):
        main_s = torch.cuda.current_stream()
        s2.wait_stream(main_s)
        xa, xb = x0[halves[0][0]], x0[halves[1][0]]
        for i in range(N):
            ev = torch.cuda.Event()
            xa = layer_fwd(xa, weights[i], pool.layers[i], halves[0][1], halves[0][2], L, kernels,
                           after_qkv=ev.record if stagger else None)
            with torch.cuda.stream(s2):
                if stagger:  # B's QKV GEMM starts with A's attention, B's attention with A's MLP
                    s2.wait_event(ev)
                xb = layer_fwd(xb, weights[i], pool.layers[i], halves[1][1], halves[1][2], L, kernels)
        main_s.wait_stream(s2)
        return xa, xb

    row = dict(format=fmt, B=B, L=L, layers=N)
    ref = serial()
    for name, fn in (("serial", serial), ("halves", two_halves), ("overlap", lambda: overlap(False)),
                     ("staggered", lambda: overlap(True))):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        ts = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        graph.replay()
        torch.cuda.synchronize()
        got = out if name == "serial" else torch.cat(list(out))
        same = torch.allclose(got.float(), ref.float(), rtol=0.05, atol=0.05)
        t = statistics.median(ts) / N
        row[name + "_ms_per_layer"] = round(t, 4)
        row[name + "_matches_serial"] = bool(same)
        row[name + "_finite"] = bool(got.isfinite().all())
        if args.profile and name == "serial":
            from torch.profiler import ProfilerActivity, profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
        if args.sustain and name == "serial":
            row["sustained_ms_per_layer"] = sustain(graph, args.sustain, N)
        print(f"{fmt:10s} B={B} L={L} {name:8s} {t:7.3f} ms/layer  x32 = {t * 32:6.2f} ms/step  "
              f"matches serial: {same}, finite: {row[name + '_finite']}", flush=True)
        del graph
    # the parts alone, whole batch: attention, and the four GEMMs
    for part, fn in (("attention", lambda: kernels.paged_decode(
            x0.new_empty(B, HQ, D).normal_(), pool.layers[0], tables, lens, D ** -0.5, max_seq_len=L,
            has_hp=False)), ("gemms", lambda: gemms_only(x0, weights[0])),):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        row[part + "_ms"] = round(statistics.median(ts), 4)
        print(f"{fmt:10s} B={B} L={L} {part:9s} alone {statistics.median(ts):7.3f} ms", flush=True)
    return row


def sustain(graph, seconds: float, layers: int) -> list[float]:
    """Replay ``graph`` back to back for ``seconds``; the median ms/layer of each second."""
    import time

    per_second, t_end = [], time.monotonic() + seconds
    while time.monotonic() < t_end:
        ts, t1 = [], time.monotonic() + 1.0
        while time.monotonic() < t1:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / layers)
        per_second.append(round(statistics.median(ts), 4))
        print(f"  second {len(per_second):3d}: {per_second[-1]:.3f} ms/layer", flush=True)
    return per_second


def gemms_only(x, wt):
    """The four GEMMs of a layer (attention output replaced by the query rows)."""
    qkv = x @ wt["qkv"].T
    h = qkv[:, :HQ * D] @ wt["o"].T
    return silu_mul(h @ wt["gu"].T) @ wt["d"].T


if __name__ == "__main__":
    main()

"""Do a long prompt's GEMMs run at the rate a single call shows?  (Issue 43: the TTFT floor's GEMM rate.)

Llama-3-8B's four projections at 8192 rows (one prefill chunk): each alone as ``ttft_floor.py`` times it
(median of 10 single calls after an idle spin, L2 flushed), then a 32K prompt's sequence (4 chunks x 32
layers x 4 GEMMs, distinct weights per layer) back to back, timed as a whole four times, while a thread
samples the SM clock, power and temperature every ~0.1 s (nvidia-smi).  Prints JSON, then the samples.

On an H100 (session 36, docs/results/s36_h100/sustain_gemm_clocks_h100.log) the single calls ran at 766-793
TFLOP/s at 1980 MHz; back to back the board sat at its 700 W cap, the clock fell to 1140-1425 MHz, and the
sequence took 636-689 ms against the single calls' 580 (720-664 TFLOP/s).

    python benchmarks/probe_sustained_gemm.py        # on the GPU machine (scripts/gpu.sh python ...)
"""
import json
import math
import subprocess
import threading
import time

import torch
import torch.nn.functional as F

M, H, INTER, LAYERS, CHUNKS = 8192, 4096, 14336, 32, 4
SHAPES = {"qkv": (H, 6144), "o": (H, H), "gate_up": (H, 2 * INTER), "down": (INTER, H)}  # (K, N)


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w = [{n: torch.randn(N, K, device=dev, dtype=bf, generator=g) / math.sqrt(K) for n, (K, N) in SHAPES.items()}
         for _ in range(LAYERS)]
    x = {K: torch.randn(M, K, device=dev, dtype=bf, generator=g) for K in {H, INTER}}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip()
            samples.append((time.time(), out))
            time.sleep(0.1)

    def event():
        return torch.cuda.Event(enable_timing=True)

    th = threading.Thread(target=sample)
    th.start()
    alone = {}
    with torch.inference_mode():
        for n, (K, N) in SHAPES.items():
            ts = []
            for i in range(13):
                flush.zero_()
                torch.cuda._sleep(1_000_000)
                a, b = event(), event()
                a.record()
                F.linear(x[K], w[0][n])
                b.record()
                torch.cuda.synchronize()
                if i >= 3:
                    ts.append(a.elapsed_time(b))
            ms = sorted(ts)[len(ts) // 2]
            alone[n] = {"alone_ms": ms, "alone_tflops": 2 * M * K * N / ms / 1e9}
        flops = CHUNKS * LAYERS * sum(2 * M * K * N for K, N in SHAPES.values())
        seq = []
        for _ in range(4):
            t0 = time.time()
            a, b = event(), event()
            a.record()
            for _c in range(CHUNKS):
                for layer in w:
                    for n, (K, _N) in SHAPES.items():
                        F.linear(x[K], layer[n])
            b.record()
            torch.cuda.synchronize()
            ms = a.elapsed_time(b)
            seq.append({"start": t0, "ms": ms, "tflops": flops / ms / 1e9})
        time.sleep(3.0)  # the clock's recovery, in the samples
    stop.set()
    th.join()
    floor_s = sum(CHUNKS * LAYERS * 2 * M * K * N / (alone[n]["alone_tflops"] * 1e12) for n, (K, N) in SHAPES.items())
    print(json.dumps({"alone": alone, "sequence_floor_ms": floor_s * 1e3, "sequence": seq}, indent=1))
    for t, s in samples:
        print(f"{t - samples[0][0]:6.2f} s  sm MHz, W, C: {s}")


if __name__ == "__main__":
    main()

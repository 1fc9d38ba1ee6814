"""On a CUDA machine: the CUDA decode kernel is what `kvq env` reports with CuPy, and the Triton fallback
with a WARNING (once) without it.

    python scripts/cuda_extra_check.py [--out docs/results/cuda_extra_h200.json]

Runs `kvq env --json` twice in subprocesses: as installed, and with `import cupy` blocked (what a
machine without `pip install 'kvq[cuda]'` sees); the second also resolves the backend of three
engines' plans in one process and counts the WARNING lines.  Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

BLOCK = "import sys; sys.modules['cupy'] = None\n"
ENV = "from kvq.cli import main; main(['env', '--json', '--model', 'llama-3-8b'])\n"
ENGINES = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
from kvq.attention.backends import select_backend
from kvq.cache.plan import KVCacheConfig
from kvq.models.source import model_shape
shape = model_shape('llama-3-8b')
for fmt in ('int4_kivi', 'fp8_e4m3', 'int8_per_token_head'):
    _, c = select_backend('auto', KVCacheConfig(dtype=fmt).plan(shape), 'cuda', torch.bfloat16)
    print('RESOLVED', fmt, c.resolved)
"""
QUANT = ("fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "fp8_per_block", "int8", "int8_per_token_head",
         "int4_kivi", "int2_kivi")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/results/cuda_extra_h200.json")
    args = ap.parse_args()
    with_cupy = json.loads(run(ENV).stdout)
    without = json.loads(run(BLOCK + ENV).stdout)
    eng = run(BLOCK + ENGINES)
    warnings = [ln for ln in eng.stderr.splitlines() if ln.startswith("WARNING")]
    rows = {r["format"]: r for r in with_cupy["formats"]}
    rows_without = {r["format"]: r for r in without["formats"]}
    n = with_cupy["model"]["layers"]
    checks = {
        "cupy_version": with_cupy["cupy"]["version"],
        "cuda_decode_with_cupy": {f: rows[f]["decode_per_layer"] for f in QUANT},
        "every_quantized_format_on_cuda": all(rows[f]["decode_per_layer"] == f"cuda 0-{n - 1}" for f in QUANT),
        "without_cupy": {f: rows_without[f]["decode_per_layer"] for f in QUANT},
        "every_quantized_format_on_triton_without_cupy": all(
            rows_without[f]["decode_per_layer"] == f"triton 0-{n - 1}" for f in QUANT),
        "why_not_without_cupy": without["cuda_decode_kernel"]["why_not"],
        "warnings_for_three_engines": warnings,
        "one_warning": len(warnings) == 1 and "kvq[cuda" in warnings[0],
        "gpu": with_cupy["torch"].get("gpus"),
    }
    print(json.dumps(checks, indent=1))
    with open(args.out, "w") as f:
        json.dump({"with_cupy": with_cupy, "without_cupy": without, "checks": checks}, f, indent=1)
    ok = checks["every_quantized_format_on_cuda"] and checks["every_quantized_format_on_triton_without_cupy"] \
        and checks["one_warning"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

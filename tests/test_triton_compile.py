"""Every Triton kernel variant compiles for sm_90 (H100/H200), checked on a CPU machine.

The interpreter used by the other tests accepts code that the GPU compiler
rejects; this runs tests/aot_compile.py in a subprocess without the
interpreter and compiles each launch the launchers make, ahead of time.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.formats.registry import entries, resolve_format

ROOT = Path(__file__).resolve().parent.parent
# rotated codebook formats whose roles' code paths rot3_kc and turboquant_k8v4 already compile (3-bit codes
# centred and not, 4-bit codes beside FP8): left out, for time (a rotated format's launches take ~10 s each
# to compile cold: their [rows, D] x [D, D] float32 products); tests/aot_compile.py compiles those two at D 128
SAME_PATHS = ("rot4_kc", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
FORMATS = [e.name for e in entries() if e.name not in ("auto", "float32", "float16", "fp8_e4m3fnuz", *SAME_PATHS)
           and not any(resolve_format(e.name, r).reference_only for r in ("k", "v"))]


SHARDS = 4  # the distinct launches are split over this many tests, which the pytest workers share


@pytest.mark.parametrize("shard", range(SHARDS))
def test_all_kernels_compile_for_sm90(shard):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_compile.py"), "--shard", f"{shard}/{SHARDS}",
                        *FORMATS], capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    m = re.search(r"shard \d+/\d+: (\d+) of (\d+) distinct launches, (\d+) assembled by ptxas", r.stdout)
    assert m and int(m[2]) >= SHARDS and int(m[1]) == len(range(shard, int(m[2]), SHARDS)), r.stdout[-3000:]
    assert 1 <= int(m[3]) <= int(m[1]), r.stdout[-3000:]  # every code path once, at its largest size
    assert "kernel variants compiled for sm_90" in r.stdout

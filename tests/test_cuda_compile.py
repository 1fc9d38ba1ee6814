"""The CUDA 8-bit decode kernel compiles for sm_90a, without spills, in the variants the launcher uses.

Runs only where nvcc is installed (the development and CI machines have it); the
kernel itself runs on the GPU machine (tests/test_cuda_decode.py, `make gpu-test`).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from kvq.attention.cuda.decode8 import min_blocks_for

SRC = Path(__file__).resolve().parent.parent / "kvq" / "attention" / "cuda" / "decode8.cu"

# (head_dim, page, group, K kind, V kind, K scale mode, V scale mode, hp, bf16 model[, KIVI bits])
VARIANTS = [
    (128, 32, 4, 0, 0, 0, 0, 1, 1, 4),  # int4_kivi with hp blocks
    (128, 32, 4, 0, 0, 0, 0, 0, 1, 2),  # int2_kivi
    (64, 32, 3, 0, 0, 0, 0, 1, 0, 4),   # int4_kivi, head_dim 64, f16 model
    (256, 64, 8, 0, 0, 0, 0, 1, 1, 2),  # int2_kivi, head_dim 256
    (128, 16, 4, 0, 0, 0, 0, 0, 1),  # fp8_e4m3, static
    (128, 16, 4, 1, 1, 0, 0, 1, 1),  # fp8_e5m2 with hp blocks
    (128, 16, 4, 0, 0, 1, 1, 1, 1),  # fp8_per_token_head
    (128, 32, 8, 0, 0, 3, 3, 0, 0),  # fp8_per_block, f16 model
    (128, 16, 4, 2, 2, 2, 2, 1, 1),  # int8 (f16 scales)
    (64, 32, 3, 2, 2, 1, 1, 1, 0),   # int8_per_token_head, head_dim 64, f16 model
    (256, 16, 8, 0, 2, 1, 2, 1, 1),  # mixed K/V formats, head_dim 256
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: "D{}p{}g{}k{}v{}ks{}vs{}hp{}bf{}".format(*v) + (
    f"kivi{v[9]}" if len(v) > 9 else ""))
def test_decode8_compiles(tmp_path, v):
    d, page, group, kk, vk, ks, vs, hp, bf = v[:9]
    macros = dict(HEAD_DIM=d, PAGE=page, GROUP=group, K_KIND=kk, V_KIND=vk, K_SCALE=ks, V_SCALE=vs, HAS_HP=hp,
                  MODEL_BF16=bf, MIN_BLOCKS=min_blocks_for(d), KIVI_BITS=v[9] if len(v) > 9 else 0)
    cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v",
           *(f"-D{k}={v}" for k, v in macros.items()), "-o", str(tmp_path / "k.cubin"), str(SRC)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "0 bytes spill stores" in r.stderr, r.stderr[-2000:]

"""The CUDA 8-bit decode kernel compiles for sm_90a in every variant the launcher uses.

Runs only where nvcc is installed (the development and CI machines have it); the
kernel itself runs on the GPU machine (scripts/probe_decode.py --cuda).
"""

import itertools
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "kvq" / "attention" / "cuda" / "decode8.cu"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("kinds", [(0, 0), (1, 1), (2, 2), (0, 2)])
def test_decode8_compiles(tmp_path, kinds):
    for (ks, vs), page, group in itertools.product([(0, 0), (1, 1), (2, 2), (3, 3)], (16, 32), (4, 8)):
        cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v",
               f"-DHEAD_DIM=128", f"-DPAGE={page}", f"-DGROUP={group}", f"-DK_KIND={kinds[0]}",
               f"-DV_KIND={kinds[1]}", f"-DK_SCALE={ks}", f"-DV_SCALE={vs}", "-o", str(tmp_path / "k.cubin"), str(SRC)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "0 bytes spill stores" in r.stderr, r.stderr[-2000:]

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


# 3-bit rotated codebooks with their levels from registers (ROT_REG_LUT, the default) and from the shared table,
# with the high-precision path: rot3_kc (K centred), turboquant_k3v4_nc (V in 4 bits), turboquant_3bit_nc at 256
REG_LUT_VARIANTS = [
    dict(HEAD_DIM=128, PAGE=32, KC=1, V_BITS=3),
    dict(HEAD_DIM=128, PAGE=16, KC=0, V_BITS=4),
    dict(HEAD_DIM=256, PAGE=16, KC=0, V_BITS=3),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("v", REG_LUT_VARIANTS, ids=lambda v: "D{HEAD_DIM}kc{KC}v{V_BITS}".format(**v))
def test_decode8_register_levels_compile(tmp_path, v):
    """It compiles, and spills no more than the table's variant (which spills 12-36 bytes at head_dim 256
    with 3-bit codes and the hp path, none below)."""
    import re

    spills = []
    for reg in (0, 1):
        macros = dict(GROUP=4, KIVI_BITS=3, HAS_HP=1, MODEL_BF16=1, MIN_BLOCKS=min_blocks_for(v["HEAD_DIM"]), ROT=1,
                      ROT_REG_LUT=reg, **v)
        cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v",
               *(f"-D{k}={x}" for k, x in macros.items()), "-o", str(tmp_path / "k.cubin"), str(SRC)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        spills.append(int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1)))
    assert spills[1] <= spills[0] and (v["HEAD_DIM"] == 256 or spills[1] == 0), spills


SEAL = Path(__file__).resolve().parent.parent / "kvq" / "attention" / "cuda" / "seal.cu"
# (head_dim, page, bf16 model, K (fmt, bits, kind, qmax), V (fmt, bits, kind, qmax))
SEAL_VARIANTS = [
    (128, 32, 1, (4, 4, 0, 15), (5, 4, 0, 15)),    # int4_kivi
    (256, 64, 0, (4, 2, 0, 3), (5, 2, 0, 3)),      # int2_kivi, f16 model
    (64, 32, 1, (4, 4, 0, 15), (3, 8, 0, 448)),    # int4_kivi K, fp8_per_block V
    (128, 16, 1, (3, 8, 1, 57344), (3, 8, 2, 127)),  # per-block e5m2 K, per-block int8 V
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("v", SEAL_VARIANTS,
                         ids=lambda v: "D{}p{}bf{}".format(*v[:3]) + "k{}v{}".format(v[3][0], v[4][0]))
def test_seal_compiles(tmp_path, v):
    d, page, bf, k, vv = v
    macros = dict(HEAD_DIM=d, PAGE=page, MODEL_BF16=bf, NT=128)
    for name, (fmt, bits, kind, qmax) in (("K", k), ("V", vv)):
        macros.update({f"{name}_FMT": fmt, f"{name}_BITS": bits, f"{name}_KIND": kind, f"{name}_QMAX": qmax})
    cmd = ["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v",
           *(f"-D{k}={v}" for k, v in macros.items()), "-o", str(tmp_path / "s.cubin"), str(SEAL)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "0 bytes spill stores" in r.stderr, r.stderr[-2000:]


def test_seal_serves_block_sealed_layers_only():
    """The CUDA seal takes KIVI (groups of 32) and per-block roles; other layers name why not."""
    from kvq.attention.cuda import seal
    from kvq.cache.plan import bare_model, make_plan
    from kvq.cache.pool import KVPool

    def layer(fmt, **kw):
        plan = make_plan(bare_model(1, 2, 128, num_attention_heads=8), fmt, **kw)
        return KVPool.create(plan, 4, 2, "cpu").layers[0]

    assert seal.layer_reason(layer("int4_kivi")) is None
    assert seal.layer_reason(layer("fp8_per_block", block_size=32)) is None
    assert "fp8_e4m3" in seal.layer_reason(layer("fp8_e4m3", block_size=32))
    assert "groups of 64" in seal.layer_reason(layer("int4_kivi", group_size=64))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_pipe_probe_times_the_instruction_it_names():
    """scripts/probe_pipes.py (issue 44's rates) builds for sm_90a, and each case's timed loop holds one of its
    instructions a chain a round: the rate it prints is that instruction's."""
    import sys

    sys.path.insert(0, str(SRC.parents[3]))
    from scripts import probe_pipes

    loops = probe_pipes.loops()
    want = {"prmt": "PRMT", "lop3": "LOP3", "shf": "SHF", "hfma2": "HFMA2", "cvt_e4m3x2_f16x2": "F2FP",
            "mma_f16_m16n8k16": "HMMA"}
    for op, opcode in want.items():
        assert loops[op][opcode] == probe_pipes.CHAINS, (op, loops[op])
    assert loops["prmt+cvt"]["PRMT"] == loops["prmt+cvt"]["F2FP"] == probe_pipes.CHAINS

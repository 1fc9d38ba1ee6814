"""Compile the CUDA kernels (decode8.cu, seal.cu) for sm_90 without a GPU, through NVRTC alone.

The launchers compile their kernels at run time with CuPy's NVRTC on the GPU machine; a
mistake in the source shows only there.  This script calls libnvrtc directly (ctypes), so
it runs on any machine that has the library (`make cuda-compile-check` fetches it from PyPI).

Each variant is compiled to a cubin for sm_90 (front end and ptxas) with the macros its
launcher passes; the script prints one line a variant, with the registers and spill bytes
ptxas reports (``-Xptxas -v``), and exits 1 on the first failure, with the compiler's log.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "kvq" / "attention" / "cuda"


def compile_cubin(lib, source: str, name: str, options: list[str]) -> tuple[bool, str, int]:
    """(ok, log, cubin bytes) of one compilation."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if rc:
        return False, f"nvrtcCreateProgram: {rc}", 0
    opts = [o.encode() for o in options]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace")
    nbytes = 0
    if rc == 0:
        cs = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(cs))
        nbytes = cs.value
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log, nbytes


def decode8_variants():
    """The macro sets decode8.py compiles (kvq.attention.cuda.decode8._kernel), over the shapes kvq serves."""
    # (K's bits, V's, K per token, rotated, K centred, FP8 K): 8-bit; KIVI 4 and 2; the per-token 4 and 2
    # (K_TOKEN, pages of 16); the rotated 4- and 3-bit codebooks (ROT, pages of 16), K centred (KC, pages of
    # 32), K 3 / V 4, FP8 K beside a rotated 4-bit V (K8)
    for d, (kivi, v_bits, k_token, rot, kc, k8) in itertools.product((64, 128, 256), (
            (0, 0, 0, 0, 0, 0), (4, 4, 0, 0, 0, 0), (2, 2, 0, 0, 0, 0), (4, 4, 1, 0, 0, 0), (2, 2, 1, 0, 0, 0),
            (4, 4, 0, 1, 0, 0), (3, 3, 0, 1, 0, 0), (4, 4, 0, 1, 1, 0), (3, 3, 0, 1, 1, 0), (3, 4, 0, 1, 0, 0),
            (4, 4, 0, 1, 0, 1))):
        if 3 in (kivi, v_bits) and d < 128:  # (3-bit rotated codes: head_dim 128 and 256)
            continue
        kinds = [(0, 0, 0, 0), (2, 2, 1, 1), (0, 0, 3, 3), (1, 1, 2, 2)] if not kivi else [(0, 0, 0, 0)]
        for (kk, vk, ks, vs), has_hp, bf16 in itertools.product(kinds, (False, True), (True, False)):
            min_blocks = 3 if d <= 128 else 2
            page, step32 = (32, 1) if kivi and not k_token and not rot else (32 if kc else 16, 0)
            kind = (("rot" if rot else "kivi") + str(kivi) + ("t" if k_token else "") + ("kc" if kc else "")
                    + (f"v{v_bits}" if v_bits != kivi else "") + ("k8" if k8 else ""))
            yield (f"decode8 D{d} {kind} kinds{kk}{vk} scales{ks}{vs} hp{int(has_hp)} bf16{int(bf16)}",
                   ["-std=c++17", f"-DHEAD_DIM={d}", f"-DPAGE={page}", "-DGROUP=4", f"-DKIVI_BITS={kivi}",
                    f"-DK_KIND={kk}", f"-DV_KIND={vk}", f"-DK_SCALE={ks}", f"-DV_SCALE={vs}", f"-DHAS_HP={int(has_hp)}",
                    f"-DMODEL_BF16={int(bf16)}", "-DNWARPS=4", "-DNSTAGES=3", f"-DMIN_BLOCKS={min_blocks}",
                    f"-DKIVI_STEP32={step32}", f"-DK_TOKEN={k_token}", f"-DROT={rot}", f"-DKC={kc}",
                    f"-DV_BITS={v_bits}", f"-DK8={k8}"])

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default="libnvrtc.so.12", help="path of libnvrtc")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    lib = ctypes.CDLL(args.lib)
    src = (CUDA / "decode8.cu").read_text()
    n = 0
    for name, opts in decode8_variants():
        ok, log, nbytes = compile_cubin(lib, src, "decode8.cu", opts + [f"-arch={args.arch}", "-Xptxas", "-v"])
        if not ok:
            print(f"FAILED {name}\n{log}")
            return 1
        n += 1
        warn = sum("warning" in line for line in log.splitlines())
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores", log)
        print(f"compiled {name}: cubin {nbytes} B, {regs[1] if regs else '?'} registers, "
              f"{spill[1] if spill else '?'} B spilled" + (f" ({warn} warnings)" if warn else ""))
    print(f"{n} variants compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())

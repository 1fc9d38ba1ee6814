"""FlashInfer's JIT modules for kvq's GPU targets: build them all at once, export them, reuse them.

FlashInfer 0.7.0 compiles each paged-prefill variant (backend, dtype, sliding window, head_dim)
the first time it is planned: about 140 s a module on the device machine, one module after the
other, so a fresh machine spends most of a test or benchmark call compiling (session 28 lost
three calls to it). This script

  build            builds every variant kvq's GPU targets plan, in one ninja run over all cores
  export DIR       copies each built module's shared object to DIR (what a later call carries)
  install DIR      places DIR's shared objects where FlashInfer looks for prebuilt (AOT) modules,
                   so a later call loads them instead of compiling; a module that fails to load
                   is compiled again by FlashInfer itself

  python3 scripts/flashinfer_cache.py build [--head-dims 64,128] [--fa2]
  python3 scripts/flashinfer_cache.py export .ficache
  python3 scripts/flashinfer_cache.py install .ficache

The shared objects are FlashInfer's own kernels built from its sources on the same kind of
machine; they are a build cache, never committed (``.ficache`` is ignored).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path


def specs(head_dims: list[int], fa2: bool, fp8: bool = False) -> list:
    """The batch-prefill modules kvq plans: FA3 for the model dtype (bf16) and the dequantized
    scratch (f16), with and without the sliding window (the windowed split's tail call);
    FA2 bf16 without window for bench_prefill's baseline rows when ``fa2``; FA3's FP8 kernel
    (e4m3 in, bf16 out: ``--prefill-backend flashinfer-fp8``) when ``fp8``."""
    import torch
    from flashinfer.jit.attention import modules as m

    out = []
    for hd in head_dims:
        for dt in (torch.bfloat16, torch.float16):
            for swa in (False, True):
                args = (dt, dt, dt, torch.int32, hd, hd, 0, swa, False, False)
                out.append(m.gen_batch_prefill_module("fa3", *args))
        if fa2:
            args = (torch.bfloat16,) * 3 + (torch.int32, hd, hd, 0, False, False, False)
            out.append(m._gen_batch_prefill_primary_module("fa2", *args))
        if fp8:
            e4 = torch.float8_e4m3fn
            out.append(m.gen_batch_prefill_module("fa3", e4, e4, torch.bfloat16, torch.int32, hd, hd, 0, False, False,
                                                  False))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("build", "export", "install"))
    ap.add_argument("dir", nargs="?", default=".ficache", help="export/install folder (default .ficache)")
    ap.add_argument("--head-dims", default="64,128", help="comma-separated head dims (default 64,128)")
    ap.add_argument("--fa2", action="store_true", help="also FA2 bf16 (bench_prefill's baseline rows)")
    ap.add_argument("--fp8", action="store_true", help="also FA3's FP8 kernel (--prefill-backend flashinfer-fp8)")
    a = ap.parse_args(argv)
    folder = Path(a.dir)
    if a.action == "install":  # no flashinfer import: this runs before anything plans a module
        import importlib.util

        spec = importlib.util.find_spec("flashinfer")
        if spec is None or not spec.submodule_search_locations:
            print("flashinfer is not importable", file=sys.stderr)
            return 2
        aot = Path(list(spec.submodule_search_locations)[0]) / "data" / "aot"
        n = 0
        for so in sorted(folder.glob("*.so")):
            (aot / so.stem).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(so, aot / so.stem / so.name)
            n += 1
        print(f"installed {n} prebuilt FlashInfer modules into {aot}")
        return 0
    try:
        from flashinfer.jit.core import build_jit_specs
    except ImportError as e:  # the CPU machine, or no .whl carried: nothing to build
        print(f"flashinfer is not importable ({e}); no modules built")
        return 0

    todo = specs([int(x) for x in a.head_dims.split(",")], a.fa2, a.fp8)
    if a.action == "build":
        t0 = time.perf_counter()
        missing = [s for s in todo if not s.is_aot and not s.jit_library_path.exists()]
        print(f"building {len(missing)} of {len(todo)} FlashInfer modules in one ninja run", flush=True)
        build_jit_specs(missing)
        print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for s in todo:
        src = s.jit_library_path
        if src.exists():
            shutil.copyfile(src, folder / src.name)
            total += src.stat().st_size
            print(f"{src.name}: {src.stat().st_size / 2**20:.1f} MiB")
    print(f"exported to {folder}: {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

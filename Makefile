# The two commands: `make run` and `make test`. Both create .venv on first use.
# torch is installed first, pinned to the CPU build on disk, so that nothing that
# depends on it pulls the multi-GB CUDA wheels.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

.PHONY: run test setup clean bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python jobs/train.py --config jobs/configs/demo.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/knapray bench planner

clean:
	rm -rf $(VENV) runs

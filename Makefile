# Each target creates or reuses .venv and installs what it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test bench lint clean nvrx-compat

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[demo,dev]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trainguard demo --output-dir runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy

# NVRx's own tests/inprocess files, import-rewritten (nvidia_resiliency_ext -> trainguard), kept
# OUTSIDE this repository; nothing is fetched. NVRX_TESTS=dir holds an ``inprocess/`` package.
nvrx-compat: $(STAMP)
	@if [ -z "$(NVRX_TESTS)" ] || [ ! -d "$(NVRX_TESTS)/inprocess" ]; then \
	  echo "nvrx-compat: set NVRX_TESTS=DIR, where DIR/inprocess/ holds NVRx's tests/inprocess files"; \
	  echo "  (github.com/NVIDIA/nvidia-resiliency-ext, Apache-2.0) with 'nvidia_resiliency_ext' replaced"; \
	  echo "  by 'trainguard' in imports; this target downloads nothing."; exit 2; fi
	cd "$(NVRX_TESTS)" && $(abspath $(BIN))/python -m pytest -p no:cacheprovider -o addopts="" \
	  --timeout=120 -q inprocess $(NVRX_PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info

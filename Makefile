# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench bench-dist bench-quality clean

$(STAMP): pyproject.toml setup.py $(wildcard recstack/compression/eb/_eb*.[ch])
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/recstack train --config configs/demo.toml --output-dir runs/demo --overwrite

test: $(STAMP)
	$(VENV)/bin/ruff check recstack bench tests
	$(VENV)/bin/mypy recstack
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/train_throughput.py

# Distributed throughput against TorchRec. TorchRec and FBGEMM live only in this separate environment (torch
# pinned to the release torchrec 1.8.0 pairs with, recstack editable) so the package never depends on them.
BENCH_VENV  ?= .venv-bench
BENCH_PY    := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
BENCH_TORCH ?= 2.13.0
BENCH_ARGS  ?=

$(BENCH_STAMP): pyproject.toml setup.py $(wildcard recstack/compression/eb/_eb*.[ch])
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q torch==$(BENCH_TORCH)
	$(BENCH_PY) -m pip install -q -e .
	$(BENCH_PY) -m pip install -q --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
	$(BENCH_PY) -m pip install -q tensordict torchmetrics==1.0.3 tqdm pyre-extensions
	touch $(BENCH_STAMP)

bench-dist: $(BENCH_STAMP)
	$(BENCH_PY) bench/dist_throughput.py --out bench/results/dist_throughput.json $(BENCH_ARGS)

# Model quality against FuxiCTR's DLRM and DCNv2 on real data (bench/quality.py). FuxiCTR lives only in this
# separate environment (the CPU torch, FuxiCTR from the registry; polars < 2: FuxiCTR 2.3.10 calls scan_csv with
# an argument polars 2 removed); recstack runs from the main one and never depends on it. QUALITY_ARGS=--quick
# for a one-seed MovieLens-100k run.
QUALITY_VENV    ?= .venv-quality
QUALITY_PY      := $(QUALITY_VENV)/bin/python
QUALITY_STAMP   := $(QUALITY_VENV)/.installed
QUALITY_FUXICTR ?= 2.3.10
QUALITY_ARGS    ?=

$(QUALITY_STAMP):
	$(PYTHON) -m venv $(QUALITY_VENV)
	$(QUALITY_PY) -m pip install -q --upgrade pip
	$(QUALITY_PY) -m pip install -q torch==$(BENCH_TORCH)
	$(QUALITY_PY) -m pip install -q fuxictr==$(QUALITY_FUXICTR) 'polars<2'
	touch $(QUALITY_STAMP)

bench-quality: $(STAMP) $(QUALITY_STAMP)
	$(PY) bench/quality.py --fuxictr-python $(QUALITY_PY) --out bench/results/quality.json $(QUALITY_ARGS)

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(QUALITY_VENV) runs .pytest_cache .mypy_cache

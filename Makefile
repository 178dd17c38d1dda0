# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/recstack train --config configs/demo.toml --output-dir runs/demo

test: $(STAMP)
	$(VENV)/bin/ruff check recstack bench tests
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/train_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache

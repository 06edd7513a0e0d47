# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: demo test lint bench clean

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) bash scripts/setup.sh
	touch $@

demo: $(VENV)/.installed
	$(PY) scripts/demo.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check packdata tests scripts benchmarks
	$(VENV)/bin/ruff format --check packdata tests scripts benchmarks
	$(VENV)/bin/mypy packdata
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_private_imports.py

test: lint
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_lmdb.py

clean:
	rm -rf $(VENV) demo-data bench-data

# The two set-up commands of the README: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT_ARGS ?=

.PHONY: serve test bench-addsub clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

serve: $(VENV)/.installed
	$(VENV)/bin/tideserve --model-repository model_repository $(PORT_ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench-addsub: $(VENV)/.installed
	$(PY) bench/addsub.py

clean:
	rm -rf $(VENV) .pytest_cache

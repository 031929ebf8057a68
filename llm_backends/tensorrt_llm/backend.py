"""``backend: "tensorrtllm"``: serve a TensorRT-LLM model through its LLM API (``tensorrt_llm.LLM``).

The engine batches in flight, so tideserve does not: the pass-through scheduler hands each request to
``execute`` at once, in a task of its own; ``execute`` submits one engine request per request row
(``generate_async``) and streams the engine's outputs back through the request's ResponseSender until
the last. ``tensorrt_llm`` is imported only when a model of this backend loads; when it cannot
be imported (no NVIDIA GPU, not installed) that model is UNAVAILABLE with the reason and the rest of
the server serves on.

Tests plug a test double of the LLM API in with :meth:`TensorRTLLMBackend.using`.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from tideserve.backend_api import (
    Backend,
    Cancelled,
    InferenceRequest,
    InternalError,
    InvalidArgument,
    Model,
    ModelInstance,
    PassThroughScheduler,
    Scheduler,
    ServerError,
    Unavailable,
    model_paths,
)

from ..metrics import LLMMetrics
from .interface import Job, Row, auto_complete, logprobs_json, make_response, parse_request, token_logprob

log = logging.getLogger(__name__)

NOT_INSTALLED = ("TensorRT-LLM is not installed: it needs an NVIDIA GPU (CUDA, Linux x86_64 or aarch64); "
                 "pip install tensorrt-llm (see https://nvidia.github.io/TensorRT-LLM/installation/), "
                 "then load the model again")


def import_tensorrt_llm() -> Any:
    """The real ``tensorrt_llm`` package, with ``_tensorrt_engine`` (the LLM class for prebuilt TensorRT
    engines in TensorRT-LLM >= 0.20, where ``tensorrt_llm.LLM`` is the PyTorch flow) loaded if present."""
    try:
        module = importlib.import_module("tensorrt_llm")
    except ImportError as exc:
        raise Unavailable(f"{NOT_INSTALLED} ({type(exc).__name__}: {exc})") from exc
    except Exception as exc:  # installed but broken: missing CUDA libraries, no driver...
        raise Unavailable(f"TensorRT-LLM failed to import: {type(exc).__name__}: {exc}") from exc
    try:
        importlib.import_module("tensorrt_llm._tensorrt_engine")
    except Exception:  # older releases: tensorrt_llm.LLM runs engines itself
        log.debug("tensorrt_llm._tensorrt_engine not importable; tensorrt_llm.LLM loads engines", exc_info=True)
    return module


# -- configuration --------------------------------------------------------------------------------
def _unset(value: str | None) -> bool:
    """Empty, or a placeholder of Triton's fill_template.py that was never filled."""
    return value is None or not value.strip() or (value.startswith("${") and value.endswith("}"))


class Settings:
    """The model's ``parameters`` that this backend reads."""

    def __init__(self, model: TensorRTLLMModel) -> None:
        ctx = model.ctx
        self._ctx = ctx

        def param(key: str) -> str | None:
            value = ctx.parameter(key)
            return None if _unset(value) else value.strip()

        self.param = param
        engine = param("engine_dir") or param("gpt_model_path")
        checkpoint = param("model")
        if engine and checkpoint:
            raise InvalidArgument(f"model '{ctx.name}': set parameters engine_dir (a built TensorRT engine) or "
                                  f"model (a checkpoint for the PyTorch flow), not both")
        if not engine and not checkpoint:
            raise InvalidArgument(f"model '{ctx.name}': set parameters engine_dir (a directory of a built TensorRT "
                                  f"engine) or model (a Hugging Face checkpoint directory or model name)")
        engine_key = "engine_dir" if param("engine_dir") else "gpt_model_path"
        self.engine_dir = self._path(engine_key, engine) if engine else None
        self.model = self._path("model", checkpoint, must_exist=False) if checkpoint else None
        tokenizer = param("tokenizer_dir")
        self.tokenizer_dir = self._path("tokenizer_dir", tokenizer) if tokenizer else None
        self.exclude_input_in_output = self._bool("exclude_input_in_output", False)
        self.default_max_tokens = self._int("default_max_tokens")
        self.stats_interval_s = self._float("stats_interval_s", 1.0)
        self.llm_kwargs = self._llm_kwargs()

    def _path(self, key: str, value: str, must_exist: bool = True) -> str:
        """Absolute as given; relative to the version directory, then to the model directory."""
        path = Path(value).expanduser()
        if path.is_absolute():
            candidates = [path]
        else:
            candidates = [self._ctx.version_path / path, self._ctx.model_path / path]
        for candidate in candidates:
            if candidate.exists():
                return str(self._ctx.check_file(candidate, f"parameter '{key}'", value))
        if must_exist:
            raise Unavailable(f"model '{self._ctx.name}': {value} not found (looked at "
                              f"{', '.join(str(c) for c in candidates)})")
        if not model_paths.is_hub_id(value):
            raise InvalidArgument(f"model '{self._ctx.name}': parameter '{key}' '{value}' is neither a local "
                                  "directory nor a model id of the form 'org/name'")
        return value  # a Hugging Face model name

    def _bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.param(key)
        if value is None:
            return default
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise InvalidArgument(f"model '{self._ctx.name}': parameter {key} must be true or false, got '{value}'")

    def _int(self, key: str) -> int | None:
        value = self.param(key)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise InvalidArgument(f"model '{self._ctx.name}': parameter {key} must be an integer, "
                                  f"got '{value}'") from None

    def _float(self, key: str, default: float | None = None) -> float | None:
        value = self.param(key)
        if value is None:
            return default
        try:
            return float(value)
        except ValueError:
            raise InvalidArgument(f"model '{self._ctx.name}': parameter {key} must be a number, "
                                  f"got '{value}'") from None

    def _llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``LLM(...)``: ``llm_args`` (JSON) overlaid with the typed parameters."""
        kwargs: dict[str, Any] = {}
        raw = self.param("llm_args")
        if raw is not None:
            try:
                kwargs = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"model '{self._ctx.name}': parameter llm_args is not valid JSON: {exc}") from None
            if not isinstance(kwargs, dict):
                raise InvalidArgument(f"model '{self._ctx.name}': parameter llm_args must be a JSON object")
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "max_beam_width", "max_num_tokens",
                    "max_seq_len"):
            value = self._int(key)
            if value is not None:
                kwargs[key] = value
        for key, target in (("trust_remote_code", "trust_remote_code"), ("skip_tokenizer_init", "skip_tokenizer_init"),
                            ("enable_chunked_context", "enable_chunked_prefill")):
            value = self._bool(key)
            if value is not None:
                kwargs[target] = value
        if self.param("dtype"):
            kwargs["dtype"] = self.param("dtype")
        kv = dict(kwargs.get("kv_cache_config") or {})
        fraction = self._float("kv_cache_free_gpu_mem_fraction")
        if fraction is not None:
            kv["free_gpu_memory_fraction"] = fraction
        reuse = self._bool("enable_kv_cache_reuse")
        if reuse is not None:
            kv["enable_block_reuse"] = reuse
        if kv:
            kwargs["kv_cache_config"] = kv
        if self.tokenizer_dir:
            kwargs["tokenizer"] = self.tokenizer_dir
        return kwargs


# -- one request in the engine ---------------------------------------------------------------------
class RowRun:
    """One engine request (one row of a tideserve request) and what has been sent of it."""

    def __init__(self, row: Row, result: Any, tracker) -> None:
        self.row = row
        self.result = result  # tensorrt_llm RequestOutput: async iterable, .outputs, .abort()
        self.tracker = tracker
        self.beam = bool(row.sampling.get("use_beam_search"))
        self.sent_tokens: dict[int, int] = {}
        self.sent_text: dict[int, int] = {}
        self.counted: dict[int, int] = {}
        self.finished = False

    def prompt_tokens(self) -> int:
        ids = getattr(self.result, "prompt_token_ids", None)
        if ids is None and isinstance(self.row.prompt, list):
            ids = self.row.prompt
        return len(ids or [])

    def count_new_tokens(self) -> None:
        """Feed the metrics: new tokens of every sequence (beam search: the best beam)."""
        outputs = list(self.result.outputs)[:1] if self.beam else list(self.result.outputs)
        new = 0
        for out in outputs:
            length = len(out.token_ids or [])
            new += max(0, length - self.counted.get(out.index, 0))
            self.counted[out.index] = length
        if self.tracker is not None:
            self.tracker.tokens(new)

    def abort(self) -> None:
        if self.finished:
            return
        try:
            self.result.abort()
        except Exception:  # already finished in the engine, or the engine is gone
            log.debug("abort of a TensorRT-LLM request failed", exc_info=True)

    def part(self, job: Job, delta: bool) -> tuple[dict[str, np.ndarray], int]:
        """This row's output tensors (without the batch dimension) and how many new tokens they carry.

        ``delta``: only what was not sent yet (streaming). Beam search streams whole beams, as
        TensorRT-LLM returns them (earlier tokens of a beam can change)."""
        outputs = sorted(self.result.outputs, key=lambda o: o.index)
        news, all_tokens = [], []
        for out in outputs:
            tokens = list(out.token_ids or [])
            start = min(self.sent_tokens.get(out.index, 0), len(tokens)) if delta and not self.beam else 0
            news.append((start, tokens[start:]))
            all_tokens.append(tokens)
            if delta:
                self.sent_tokens[out.index] = len(tokens)
        new_count = sum(len(n) for _, n in news)
        if job.text:
            return self._text_part(job, outputs, news, delta), new_count
        return self._token_part(job, outputs, news, all_tokens), new_count

    def _token_part(self, job, outputs, news, all_tokens) -> dict[str, np.ndarray]:
        prefix = list(self.row.prompt) if (job.include_input and not job.stream) else []
        seqs = [prefix + new for _, new in news]
        width = max((len(s) for s in seqs), default=0)
        ids = np.full((len(seqs), width), -1, np.int32)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
        part = {"output_ids": ids, "sequence_length": np.array([len(s) for s in seqs], np.int32)}
        if job.logprobs:
            per_token = []
            cums = []
            for out, (start, new), tokens in zip(outputs, news, all_tokens):
                entries = list(out.logprobs or [])
                values = [token_logprob(entries[start + i], t) if start + i < len(entries) else 0.0
                          for i, t in enumerate(new)]
                per_token.append(values)
                cum = out.cumulative_logprob
                if cum is None:  # the TensorRT flow fills it only on request: sum what there is
                    cum = sum(token_logprob(e, t) for e, t in zip(entries, tokens)) if entries else 0.0
                cums.append(cum)
            lp_width = max((len(v) for v in per_token), default=0)
            lps = np.zeros((len(per_token), lp_width), np.float32)
            for i, v in enumerate(per_token):
                lps[i, :len(v)] = v
            part["cum_log_probs"] = np.array(cums, np.float32)
            part["output_log_probs"] = lps
        return part

    def _text_part(self, job, outputs, news, delta) -> dict[str, np.ndarray]:
        texts = []
        for out in outputs:
            text = out.text or ""
            if delta and not self.beam:
                start = min(self.sent_text.get(out.index, 0), len(text))
                self.sent_text[out.index] = len(text)
                text = text[start:]
            if job.include_input and not job.stream:
                text = self.row.prompt + text
            texts.append(text.encode("utf-8"))
        part = {"text_output": np.array(texts, dtype=np.object_)}
        extras = job.extras
        if extras.get("finish_reason"):
            part["finish_reason"] = np.array([str(o.finish_reason).encode() for o in outputs], dtype=np.object_)
        if extras.get("cumulative_logprob"):
            part["cumulative_logprob"] = np.array(
                [o.cumulative_logprob if o.cumulative_logprob is not None else math.nan for o in outputs], np.float32)
        if extras.get("logprobs"):
            items = []
            for out, (start, new) in zip(outputs, news):
                entries = list(out.logprobs or [])
                items.append(logprobs_json(entries[start:start + len(new)], new) if entries else b"null")
            part["logprobs"] = np.array(items, dtype=np.object_)
        if extras.get("num_input_tokens"):
            part["num_input_tokens"] = np.array([self.prompt_tokens()], np.uint32)
        if extras.get("num_output_tokens"):
            part["num_output_tokens"] = np.array([len(new) for _, new in news], np.uint32)
        return part


class JobRun:
    """One tideserve request in flight: its rows in the engine and the task that answers it (the
    scheduler's task for the request, which runs the job inline)."""

    def __init__(self, request: InferenceRequest, job: Job, runs: list[RowRun], task: asyncio.Task) -> None:
        self.request = request
        self.job = job
        self.runs = runs
        self.remaining = len(runs)
        self.task = task
        self.cancel_error: ServerError | None = None
        self.done = False

    def cancel(self, error: ServerError) -> None:
        """Abort the engine requests and stop answering (the request's cancellation: client gone,
        timeout, shutdown past the exit timeout)."""
        if self.cancel_error is not None or self.done:
            return
        self.cancel_error = error
        for run in self.runs:
            run.abort()
        self.task.cancel()


# -- the model ------------------------------------------------------------------------------------
class TensorRTLLMInstance(ModelInstance):
    async def execute(self, requests: list[InferenceRequest]) -> None:
        """Run the request (the pass-through scheduler sends one per call) from submission to its end."""
        for request in requests:
            try:
                await self.model.run(request)
            except ServerError as exc:
                request.response_sender.send_error(exc)


class TensorRTLLMModel(Model):
    instance_class = TensorRTLLMInstance

    def __init__(self, backend: TensorRTLLMBackend, ctx) -> None:
        super().__init__(backend, ctx)
        self.settings: Settings | None = None
        self.llm: Any = None
        self.trtllm: Any = None
        self.tokenizer: Any = None
        self.active_rows = 0
        self.llm_metrics: LLMMetrics | None = None
        self._labels = (ctx.name, str(ctx.version))
        self._stats_task: asyncio.Task | None = None
        self._engine_stats = False

    # -- lifecycle --
    def auto_complete_config(self) -> None:
        auto_complete(self.config)

    def create_scheduler(self, runtime) -> Scheduler:
        return PassThroughScheduler(runtime)

    async def initialize(self) -> None:
        loop = asyncio.get_running_loop()
        self.trtllm = await loop.run_in_executor(None, self.backend.load_trtllm)
        self.settings = Settings(self)
        llm_class = self._llm_class()
        target = self.settings.engine_dir or self.settings.model
        log.info("model '%s': loading TensorRT-LLM %s %s", self.ctx.name,
                 "engine" if self.settings.engine_dir else "model", target)
        kwargs = dict(self.settings.llm_kwargs)
        kv_class = getattr(self.trtllm, "KvCacheConfig", None) or getattr(getattr(self.trtllm, "llmapi", None),
                                                                           "KvCacheConfig", None)
        if isinstance(kwargs.get("kv_cache_config"), dict) and kv_class is not None:
            try:
                kwargs["kv_cache_config"] = kv_class(**kwargs["kv_cache_config"])
            except Exception as exc:
                raise InvalidArgument(f"model '{self.ctx.name}': kv_cache_config {kwargs['kv_cache_config']}: "
                                      f"{type(exc).__name__}: {exc}") from exc
        try:  # minutes for a real engine: off the event loop
            self.llm = await loop.run_in_executor(None, lambda: llm_class(model=target, **kwargs))
        except ServerError:
            raise
        except Exception as exc:
            raise Unavailable(f"TensorRT-LLM could not load {target}: {type(exc).__name__}: {exc}") from exc
        self.tokenizer = getattr(self.llm, "tokenizer", None)
        if self.ctx.metrics is not None:
            self.llm_metrics = self.ctx.metrics.extension("llm", LLMMetrics)
            self._publish_state()
            if self.settings.stats_interval_s and hasattr(self.llm, "get_stats_async"):
                self._stats_task = loop.create_task(self._poll_stats(self.settings.stats_interval_s))

    def _llm_class(self):
        trt = self.trtllm
        if self.settings.engine_dir:
            engine_module = getattr(trt, "_tensorrt_engine", None)
            engine_llm = getattr(engine_module, "LLM", None)
            if engine_llm is not None:
                return engine_llm
        return trt.LLM

    async def finalize(self) -> None:
        # the runtime stops the scheduler first: no request of this model runs any more
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)
        llm, self.llm = self.llm, None
        if self.llm_metrics is not None:
            self.llm_metrics.set_engine_state(*self._labels, running=0, waiting=0, kv_cache_usage=0.0)
        if llm is not None and hasattr(llm, "shutdown"):
            try:
                await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
            except Exception:
                log.exception("model '%s': TensorRT-LLM shutdown failed", self.ctx.name)

    # -- requests --
    async def run(self, request: InferenceRequest) -> None:
        """Parse ``request``, put its rows into the engine and answer it, in the calling task."""
        if self.llm is None:
            raise Unavailable(f"model '{self.ctx.name}' is not loaded")
        config = self.config
        job = parse_request(request, batched=config.max_batch_size > 0,
                            decoupled=config.model_transaction_policy.decoupled,
                            exclude_input_default=self.settings.exclude_input_in_output, tokenizer=self.tokenizer)
        runs: list[RowRun] = []
        try:
            for row in job.rows:
                params = self._sampling_params(row)
                try:
                    result = self.llm.generate_async(row.prompt, sampling_params=params, streaming=job.stream)
                except (ValueError, TypeError) as exc:  # the LLM API's argument checks
                    raise InvalidArgument(f"TensorRT-LLM rejected the request: {exc}") from exc
                except Exception as exc:
                    raise InternalError(f"TensorRT-LLM failed to accept the request: {type(exc).__name__}: {exc}") from exc
                tracker = self.llm_metrics.tracker(*self._labels) if self.llm_metrics is not None else None
                runs.append(RowRun(row, result, tracker))
        except BaseException:
            for run in runs:
                run.abort()
            raise
        job_run = JobRun(request, job, runs, asyncio.current_task())
        self.active_rows += len(runs)
        self._publish_state()
        loop = asyncio.get_running_loop()

        def on_cancel() -> None:  # any thread
            try:
                loop.call_soon_threadsafe(job_run.cancel, Cancelled("the request was cancelled"))
            except RuntimeError:  # the loop is closed: the server is gone
                pass

        request.cancellation.add_callback(on_cancel)
        await self._answer(job_run)

    def _sampling_params(self, row: Row) -> Any:
        kwargs = dict(row.sampling)
        if row.stop_texts:
            kwargs["stop"] = row.stop_texts
        if row.bad_texts:
            kwargs["bad"] = row.bad_texts
        if "max_tokens" not in kwargs and self.settings.default_max_tokens:
            kwargs["max_tokens"] = self.settings.default_max_tokens
        tokenizer = self.tokenizer
        if (row.stop_word_ids or row.bad_word_ids) and kwargs.get("end_id") is None and tokenizer is not None:
            # The LLM tokenizes stop / bad strings (SamplingParams._setup) only when end_id is unset; setting
            # end_id as _setup would keeps the client's exact token ids, pinned below.
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is not None:
                kwargs["end_id"] = eos
                pad = getattr(tokenizer, "pad_token_id", None)
                kwargs.setdefault("pad_id", pad if pad is not None else eos)
        try:
            params = self.trtllm.SamplingParams(**kwargs)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"invalid sampling parameters: {exc}") from exc
        if kwargs.get("end_id") is not None:
            for texts, ids, attr in ((row.stop_texts, row.stop_word_ids, "_stop_word_ids"),
                                     (row.bad_texts, row.bad_word_ids, "_bad_word_ids")):
                if not texts:
                    continue
                if not ids:
                    if tokenizer is None:
                        raise InvalidArgument("sampling_parameters: stop / bad strings need the model's tokenizer")
                    ids = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
                if hasattr(params, attr):
                    setattr(params, attr, ids)
        return params

    async def _answer(self, job_run: JobRun) -> None:
        """Stream the engine's outputs back until the last. A cancellation of the request itself
        (:meth:`JobRun.cancel`) ends it here; a cancellation of the task from outside (the scheduler
        stopping) propagates once the request is answered."""
        request, job = job_run.request, job_run.job
        sender = request.response_sender
        try:
            if len(job_run.runs) == 1:
                await self._consume(job_run, job_run.runs[0])
            else:
                tasks = [asyncio.get_running_loop().create_task(self._consume(job_run, run)) for run in job_run.runs]
                try:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                finally:
                    for task in tasks:
                        if not task.done():
                            task.cancel()
                failed = [t for t in done if not t.cancelled() and t.exception() is not None]
                if failed:
                    raise failed[0].exception()
            if not job.stream:
                parts = [run.part(job, delta=False)[0] for run in job_run.runs]
                sender.send(make_response(job, parts), final=True)
        except asyncio.CancelledError:
            for run in job_run.runs:
                run.abort()
                if not run.finished and run.tracker is not None:
                    run.tracker.finish(run.prompt_tokens(), aborted=True)
            sender.send_error(job_run.cancel_error or Cancelled("the request was cancelled"))
            if job_run.cancel_error is None:
                raise
            asyncio.current_task().uncancel()  # the request's own cancellation, handled: the task goes on
        except ServerError as exc:
            for run in job_run.runs:
                run.abort()
            sender.send_error(exc)
        except Exception as exc:  # the engine failed this request: answer it, keep serving the others
            log.warning("model '%s': TensorRT-LLM request failed: %s: %s", self.ctx.name, type(exc).__name__, exc)
            for run in job_run.runs:
                run.abort()
            sender.send_error(InternalError(f"TensorRT-LLM engine error: {type(exc).__name__}: {exc}"))
        finally:
            job_run.done = True
            self.active_rows -= len(job_run.runs)
            self._publish_state()

    async def _consume(self, job_run: JobRun, run: RowRun) -> None:
        job, sender = job_run.job, job_run.request.response_sender
        multi = len(job_run.runs) > 1
        final_sent = False
        async for output in run.result:
            run.count_new_tokens()
            finished = bool(getattr(output, "finished", False))
            if not job.stream:
                continue
            part, new = run.part(job, delta=True)
            last = False
            if finished:
                job_run.remaining -= 1
                last = job_run.remaining == 0
                final_sent = True
            if new or (finished and job.text and job.extras.get("finish_reason")):
                sender.send(make_response(job, [part], batch_index=run.row.index if multi else None), final=last)
            elif last:
                sender.send(None, final=True)
            if finished:
                break
        run.finished = True
        if run.tracker is not None:
            run.tracker.finish(run.prompt_tokens())
        if job.stream and not final_sent:  # the engine ended the stream without a finished output
            job_run.remaining -= 1
            if job_run.remaining == 0:
                sender.send(None, final=True)

    # -- engine state metrics --
    def _publish_state(self, running: int | None = None, waiting: int | None = None,
                       kv_cache_usage: float | None = None) -> None:
        if self.llm_metrics is None:
            return
        if running is None and self._engine_stats:
            return  # the stats poller publishes the engine's own numbers
        self.llm_metrics.set_engine_state(*self._labels, running=self.active_rows if running is None else running,
                                          waiting=waiting or 0, kv_cache_usage=kv_cache_usage or 0.0)

    async def _poll_stats(self, interval: float) -> None:
        """Publish the engine's iteration stats (active / queued requests, KV-cache blocks) when it gives them."""
        while True:
            latest = None
            try:
                deadline = time.monotonic() + interval
                async for stats in self.llm.get_stats_async(timeout=interval):
                    latest = json.loads(stats) if isinstance(stats, str) else stats
                    if time.monotonic() >= deadline:
                        break
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("model '%s': TensorRT-LLM stats unavailable; reporting request counts", self.ctx.name,
                          exc_info=True)
                self._engine_stats = False
                self._publish_state()
                return
            if isinstance(latest, dict):
                kv = latest.get("kvCacheStats") or {}
                used, total = kv.get("usedNumBlocks"), kv.get("maxNumBlocks")
                self._engine_stats = True
                self._publish_state(running=int(latest.get("numActiveRequests", self.active_rows)),
                                    waiting=int(latest.get("numQueuedRequests", 0)),
                                    kv_cache_usage=(used / total) if used is not None and total else 0.0)
            await asyncio.sleep(interval)


class TensorRTLLMBackend(Backend):
    """``backend: "tensorrtllm"``. ``trtllm_module``: what provides the LLM API (``LLM``, ``SamplingParams``
    and, for engines, ``_tensorrt_engine.LLM``); None imports the real ``tensorrt_llm`` when a model loads."""

    model_class = TensorRTLLMModel
    trtllm_module: Any = None

    def __init__(self, trtllm_module: Any = None) -> None:
        if trtllm_module is not None:
            self.trtllm_module = trtllm_module

    @classmethod
    def using(cls, trtllm_module: Any) -> type[TensorRTLLMBackend]:
        """This backend bound to another LLM API provider (a test double): register the returned class
        with ``BackendRegistry.register("tensorrtllm", ...)``."""
        return type(f"{cls.__name__}Using{type(trtllm_module).__name__}", (cls,), {"trtllm_module": trtllm_module})

    def load_trtllm(self) -> Any:
        if self.trtllm_module is not None:
            return self.trtllm_module
        return import_tensorrt_llm()

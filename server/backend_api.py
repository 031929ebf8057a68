"""The backend API: everything a backend imports from tideserve, and all it may import.

A backend (``general_backends/*``, ``llm_backends/*``, ``ensembles``, or a package of your own
registered under the entry-point group ``tideserve.backends``) imports only this module. The names
live elsewhere in the server; this module is the list of those that are public to backends.

Types
    :class:`Tensor` (``name``, ``datatype``, ``shape``, ``data``: a numpy array; BYTES tensors are
    object arrays of ``bytes``), :class:`InferenceRequest` (inputs, requested outputs as
    :class:`RequestedOutput`, parameters, priority, timeout, a :class:`CancellationToken`, its
    :class:`ResponseSender`, and ``reschedule``: set during ``execute`` to have an ``iterative_sequence``
    model's sequence batcher run the request again), :class:`InferenceResponse` (outputs, parameters, ``error``,
    ``final``). Errors are :class:`ServerError` subclasses, each with a :class:`Status` that the
    frontends map to HTTP and gRPC codes: :class:`InvalidArgument`, :class:`NotFound`,
    :class:`Unavailable` (:class:`QueueFull`: a queue at its bound), :class:`Unsupported`, :class:`Cancelled`,
    :class:`DeadlineExceeded`, :class:`InternalError`; :func:`as_server_error` turns any exception into one.

Backend, Model, ModelInstance
    A :class:`Backend` makes one :class:`Model` per model version from a :class:`ModelContext`;
    the model makes one :class:`ModelInstance` per instance-group slot (:class:`InstanceContext`).
    Hooks (``auto_complete_config``, ``initialize``, ``execute``, ``finalize``) may be plain (run
    on a worker thread) or ``async`` (run on the event loop). ``execute(requests)`` either returns
    one response per request or answers through each request's :class:`ResponseSender` (decoupled
    models: 0..N responses, then FINAL). :class:`TensorModelInstance` runs a batch as one tensor
    call (inputs concatenated along the batch dimension, outputs split back). A model that serves
    LoRA adapters overrides ``lora_adapters``, ``load_lora_adapter`` and ``unload_lora_adapter``
    (the vllm backend does; the DataPlane lists and loads adapters through them).

Typed LLM requests
    :class:`GenerationRequest` (prompt or token ids, sampling parameters, LoRA, what to report) arrives as
    ``request.generation`` (with no input tensors) at a model whose class sets ``takes_generation = True``; it
    answers with :class:`GenerationDelta` in ``response.generation`` (text deltas, token counts, finish reasons,
    logprobs, usage). See :mod:`tideserve.generation`.

ModelContext: what the server hands a model at construction
    ``name``, ``version``, ``config`` (Triton's ``ModelConfig`` message), ``model_path``, helpers
    for the model's files (``local_path``, ``check_file``, ``parameter``), ``metrics`` (the
    server's metrics, for backends that add families of their own), ``report_failure(reason)``
    (the model broke for good while serving) and three handles, each None where the server gives
    none:

    - ``infer`` (:class:`Infer`): ``infer(request)`` submits a core :class:`InferenceRequest` to
      another model through the same path as a client's request (readiness, validation,
      statistics) and returns its :class:`InferStream`; ``await infer.unary(request)`` returns its
      one response.
    - ``models`` (:class:`ModelLookup`): ``models(name, version)`` is the ``ModelConfig`` of a
      ready model version (a ServerError when there is none).
    - ``control`` (:class:`ModelControl`): ``load``, ``unload`` and ``ready`` of other models.

Schedulers
    The server picks :class:`DirectScheduler` (one request per execute) or :class:`DynamicBatcher`
    (``dynamic_batching`` in the config) unless ``Model.create_scheduler(runtime)`` returns one:
    :class:`PassThroughScheduler` for engines that batch continuously, or a :class:`Scheduler`
    subclass of the backend's own, which gets the :class:`ModelRuntime` it serves
    (:class:`InstanceSlot` is one of its instances) and may use :func:`drop_cancelled`.

Process links
    :mod:`wire` (the structs and framing every process link of the server shares: tensors, requests, responses,
    errors that keep their status, HTTP code and Retry-After) and :mod:`arena` (tensors in shared memory), for a
    backend that runs its models in processes of its own (the ``python`` backend does).

Helpers
    Datatype conversion (:func:`numpy_dtype`, :func:`datatype_of`, :func:`config_to_datatype`,
    :func:`datatype_to_config`), the config as Triton's JSON (:func:`config_to_dict`,
    :func:`config_to_json`), :mod:`model_paths` (paths a model config names) and :func:`conform_shape`
    (Triton's rule for the shape a tensor takes when it passes from one model to another).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import arena, model_paths, wire
from .backend import (
    Backend,
    Infer,
    InferStream,
    InstanceContext,
    Model,
    ModelContext,
    ModelControl,
    ModelInstance,
    ModelLookup,
)
from .batching import TensorModelInstance
from .config import to_dict as config_to_dict
from .config import to_json as config_to_json
from .datatypes import config_to_datatype, datatype_of, datatype_to_config, numpy_dtype
from .errors import (
    Cancelled,
    DeadlineExceeded,
    DeadlinePassed,
    InternalError,
    InvalidArgument,
    NotFound,
    QueueFull,
    ServerError,
    Status,
    Unavailable,
    Unsupported,
    as_server_error,
    error_of_status,
)
from .generation import EngineInfo, GenerationDelta, GenerationRequest
from .responses import ResponseSender
from .types import CancellationToken, InferenceRequest, InferenceResponse, RequestedOutput, Tensor
from .validation import conform_shape

if TYPE_CHECKING:
    from .runtime import InstanceSlot, ModelRuntime
    from .schedulers import DirectScheduler, DynamicBatcher, PassThroughScheduler, Scheduler
    from .schedulers.base import drop_cancelled
    from .stats import ModelStats
    from .workers.direct import (DIRECT_EXECUTING, DIRECT_QUEUE_SUFFIX, DIRECT_QUEUE_WORD, DIRECT_RUN_SHIFT,
                                  DIRECT_SHORT_RUN_US, DIRECT_SHORT_RUNS, BodyDecoder, DirectAnswer,
                                  DirectAnswers, DirectJson, DirectSubmit, DirectToProcess)
    from .workers.direct import direct_run_stamp
    from .schedulers.passthrough import queue_bound
    from .workers.engines import engine_client_workers

# The scheduler side of the API is imported when a backend first asks for it, so that a model process (which runs
# instances, never schedulers) does not load the schedulers, the runtime and the statistics.
_SCHEDULING = {"ModelRuntime": "runtime", "InstanceSlot": "runtime", "Scheduler": "schedulers",
               "DirectScheduler": "schedulers", "DynamicBatcher": "schedulers", "PassThroughScheduler": "schedulers",
               "drop_cancelled": "schedulers.base",
               # --frontend-direct: a model process's side of the frontend workers' direct links
               "ModelStats": "stats", "DirectSubmit": "workers.direct", "DirectAnswer": "workers.direct",
               "DirectAnswers": "workers.direct", "DirectToProcess": "workers.direct", "DirectJson": "workers.direct",
               "BodyDecoder": "workers.direct",
               "DIRECT_QUEUE_SUFFIX": "workers.direct", "DIRECT_QUEUE_WORD": "workers.direct",
               "DIRECT_EXECUTING": "workers.direct", "DIRECT_SHORT_RUNS": "workers.direct",
               "DIRECT_SHORT_RUN_US": "workers.direct", "DIRECT_RUN_SHIFT": "workers.direct",
               "direct_run_stamp": "workers.direct",
               # an LLM engine's clients in frontend workers (workers/engines.py) and the max_queue_size it keeps
               "engine_client_workers": "workers.engines", "queue_bound": "schedulers.passthrough"}


def __getattr__(name: str):
    module = _SCHEDULING.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    globals()[name] = value
    return value

__all__ = [
    # types and errors
    "Tensor", "InferenceRequest", "InferenceResponse", "RequestedOutput", "CancellationToken",
    "GenerationRequest", "GenerationDelta", "EngineInfo",
    "ServerError", "Status", "InvalidArgument", "NotFound", "Unavailable", "QueueFull", "Unsupported", "Cancelled",
    "DeadlineExceeded", "DeadlinePassed", "InternalError", "as_server_error", "error_of_status",
    # backends
    "Backend", "Model", "ModelInstance", "ModelContext", "InstanceContext", "TensorModelInstance",
    "ResponseSender",
    # handles a model is given
    "Infer", "InferStream", "ModelLookup", "ModelControl",
    # schedulers
    "Scheduler", "DirectScheduler", "DynamicBatcher", "PassThroughScheduler", "ModelRuntime", "InstanceSlot",
    "drop_cancelled",
    # --frontend-direct (general_backends/python/direct.py)
    "ModelStats", "DirectSubmit", "DirectAnswer", "DirectAnswers", "DirectToProcess", "DirectJson", "BodyDecoder",
    "DIRECT_QUEUE_SUFFIX",
    "DIRECT_QUEUE_WORD", "DIRECT_EXECUTING", "DIRECT_SHORT_RUNS", "DIRECT_SHORT_RUN_US",
    "DIRECT_RUN_SHIFT", "direct_run_stamp",
    # LLM engines: how many frontend workers take an engine client of their own, a model's max_queue_size
    "engine_client_workers", "queue_bound",
    # helpers
    "numpy_dtype", "datatype_of", "config_to_datatype", "datatype_to_config", "config_to_dict", "config_to_json",
    "model_paths", "conform_shape",
    # process links
    "wire", "arena",
]

"""The KServe v2 / Triton ``inference.GRPCInferenceService`` and the standard gRPC health service.

Everything goes through the serving interface (tideserve.serving); this module only translates messages and maps
ServerError statuses onto gRPC status codes: every handler is wrapped in :func:`abort_on_error`, which
ends a call that raised with the error's status (as MLServer's ``handle_mlserver_error``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from ..access import AccessPolicy
from ..classification import read_labels
from ..serving import ResponseStream, ServingInterface
from ..errors import InternalError, InvalidArgument, ServerError, Unsupported
from ..limits import TensorLimits
from ..types import InferenceRequest, InferenceResponse
from .access import access_interceptors
from .codec import (
    ModelInferRequest,
    StreamOptions,
    apply_classification,
    decode_request,
    decode_request_bytes,
    encode_response,
    encode_response_bytes,
    error_message,
    learn_skeleton,
    requested_classifications,
)
from .codec import varint as _varint

log = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"
MAX_MESSAGE_BYTES = 2**31 - 1

# gRPC channel arguments of the server: messages up to 2 GiB - 1 like Triton (the server narrows them with
# --grpc-max-receive-message-length / --grpc-max-send-message-length), a bind that fails
# loudly when the port is taken instead of silently sharing it (SO_REUSEPORT), and keepalive
# pings from clients tolerated down to every 5 s (tritonclient's KeepAliveOptions).
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
]

_FINAL = "triton_final_response"


def _final_parameter(value: bool) -> bytes:
    message = pb.ModelInferResponse()
    message.parameters[_FINAL].bool_param = value
    return message.SerializeToString()


# the bytes of ModelInferResponse's parameters entry {triton_final_response: value}, and the tag of
# ModelStreamInferResponse's infer_response (field 2, length-delimited)
_FINAL_TRUE, _FINAL_FALSE = _final_parameter(True), _final_parameter(False)
_INFER_RESPONSE_TAG = b"\x12"
# a request message that does not parse: INTERNAL with grpcio's own text for a request its deserializer
# cannot read (what this server answered while grpcio parsed the messages)
_UNPARSABLE = "Exception deserializing request!"
Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


async def abort(context, exc: BaseException):
    """End the call with ``exc``'s gRPC status and message (anything but a ServerError: INTERNAL, logged)."""
    code, message = error_message(exc)
    if code == "INTERNAL" and not isinstance(exc, ServerError):
        log.error("gRPC request failed", exc_info=exc)
    await context.abort(getattr(grpc.StatusCode, code), message)


def abort_on_error(handler: Handler) -> Handler:
    """A servicer method (unary, or streaming that writes with ``context.write``) whose exceptions end the
    call through :func:`abort`; a ``context.abort`` of its own and a cancelled call pass through as they are."""

    @functools.wraps(handler)
    async def handle(self, request, context):
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)

    return handle


_NOT_READ = object()


def traceparent_of(context) -> str | None:
    """The call's W3C ``traceparent`` metadata: read with the call's headers where the context has it (pyvoy's
    CallContext), else looked up in its invocation metadata (grpc.aio)."""
    found = getattr(context, "traceparent", _NOT_READ)
    if found is not _NOT_READ:
        return found
    for name, value in context.invocation_metadata() or ():
        if name == "traceparent":
            return value
    return None


def _header(context, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value
    return None


class _Classifier:
    """Resolves what the classification extension needs from a model's config."""

    def __init__(self, dataplane: ServingInterface) -> None:
        self.dataplane = dataplane
        # loaded model version -> output name -> its labels (read once, forgotten on unload)
        self._labels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def apply(self, request: InferenceRequest, response: InferenceResponse, counts: dict[str, int]) -> None:
        runtime = self.dataplane.model(request.model_name, response.model_version or request.model_version)
        config = runtime.config
        cache = self._labels.setdefault(runtime, {})

        def labels_of(name: str) -> list[str] | None:
            if name not in cache:
                label_file = next((o.label_filename for o in config.output if o.name == name), "")
                cache[name] = read_labels(runtime.ctx.model_path, label_file)
            return cache[name]

        apply_classification(response, counts, config.max_batch_size > 0, labels_of)


class _Failure:
    """Queued in place of a response: end the call with this error (triton_grpc_error mode)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()  # queued once the client half-closed and every request has finished


class _Stream:
    """State of one ModelStreamInfer call.

    Requests run concurrently, one task each; their responses go through ``outbox`` to the
    handler, the only coroutine that writes to the call (gRPC allows one write at a time, and a
    write must never be in flight when the call is aborted). As Triton's stream handler, the
    responses of requests to models that are not decoupled are written in the order the requests
    arrived (``in_order``); a decoupled model's responses are written as they come.
    """

    __slots__ = ("outbox", "streams", "tasks", "grpc_errors", "reading", "traceparent", "in_order", "decoupled")

    def __init__(self, grpc_errors: bool, traceparent: str | None = None) -> None:
        self.traceparent = traceparent  # the call's W3C traceparent metadata: every request's trace parent
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.streams: set[ResponseStream] = set()
        self.tasks: set[asyncio.Task] = set()
        self.grpc_errors = grpc_errors  # "triton_grpc_error: true": the first error ends the call
        self.reading = True
        self.in_order: collections.deque[list] = collections.deque()  # [messages, finished] per ordered request
        self.decoupled: dict[tuple[str, str], bool] = {}  # (model, version) -> decoupled, as first looked up

    def put(self, item) -> None:
        self.outbox.put_nowait(item)

    def ordered(self) -> list:
        """A place in the write order for the next request's responses."""
        entry = [[], False]
        self.in_order.append(entry)
        return entry

    def put_in_order(self, entry: list, item) -> None:
        entry[0].append(item)
        self._flush()

    def finish_in_order(self, entry: list) -> None:
        entry[1] = True
        self._flush()

    def _flush(self) -> None:
        while self.in_order:
            items, finished = self.in_order[0]
            for item in items:
                self.outbox.put_nowait(item)
            items.clear()
            if not finished:
                return
            self.in_order.popleft()

    def task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not self.reading and not self.tasks:
            self.put(_DONE)

    def reader_done(self) -> None:
        self.reading = False
        if not self.tasks:
            self.put(_DONE)

    async def close(self) -> None:
        """Cancel every request still in flight (the client went away or the call failed)."""
        for task in list(self.tasks):
            task.cancel()
        for stream in list(self.streams):
            await stream.aclose()
        self.streams.clear()


def _error_response(request_id: str, exc: BaseException, request: InferenceRequest | None = None,
                    response: InferenceResponse | None = None, final: bool | None = None):
    message = pb.ModelStreamInferResponse(error_message=error_message(exc)[1])
    infer = message.infer_response
    infer.id = request_id
    if request is not None:  # an error after the request was accepted, as Triton reports it
        infer.model_name = request.model_name
        infer.model_version = (response.model_version if response is not None and response.model_version
                               else request.model_version)
        infer.parameters[_FINAL].bool_param = True if final is None else final
    return message


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: ServingInterface, tensor_limits: TensorLimits | None = None) -> None:
        self.dataplane = dataplane
        self.tensor_limits = tensor_limits or TensorLimits()
        self.classifier = _Classifier(dataplane)
        self._log_settings = _initial_log_settings()

    # -- health and metadata ---------------------------------------------------------------
    @abort_on_error
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.dataplane.live())

    @abort_on_error
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.dataplane.ready())

    @abort_on_error
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.dataplane.model_ready(request.name, request.version))

    @abort_on_error
    async def ServerMetadata(self, request, context):
        meta = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                         extensions=meta["extensions"])

    @abort_on_error
    async def ModelMetadata(self, request, context):
        meta = self.dataplane.model_metadata(request.name, request.version)
        response = pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"],
                                            platform=meta["platform"])
        for tensor in meta["inputs"]:
            response.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        for tensor in meta["outputs"]:
            response.outputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        return response

    @abort_on_error
    async def ModelConfig(self, request, context):
        config = self.dataplane.model_config(request.name, request.version)
        response = pb.ModelConfigResponse()
        response.config.CopyFrom(config)
        return response

    @abort_on_error
    async def ModelStatistics(self, request, context):
        stats = await self.dataplane.statistics(request.name, request.version)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    # -- repository --------------------------------------------------------------------------
    @abort_on_error
    async def RepositoryIndex(self, request, context):
        rows = await self.dataplane.index(request.ready)
        response = pb.RepositoryIndexResponse()
        for row in rows:
            response.models.add(name=row["name"], version=row["version"], state=row["state"],
                                reason=row["reason"])
        return response

    @abort_on_error
    async def RepositoryModelLoad(self, request, context):
        config = None
        for key, param in request.parameters.items():
            if key == "config":
                if param.WhichOneof("parameter_choice") != "string_param":
                    raise InvalidArgument("invalid value type for load parameter 'config', "
                                          "expected string_param (the model config as JSON)")
                config = param.string_param
            elif key.startswith("file:"):
                raise Unsupported(f"failed to load '{request.model_name}': loading a model from override "
                                  f"files ('{key}') is not supported")
        await self.dataplane.load_model(request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    @abort_on_error
    async def RepositoryModelUnload(self, request, context):
        dependents = False
        if "unload_dependents" in request.parameters:
            param = request.parameters["unload_dependents"]
            if param.WhichOneof("parameter_choice") != "bool_param":
                raise InvalidArgument("invalid value type for unload parameter 'unload_dependents', "
                                      "expected bool_param")
            dependents = param.bool_param
        await self.dataplane.unload_model(request.model_name, unload_dependents=dependents)
        return pb.RepositoryModelUnloadResponse()

    # -- inference ---------------------------------------------------------------------------
    async def ModelInfer(self, data: bytes, context) -> bytes:
        """The unary call on raw bytes (registered without (de)serializers): the request's bytes in (parsed
        here), the response's bytes out (:func:`encode_response_bytes`, or the message serialized where it
        needs one). abort_on_error is written out: the hot path's calls resume through one coroutine fewer."""
        try:
            limits = self.tensor_limits
            infer_request = decode_request_bytes(data, limits)
            if infer_request is None:
                try:
                    request = ModelInferRequest.FromString(data)
                except DecodeError:
                    raise InternalError(_UNPARSABLE) from None
                options = StreamOptions()
                infer_request = decode_request(request, options, limits)
                learn_skeleton(data, request, infer_request, limits, options)
            traceparent = traceparent_of(context)
            if traceparent is not None:
                infer_request.trace_context = traceparent
            counts = requested_classifications(infer_request) if infer_request.outputs else None
            response = await self.dataplane.infer_unary(infer_request)
            if counts:
                self.classifier.apply(infer_request, response, counts)
            encoded = encode_response_bytes(response)
            return encoded if encoded is not None else encode_response(response).SerializeToString()
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort(context, exc)

    @abort_on_error
    async def ModelStreamInfer(self, request_iterator, context):
        """The streaming call on raw bytes (registered without (de)serializers): each request message parsed
        here, each response written as the bytes of a ModelStreamInferResponse."""
        state = _Stream((_header(context, "triton_grpc_error") or "").lower() == "true",
                        _header(context, "traceparent"))
        reader = asyncio.get_running_loop().create_task(self._read_stream(request_iterator, state))
        failure = None
        try:
            outbox = state.outbox
            while True:
                item = await outbox.get()
                if item is _DONE:
                    break
                if type(item) is _Failure:
                    failure = item.error
                    break
                await context.write(item if type(item) is bytes else item.SerializeToString())
        finally:
            reader.cancel()
            await state.close()
        if failure is not None:
            raise failure  # triton_grpc_error: the first error ends the call (abort_on_error)

    async def _read_stream(self, request_iterator, state: _Stream) -> None:
        try:
            limits = self.tensor_limits
            async for data in request_iterator:
                options = StreamOptions()
                request = decode_request_bytes(data, limits, options)
                if request is not None:  # a request of a known skeleton, read from its bytes
                    started = self._start_stream_request(None, state, request, options=options)
                else:
                    try:
                        message = ModelInferRequest.FromString(data)
                    except DecodeError:
                        raise InternalError(_UNPARSABLE) from None
                    started = self._start_stream_request(message, state, data=data)
                if not started:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call broke while reading
            state.put(_Failure(exc))
            return
        state.reader_done()  # the client half-closed: finish the requests in flight

    def _start_stream_request(self, message, state: _Stream, request: InferenceRequest | None = None,
                              data: bytes | None = None, options: StreamOptions | None = None) -> bool:
        """Start one request of the stream: ``message`` (parsed from ``data``) to decode, or ``request`` already
        decoded (decode_request_bytes, with its ``options``)."""
        if options is None:
            options = StreamOptions()
        try:
            if request is None:
                request = decode_request(message, options, self.tensor_limits)
                if data is not None:
                    learn_skeleton(data, message, request, self.tensor_limits, options)
            request.trace_context = state.traceparent
            counts = requested_classifications(request) if request.outputs else None
            stream = self.dataplane.infer(request)
        except Exception as exc:
            if not isinstance(exc, ServerError):
                log.exception("gRPC stream request failed")
            if state.grpc_errors:
                state.put(_Failure(exc))
                return False
            state.put(_error_response(message.id if message is not None else request.id, exc))
            return True
        state.streams.add(stream)
        entry = None if self._decoupled(request, state) else state.ordered()
        task = asyncio.get_running_loop().create_task(self._pump(stream, options, counts, state, entry))
        state.tasks.add(task)
        task.add_done_callback(state.task_done)
        return True

    def _decoupled(self, request: InferenceRequest, state: _Stream) -> bool:
        key = (request.model_name, request.model_version)
        decoupled = state.decoupled.get(key)
        if decoupled is None:
            try:
                config = self.dataplane.model_config(request.model_name, request.model_version)
                decoupled = config.model_transaction_policy.decoupled
            except ServerError:  # the request fails on its own; it needs no place in the order
                decoupled = True
            state.decoupled[key] = decoupled
        return decoupled

    async def _pump(self, stream: ResponseStream, options: StreamOptions, counts, state: _Stream,
                    entry: list | None = None) -> None:
        """Queue every response of one request of the stream as it comes (after the responses of the
        requests before it when ``entry`` holds its place in the write order)."""
        request = stream.request
        put = state.put if entry is None else functools.partial(state.put_in_order, entry)
        try:
            async for response in stream:
                if response.error is not None:
                    if state.grpc_errors:
                        put(_Failure(response.error))
                        return
                    put(_error_response(request.id, response.error, request, response, response.final))
                elif response.empty:
                    # A bare FINAL flag: Triton sends it only to clients that opted in.
                    if options.enable_empty_final:
                        message = pb.ModelStreamInferResponse()
                        infer = message.infer_response
                        infer.model_name = response.model_name or request.model_name
                        infer.model_version = response.model_version
                        infer.id = response.id or request.id
                        infer.parameters[_FINAL].bool_param = True
                        put(message)
                else:
                    try:
                        if counts:
                            self.classifier.apply(request, response, counts)
                        encoded = encode_response_bytes(response)
                        if encoded is None:
                            message = pb.ModelStreamInferResponse()
                            encode_response(response, message.infer_response)
                            message.infer_response.parameters[_FINAL].bool_param = response.final
                        else:  # infer_response (2): the response's bytes and its triton_final_response
                            encoded += _FINAL_TRUE if response.final else _FINAL_FALSE
                            message = _INFER_RESPONSE_TAG + _varint(len(encoded)) + encoded
                    except Exception as exc:  # an output the wire format cannot carry
                        if not isinstance(exc, ServerError):
                            log.exception("model '%s': failed to encode a response", request.model_name)
                        put(_Failure(exc) if state.grpc_errors
                            else _error_response(request.id, exc, request, response, True))
                        return  # the finally clause cancels the rest of the request
                    put(message)
        except ServerError as exc:  # refused before it was scheduled (a frontend worker learns it here)
            put(_Failure(exc) if state.grpc_errors else _error_response(request.id, exc))
        finally:
            if entry is not None:
                state.finish_in_order(entry)
            state.streams.discard(stream)
            await stream.aclose()

    # -- shared memory, trace, logging --------------------------------------------------------
    @abort_on_error
    async def SystemSharedMemoryStatus(self, request, context):
        response = pb.SystemSharedMemoryStatusResponse()
        for region in await self.dataplane.system_shared_memory_status(request.name):
            response.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    @abort_on_error
    async def SystemSharedMemoryRegister(self, request, context):
        await self.dataplane.register_system_shared_memory(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @abort_on_error
    async def SystemSharedMemoryUnregister(self, request, context):
        await self.dataplane.unregister_system_shared_memory(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @abort_on_error
    async def CudaSharedMemoryStatus(self, request, context):
        response = pb.CudaSharedMemoryStatusResponse()
        for region in await self.dataplane.cuda_shared_memory_status(request.name):
            response.regions[region["name"]].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    @abort_on_error
    async def CudaSharedMemoryRegister(self, request, context):
        await self.dataplane.register_cuda_shared_memory(request.name, request.raw_handle, request.device_id,
                                                   request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @abort_on_error
    async def CudaSharedMemoryUnregister(self, request, context):
        await self.dataplane.unregister_cuda_shared_memory(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    @abort_on_error
    async def TraceSetting(self, request, context):
        # an empty value clears the setting; trace_level is a list, every other setting one string
        updates = {key: (list(value.value) if key == "trace_level" or len(value.value) > 1 else value.value[0])
                   if value.value else None
                   for key, value in request.settings.items()}
        current = await self.dataplane.trace_setting(request.model_name, updates)
        response = pb.TraceSettingResponse()
        for key, value in current.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    @abort_on_error
    async def LogSettings(self, request, context):
        settings = self._log_settings
        for key, value in request.settings.items():
            if key not in settings:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown log setting '{key}'")
            which = value.WhichOneof("parameter_choice")
            if which is None:
                continue
            current = settings[key]
            new = getattr(value, which)
            if type(new) is not type(current):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"log setting '{key}' expects a {type(current).__name__} value")
            if key in ("log_file", "log_format") and new != current:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"changing '{key}' is not supported")
            settings[key] = new
        if len(request.settings):
            _apply_log_settings(settings)
        response = pb.LogSettingsResponse()
        for key, value in settings.items():
            field = ("bool_param" if isinstance(value, bool) else
                     "uint32_param" if isinstance(value, int) else "string_param")
            setattr(response.settings[key], field, value)
        return response


def _initial_log_settings() -> dict[str, Any]:
    level = logging.getLogger("server").getEffectiveLevel()
    return {"log_file": "", "log_info": level <= logging.INFO, "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR, "log_verbose_level": 1 if level <= logging.DEBUG else 0,
            "log_format": "default"}


def _apply_log_settings(settings: dict[str, Any]) -> None:
    if settings["log_verbose_level"] > 0:
        level = logging.DEBUG
    elif settings["log_info"]:
        level = logging.INFO
    elif settings["log_warning"]:
        level = logging.WARNING
    elif settings["log_error"]:
        level = logging.ERROR
    else:
        level = logging.CRITICAL + 1
    logging.getLogger("server").setLevel(level)


class HealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health``: SERVING while the server is ready."""

    SERVICES = ("", SERVICE_NAME)
    WATCH_INTERVAL_S = 0.5

    def __init__(self, dataplane: ServingInterface) -> None:
        self.dataplane = dataplane

    def _status(self, service: str):
        if service not in self.SERVICES:
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        return (health_pb2.HealthCheckResponse.SERVING if self.dataplane.ready()
                else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Check(self, request, context):
        if request.service not in self.SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=self._status(request.service))

    async def Watch(self, request, context):
        last = None
        while True:
            status = self._status(request.service)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await asyncio.sleep(self.WATCH_INTERVAL_S)


class _HandlerCapture:
    """Stands in for the server while generated code adds a servicer: keeps its method handlers."""

    def __init__(self) -> None:
        self.handlers: tuple = ()
        self.methods: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.handlers += tuple(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.methods[service] = dict(handlers)


def _add_unregistered(add_to_server, servicer, server: grpc.aio.Server,
                      replace: dict[str, grpc.RpcMethodHandler] | None = None) -> None:
    """Add ``servicer`` with its generic handler only, none of its methods registered with the server.

    grpc.aio keeps one pending "request call" task per registered method plus one for all others, and on
    every call waits on all of them (``asyncio.wait``: a done callback added to and removed from each): with
    the two services' 22 methods registered, that is 23 tasks walked per call. Unregistered, every call
    arrives through the one generic request call and is dispatched by method name (a dict lookup); calls,
    statuses and unknown methods (UNIMPLEMENTED) are answered as before. ``replace``: method name -> the handler
    that serves it instead of the generated one (ModelInfer on raw bytes)."""
    capture = _HandlerCapture()
    add_to_server(servicer, capture)
    if replace:  # methods of the (one) service served by other handlers
        (service, methods), = capture.methods.items()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {**methods, **replace}),))
        return
    server.add_generic_rpc_handlers(capture.handlers)


async def start_grpc_server(dataplane: ServingInterface, host: str, port: int, *,
                            options: list[tuple[str, Any]] | None = None,
                            access: AccessPolicy | None = None,
                            tensor_limits: TensorLimits | None = None) -> grpc.aio.Server:
    """Build, bind and start the gRPC server; ``await server.stop(grace)`` shuts it down.

    ``options`` are gRPC channel arguments; one named in SERVER_OPTIONS replaces that default.
    """
    channel_args = dict(SERVER_OPTIONS)
    channel_args.update(options or [])
    server = grpc.aio.server(options=list(channel_args.items()), interceptors=access_interceptors(access))
    servicer = InferenceServicer(dataplane, tensor_limits)
    # ModelInfer and ModelStreamInfer on raw bytes: no request or response message made for grpc's
    # (de)serializer hooks
    _add_unregistered(service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, servicer, server,
                      {"ModelInfer": grpc.unary_unary_rpc_method_handler(servicer.ModelInfer),
                       "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(servicer.ModelStreamInfer)})
    _add_unregistered(health_pb2_grpc.add_HealthServicer_to_server, HealthServicer(dataplane), server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"gRPC server failed to bind {address}: {exc}") from None
    if not bound:
        raise RuntimeError(f"gRPC server failed to bind {address}")
    await server.start()
    log.info("gRPC server listening on %s", address)
    return server

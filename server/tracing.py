"""Request tracing as Triton does it: ``--trace-config`` flags, ``/v2/trace/setting`` (and the gRPC
TraceSetting RPC), Triton's JSON trace file (mode ``triton``) or OpenTelemetry spans sent to an OTLP/HTTP
collector (mode ``opentelemetry``), with the W3C ``traceparent`` a client sends as the spans' parent.

Off by default. While every setting's level is OFF, :attr:`Tracer.active` is false and the DataPlane makes
nothing per request. A traced request carries a :class:`RequestTrace`: plain timestamps (CLOCK_MONOTONIC
ns) that the DataPlane, the runtime and the stream record; the spans are built from them when the request
ends, so no span object lives while a request runs. Spans, as Triton's OpenTelemetry mode makes them:

- ``InferRequest``: a client's request, from its arrival to its last response;
- ``<model name>``: the model's part (events REQUEST_START, QUEUE_START, REQUEST_END), child of
  ``InferRequest``, or of the ensemble's model span for an ensemble step;
- ``compute``: the model's execution of the request (COMPUTE_START, COMPUTE_END), none for an ensemble;
- ``first_response``: for decoupled models (LLM streaming), from REQUEST_START to the first response
  (the time to first token).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument

log = logging.getLogger(__name__)

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
_INT32_MAX = 2**31 - 1
# what /v2/trace/setting may update (trace_file and trace_mode are fixed at start, as in Triton)
_UPDATABLE = ("trace_level", "trace_rate", "trace_count", "log_frequency")
_OTEL_DEFAULTS = {"url": "http://localhost:4318/v1/traces", "bsp_max_queue_size": "2048",
                  "bsp_schedule_delay": "5000", "bsp_max_export_batch_size": "512"}


@dataclass
class TraceConfig:
    """What the ``--trace-config`` flags say."""

    level: list[str] = field(default_factory=lambda: ["OFF"])
    rate: int = 1000
    count: int = -1
    mode: str = "triton"
    file: str = ""
    log_frequency: int = 0
    otel: dict[str, str] = field(default_factory=lambda: dict(_OTEL_DEFAULTS))
    resource: dict[str, str] = field(default_factory=lambda: {"service.name": "tideserve"})


def _integer(name: str, text: Any, least: int) -> int:
    if type(text) is not str:
        raise InvalidArgument(f"trace setting '{name}' must be a string holding an integer, got {text!r}")
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgument(f"trace setting '{name}' must be an integer, got '{text}'") from None
    if value < least or value > _INT32_MAX:
        raise InvalidArgument(f"trace setting '{name}' is out of range: {value} (from {least} to {_INT32_MAX})")
    return value


def _levels(value: Any, mode: str) -> list[str]:
    values = [value] if type(value) is str else value
    if type(values) is not list or not values or any(type(v) is not str for v in values):
        raise InvalidArgument("trace setting 'trace_level' must be a string or a list of strings")
    levels = [v.upper() for v in values]
    for level in levels:
        if level not in LEVELS:
            raise InvalidArgument(f"unknown trace level '{level}': the levels are {', '.join(LEVELS)}")
    if "OFF" in levels and len(levels) > 1:
        raise InvalidArgument("trace level 'OFF' cannot be combined with other levels")
    if mode == "opentelemetry" and "TENSORS" in levels:
        raise InvalidArgument("trace level 'TENSORS' is not supported in opentelemetry mode")
    return list(dict.fromkeys(levels))


def parse_trace_config(values: list[str]) -> TraceConfig:
    """``--trace-config`` values: ``<setting>=<value>`` (global: level, rate, count, mode) or
    ``<mode>,<setting>=<value>`` (triton: file, log-frequency; opentelemetry: url, resource, bsp_*).
    ValueError names a bad one."""
    config = TraceConfig()
    levels: list[str] = []
    for text in values:
        mode, comma, setting = text.partition(",")
        if not comma:
            mode, setting = "", text
        name, eq, value = setting.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or not name:
            raise ValueError(f"--trace-config '{text}': expected [<mode>,]<setting>=<value>")
        try:
            if mode == "":
                if name == "level":
                    levels += _levels(value, "triton")
                elif name == "rate":
                    config.rate = _integer("rate", value, 0)
                elif name == "count":
                    config.count = _integer("count", value, -1)
                elif name == "mode":
                    if value not in MODES:
                        raise InvalidArgument(f"unknown trace mode '{value}': the modes are {', '.join(MODES)}")
                    config.mode = value
                else:
                    raise InvalidArgument(f"unknown global trace setting '{name}' (level, rate, count, mode)")
            elif mode == "triton":
                if name == "file":
                    config.file = value
                elif name == "log_frequency":
                    config.log_frequency = _integer("log-frequency", value, 0)
                else:
                    raise InvalidArgument(f"unknown triton trace setting '{name}' (file, log-frequency)")
            elif mode == "opentelemetry":
                if name == "resource":
                    key, eq2, attribute = value.partition("=")
                    if not eq2 or not key:
                        raise InvalidArgument("resource must be <key>=<value>")
                    config.resource[key] = attribute
                elif name == "url":
                    config.otel["url"] = value
                elif name in ("bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size"):
                    config.otel[name] = str(_integer(name, value, 1))
                else:
                    raise InvalidArgument(f"unknown opentelemetry trace setting '{name}' "
                                          "(url, resource, bsp_max_queue_size, bsp_schedule_delay, "
                                          "bsp_max_export_batch_size)")
            else:
                raise InvalidArgument(f"unknown trace mode '{mode}': the modes are {', '.join(MODES)}")
        except InvalidArgument as exc:
            raise ValueError(f"--trace-config '{text}': {exc.message}") from None
    if levels:
        if "OFF" in levels and len(levels) > 1:
            levels = [level for level in levels if level != "OFF"]
        if config.mode == "opentelemetry" and "TENSORS" in levels:
            raise ValueError("--trace-config level=TENSORS is not supported in opentelemetry mode")
        config.level = list(dict.fromkeys(levels))
    if config.mode == "opentelemetry" and importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None:
        raise ValueError("--trace-config mode=opentelemetry needs the OpenTelemetry SDK and OTLP exporter: "
                         "pip install 'tideserve[tracing]'")
    if int(config.otel["bsp_max_export_batch_size"]) > int(config.otel["bsp_max_queue_size"]):
        raise ValueError("--trace-config opentelemetry,bsp_max_export_batch_size must not exceed bsp_max_queue_size")
    return config


class _Setting:
    """One trace setting (the global one, or a model's, whose unset fields read the global's), with its
    sampling counter."""

    __slots__ = ("level", "rate", "count", "log_frequency", "seen")

    def __init__(self, level=None, rate=None, count=None, log_frequency=None) -> None:
        self.level: list[str] | None = level
        self.rate: int | None = rate
        self.count: int | None = count
        self.log_frequency: int | None = log_frequency
        self.seen = 0  # requests seen since the rate was set


class RequestTrace:
    """The timestamps of one traced request; the spans (or the trace file's entries) are made from them at
    its end. ``parent``: the ensemble's trace of an ensemble step."""

    __slots__ = ("tracer", "id", "model_name", "model_version", "request_id", "parent", "trace_id",
                 "remote_parent", "root_span", "model_span", "arrival_ns", "start_ns", "queue_ns", "compute",
                 "first_ns", "decoupled", "ensemble", "children", "tensors")

    def __init__(self, tracer: "Tracer", request, runtime, parent: "RequestTrace | None") -> None:
        self.tracer = tracer
        self.id = next(tracer.ids)
        self.model_name = runtime.name
        self.model_version = runtime.version
        self.request_id = request.id
        self.parent = parent
        self.arrival_ns = request.arrival_ns
        self.start_ns = time.monotonic_ns()
        self.queue_ns = 0  # QUEUE_START: set when the request ends (the runtime's queue_start_ns)
        # COMPUTE_START, COMPUTE_END (0 until execute returns: a decoupled model may answer before)
        self.compute: tuple[int, int] | None = None
        self.first_ns = 0
        self.decoupled = runtime.decoupled
        self.ensemble = runtime.config.platform == "ensemble"
        self.children = 0
        self.tensors: list[dict] | None = None
        self.remote_parent = None
        if parent is not None:
            self.trace_id, self.root_span = parent.trace_id, parent.model_span
        else:
            self.trace_id, self.root_span = tracer.new_trace_id(), _span_id()
        self.model_span = _span_id()

    def compute_done(self, end_ns: int) -> None:
        if self.compute is not None and not self.compute[1]:
            self.compute = (self.compute[0], end_ns)

    def first_response(self, now_ns: int) -> None:
        self.first_ns = now_ns


def _span_id() -> int:
    return random.getrandbits(64) or 1


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a W3C ``traceparent``, None when it is not a valid one (ignored,
    as the W3C recommendation says)."""
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16 \
            or len(parts[3]) != 2 or (parts[0] == "00" and len(parts) != 4):
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
        int(parts[0], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, flags


class Tracer:
    """The server's trace settings and its exporter (one per core process)."""

    def __init__(self, config: TraceConfig | None = None) -> None:
        self.config = config or TraceConfig()
        c = self.config
        self.defaults = _Setting(list(c.level), c.rate, c.count, c.log_frequency)
        self.glob = _Setting(list(c.level), c.rate, c.count, c.log_frequency)
        self.models: dict[str, _Setting] = {}
        self.ids = itertools.count(1)
        self.active = False
        self._clock_offset = time.time_ns() - time.monotonic_ns()  # monotonic -> wall clock (OTel times)
        self._entries: list[dict] = []  # triton mode: the trace file's entries not yet written
        self._collected = 0
        self._file_index = 0
        self._flush_when_done = False  # triton mode: the count ran out, write the file at the next trace's end
        self._processor = None
        self._otel = None
        self._update_active()

    # -- settings ---------------------------------------------------------------------------------------
    def _update_active(self) -> None:
        settings = [self.glob, *self.models.values()]
        self.active = any(self._value(s, "level") != ["OFF"] for s in settings)

    def _value(self, setting: _Setting, name: str):
        value = getattr(setting, name)
        return getattr(self.glob, name) if value is None else value

    def settings(self, model: str = "") -> dict[str, Any]:
        """The settings as ``/v2/trace/setting`` answers them: strings, a list for ``trace_level``."""
        setting = self.models.get(model, self.glob) if model else self.glob
        out: dict[str, Any] = {"trace_level": list(self._value(setting, "level")),
                               "trace_rate": str(self._value(setting, "rate")),
                               "trace_count": str(self._value(setting, "count")),
                               "trace_mode": self.config.mode}
        if self.config.mode == "triton":
            out["trace_file"] = self.config.file
            out["log_frequency"] = str(self._value(setting, "log_frequency"))
        else:
            out.update(self.config.otel)
        return out

    def update(self, model: str, updates: dict[str, Any]) -> dict[str, Any]:
        """Apply ``updates`` (a value, or None to clear it: a model's reads the global one again, the
        global one goes back to its start-up value) to the global setting or ``model``'s; the settings now.
        InvalidArgument for a bad one, and then nothing changes."""
        mode = self.config.mode
        parsed: dict[str, Any] = {}
        for key, value in updates.items():
            if key == "trace_file":
                raise InvalidArgument("trace file location can not be updated through network protocol")
            if key == "trace_mode":
                raise InvalidArgument("trace mode can not be updated through network protocol")
            if key in self.config.otel or key == "resource":
                raise InvalidArgument(f"opentelemetry trace setting '{key}' can not be updated through network "
                                      "protocol")
            if key not in _UPDATABLE:
                raise InvalidArgument(f"unknown trace setting '{key}': the settings are {', '.join(_UPDATABLE)}")
            if key == "log_frequency" and mode == "opentelemetry":
                raise InvalidArgument("trace setting 'log_frequency' does not apply in opentelemetry mode")
            if value is None:
                parsed[key] = None
            elif key == "trace_level":
                parsed[key] = _levels(value, mode)
            else:
                parsed[key] = _integer(key, value, -1 if key == "trace_count" else 0)
        setting = self.glob if not model else self.models.setdefault(model, _Setting())
        for key, value in parsed.items():
            name = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count",
                    "log_frequency": "log_frequency"}[key]
            if value is None and setting is self.glob:
                value = getattr(self.defaults, name)
            setattr(setting, name, value)
            if name == "rate":
                setting.seen = 0
        self._update_active()
        return self.settings(model)

    # -- tracing --------------------------------------------------------------------------------------------
    def begin(self, request, runtime) -> RequestTrace | None:
        """The trace of ``request`` (an InferenceRequest, or a typed generation's stream) if it is to be traced
        (sampled by rate and count, or an ensemble step of a traced request, or carrying a client's traceparent in
        opentelemetry mode), else None."""
        context = request.trace_context
        if isinstance(context, RequestTrace):
            context.children += 1
            return RequestTrace(self, request, runtime, context)
        setting = self.models.get(runtime.name, self.glob)
        if self._value(setting, "level") == ["OFF"]:
            return None
        remote = None
        if context and self.config.mode == "opentelemetry":
            remote = parse_traceparent(context)
        if remote is None and not self._sample(setting):
            return None
        trace = RequestTrace(self, request, runtime, None)
        if remote is not None:
            trace.trace_id, trace.remote_parent = remote[0], remote
        if "TENSORS" in self._value(setting, "level"):
            inputs = getattr(request, "inputs", None)  # (a typed generation's stream has none)
            trace.tensors = [_tensor_entry(trace.id, "TENSOR_QUEUE_INPUT", t) for t in (inputs or {}).values()]
        return trace

    def _sample(self, setting: _Setting) -> bool:
        owner = setting if setting.count is not None else self.glob
        if owner.count == 0:
            return False
        rate = self._value(setting, "rate")
        if rate == 0:
            return False
        setting.seen += 1
        if setting.seen % rate:
            return False
        if owner.count > 0:
            owner.count -= 1
            if owner.count == 0 and self.config.mode == "triton":
                self._flush_when_done = True
        return True

    def new_trace_id(self) -> int:
        return random.getrandbits(128) or 1

    def finish(self, trace: RequestTrace, request, end_ns: int, outputs=None) -> None:
        """The request of ``trace`` has ended (its last response handed out, or cancelled)."""
        trace.queue_ns = request.queue_start_ns
        if trace.compute is not None and not trace.compute[1]:  # answered before execute returned
            trace.compute = (trace.compute[0], end_ns)
        try:
            if self.config.mode == "opentelemetry":
                self._export_spans(trace, end_ns)
            else:
                self._record(trace, end_ns, outputs)
        except Exception:  # tracing must never fail a request
            log.exception("cannot record the trace of a request to model '%s'", trace.model_name)

    # -- triton mode: the JSON trace file -------------------------------------------------------------------
    def _record(self, trace: RequestTrace, end_ns: int, outputs) -> None:
        head = {"id": trace.id, "model_name": trace.model_name, "model_version": trace.model_version}
        if trace.request_id:
            head["request_id"] = trace.request_id
        if trace.parent is not None:
            head["parent_id"] = trace.parent.id
        stamps = [("REQUEST_START", trace.start_ns)]
        if trace.queue_ns:
            stamps.append(("QUEUE_START", trace.queue_ns))
        if trace.compute is not None and not trace.ensemble:
            stamps += [("COMPUTE_START", trace.compute[0]), ("COMPUTE_END", trace.compute[1])]
        if trace.decoupled and trace.first_ns:
            stamps.append(("FIRST_RESPONSE", trace.first_ns))
        stamps.append(("REQUEST_END", end_ns))
        self._entries.append(head)
        self._entries.append({"id": trace.id, "timestamps": [{"name": n, "ns": ns} for n, ns in stamps]})
        if trace.tensors is not None:  # level TENSORS
            self._entries.extend(trace.tensors)
            for tensor in outputs or ():
                self._entries.append(_tensor_entry(trace.id, "TENSOR_BACKEND_OUTPUT", tensor))
        if trace.parent is None:
            self._collected += 1
            frequency = self._value(self.models.get(trace.model_name, self.glob), "log_frequency")
            if (frequency and self._collected >= frequency) or self._flush_when_done:
                self._flush_when_done = False
                self.write(indexed=True)

    def write(self, indexed: bool = False) -> None:
        """Write the collected traces of triton mode to the trace file (``<file>.<n>`` when ``indexed``)."""
        if not self.config.file or not self._entries:
            return
        path = self.config.file
        if indexed:
            path = f"{path}.{self._file_index}"
            self._file_index += 1
        entries, self._entries, self._collected = self._entries, [], 0
        with open(path, "w", encoding="utf-8") as out:
            json.dump(entries, out)

    # -- opentelemetry mode -----------------------------------------------------------------------------------
    def _exporter(self):
        if self._processor is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope

            otel = self.config.otel
            self._processor = BatchSpanProcessor(
                OTLPSpanExporter(endpoint=otel["url"] if "://" in otel["url"] else "http://" + otel["url"]),
                max_queue_size=int(otel["bsp_max_queue_size"]),
                schedule_delay_millis=float(otel["bsp_schedule_delay"]),
                max_export_batch_size=int(otel["bsp_max_export_batch_size"]))
            self._otel = (Resource.create(self.config.resource), InstrumentationScope("tideserve"))
        return self._processor

    def _export_spans(self, trace: RequestTrace, end_ns: int) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, TraceFlags

        processor = self._exporter()
        resource, scope = self._otel
        wall = self._clock_offset
        sampled = TraceFlags(TraceFlags.SAMPLED)

        def context(span_id: int) -> SpanContext:
            return SpanContext(trace.trace_id, span_id, is_remote=False, trace_flags=sampled)

        def span(name: str, span_id: int, parent, start: int, end: int, events, attributes=None) -> None:
            processor.on_end(ReadableSpan(
                name, context(span_id), parent, resource=resource, attributes=attributes or {},
                events=[Event(n, timestamp=ns + wall) for n, ns in events], start_time=start + wall,
                end_time=end + wall, instrumentation_scope=scope))

        model_parent = context(trace.root_span)
        events = [("REQUEST_START", trace.start_ns)] + ([("QUEUE_START", trace.queue_ns)] if trace.queue_ns else [])
        events.append(("REQUEST_END", end_ns))
        attributes = {"triton.model_name": trace.model_name, "triton.model_version": trace.model_version,
                      "triton.trace_id": trace.id}
        if trace.request_id:
            attributes["triton.request_id"] = trace.request_id
        if trace.parent is not None:
            attributes["triton.trace_parent_id"] = trace.parent.id
        span(trace.model_name, trace.model_span, model_parent, trace.start_ns, end_ns, events, attributes)
        if trace.compute is not None and not trace.ensemble:
            start, end = trace.compute
            span("compute", _span_id(), context(trace.model_span), start, end,
                 [("COMPUTE_START", start), ("COMPUTE_END", end)])
        if trace.decoupled and trace.first_ns:
            span("first_response", _span_id(), context(trace.model_span), trace.start_ns, trace.first_ns,
                 [("FIRST_RESPONSE", trace.first_ns)])
        if trace.parent is None:  # the request's own span, parent of the model's
            remote = None
            if trace.remote_parent is not None:
                remote = SpanContext(trace.trace_id, trace.remote_parent[1], is_remote=True,
                                     trace_flags=TraceFlags(trace.remote_parent[2]))
            span("InferRequest", trace.root_span, remote, trace.arrival_ns, end_ns,
                 [("INFER_RESPONSE_COMPLETE", end_ns)])

    def shutdown(self) -> None:
        """Write what triton mode collected; send what opentelemetry mode has not sent yet."""
        try:
            self.write()
            if self._processor is not None:
                self._processor.shutdown()
        except Exception:
            log.exception("cannot write the collected traces")


def _tensor_entry(trace_id: int, activity: str, tensor) -> dict:
    data = tensor.data
    if data is None:
        text = ""
    else:
        flat = data.reshape(-1)
        text = ",".join(x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in flat.tolist())
    return {"id": trace_id, "activity": activity,
            "tensor": {"name": tensor.name, "data": text, "shape": ",".join(str(d) for d in tensor.shape),
                       "dtype": tensor.datatype}}

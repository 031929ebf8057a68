"""The model configuration of a vLLM model: auto-completed tensors and the engine arguments.

Tensors follow Triton's vLLM backend (``text_input`` in, ``text_output`` out, optional ``stream``,
``sampling_parameters``, ``exclude_input_in_output`` and ``return_*`` flags) plus a token interface
(``input_ids`` in, ``output_ids`` out) for tokenizer ensembles. Engine arguments come from
``<version>/model.json`` (the keys of vLLM's ``AsyncEngineArgs``, as in Triton's backend), and a config
``parameters`` entry named like an engine argument overrides it. Two parameters of Triton's backend,
``ENABLE_VLLM_HEALTH_CHECK`` and ``REPORT_CUSTOM_METRICS``, are the backend's own switches
(:class:`BackendOptions`).

Nothing here imports vLLM at module level: the base install stays light.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from tideserve.backend_api import InvalidArgument, ModelContext, Unavailable, model_paths

log = logging.getLogger(__name__)

ENGINE_ARGS_FILE = "model.json"

# (name, config data type, dims) of the inputs; all optional, but one of text_input / input_ids is required.
INPUTS = [
    ("text_input", mc.TYPE_STRING, [1]),
    ("input_ids", mc.TYPE_INT32, [-1]),
    ("stream", mc.TYPE_BOOL, [1]),
    ("sampling_parameters", mc.TYPE_STRING, [1]),
    ("exclude_input_in_output", mc.TYPE_BOOL, [1]),
    ("return_finish_reason", mc.TYPE_BOOL, [1]),
    ("return_cumulative_logprob", mc.TYPE_BOOL, [1]),
    ("return_logprobs", mc.TYPE_BOOL, [1]),
    ("return_num_input_tokens", mc.TYPE_BOOL, [1]),
    ("return_num_output_tokens", mc.TYPE_BOOL, [1]),
    ("return_prompt_logprobs", mc.TYPE_BOOL, [1]),
]
OUTPUTS = [
    ("text_output", mc.TYPE_STRING, [-1]),
    ("output_ids", mc.TYPE_INT32, [-1]),
    ("finish_reason", mc.TYPE_STRING, [-1]),
    ("cumulative_logprob", mc.TYPE_FP32, [-1]),
    ("logprobs", mc.TYPE_STRING, [-1]),
    ("num_input_tokens", mc.TYPE_UINT32, [1]),
    ("num_output_tokens", mc.TYPE_UINT32, [-1]),
    ("prompt_logprobs", mc.TYPE_STRING, [1]),
]
# Engine arguments whose relative paths resolve against the version directory.
PATH_ARGS = ("model", "tokenizer")
# The config parameters of Triton's vLLM backend that this backend reads (see BackendOptions).
HEALTH_CHECK = "ENABLE_VLLM_HEALTH_CHECK"
REPORT_METRICS = "REPORT_CUSTOM_METRICS"
# tideserve's own: how long a request may wait for its first token before it is refused (milliseconds, 0: no limit)
MAX_QUEUE_DELAY = "max_queue_delay_ms"
# tideserve's own: the nice value the engine's processes run at (0-19; 0: the server's own)
ENGINE_NICE = "engine_nice"
KV_EVENTS = "kv_events_config"  # vLLM's engine argument: the KV-cache event publisher
KV_EVENTS_DEFAULT_ENDPOINT = "tcp://*:5557"  # vLLM's default


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """The backend's switches, from ``config.pbtxt`` ``parameters`` (string values ``"true"`` / ``"false"``)."""

    health_check: bool = False
    """``ENABLE_VLLM_HEALTH_CHECK``: ask the engine (vLLM's ``check_health``) before each batch; an unhealthy
    engine answers the batch UNAVAILABLE and takes the model version out of service. Off by default, as in
    Triton."""

    report_metrics: bool = True
    """``REPORT_CUSTOM_METRICS``: export vLLM's own ``vllm:*`` families. On by default (routers and
    autoscalers read them); Triton's default is off. An explicit ``"false"`` turns them off."""

    max_queue_delay_ms: int = 0
    """``max_queue_delay_ms``: a request that has not started generating (no token yet) this long after it
    arrived is refused (503 + ``Retry-After``, gRPC UNAVAILABLE) and aborted in the engine; a request's own
    deadline (Triton's ``timeout`` parameter, ``x-request-timeout-ms`` on ``/v1``) applies when sooner. 0: none."""

    engine_nice: int = 0
    """``engine_nice``: the nice value (1-19) the engine's processes (vLLM's engine core and its workers, every
    thread) run at, set once the engine has started; 0 (the default) leaves them at the server's. On a host whose
    cores the engine keeps busy, the server's event loop then gets a core as soon as it wakes (a request's bytes,
    a deadline's timer) instead of waiting for the engine's time slice: the way in and the deadline refusals come
    sooner, at the price of the engine's steps when the frontend is busy. Raising a nice value needs no
    privilege; lowering it below the server's is not offered."""


def backend_options(config: mc.ModelConfig) -> BackendOptions:
    """The switches the config sets; a value other than true / false (any case) or 1 / 0 is refused."""
    defaults = BackendOptions()
    return BackendOptions(health_check=_flag(config, HEALTH_CHECK, defaults.health_check),
                          report_metrics=_flag(config, REPORT_METRICS, defaults.report_metrics),
                          max_queue_delay_ms=_milliseconds(config, MAX_QUEUE_DELAY),
                          engine_nice=_nice(config, ENGINE_NICE))


def exports_engine_families(options: BackendOptions, kwargs: dict) -> bool:
    """Whether the scrape shows the engine's ``vllm:*`` families: ``REPORT_CUSTOM_METRICS`` on and ``model.json``
    not setting ``disable_log_stats``. (The backend's own stat loggers make vLLM gather statistics even with
    ``disable_log_stats``, so the engine argument alone would not turn the families off.)"""
    return options.report_metrics and not kwargs.get("disable_log_stats", False)


def _milliseconds(config: mc.ModelConfig, key: str) -> int:
    if key not in config.parameters or not config.parameters[key].string_value.strip():
        return 0
    text = config.parameters[key].string_value.strip()
    if not text.isdigit():
        raise InvalidArgument(f"model '{config.name}': config parameter '{key}' must be an integer >= 0 "
                              f"(milliseconds; 0: no limit), got '{text}'")
    return int(text)


def _nice(config: mc.ModelConfig, key: str) -> int:
    if key not in config.parameters or not config.parameters[key].string_value.strip():
        return 0
    text = config.parameters[key].string_value.strip()
    if not text.isdigit() or int(text) > 19:
        raise InvalidArgument(f"model '{config.name}': config parameter '{key}' must be an integer from 0 to 19 "
                              f"(the engine processes' nice value; 0: the server's), got '{text}'")
    return int(text)


class KvEventEndpoints:
    """The ZMQ endpoints the KV-event publishers of this server's engines bind, so that two models (or two
    versions) never claim one port: the second is refused at load, naming the first, instead of failing inside
    the engine. One per server process (the ports are the process's)."""

    def __init__(self) -> None:
        self._owners: dict[tuple[str, str], str] = {}  # (scheme, port or path) -> "model version N"

    def claim(self, kwargs: dict[str, Any], owner: str) -> list[tuple[str, str]]:
        """Check and take the endpoints ``kwargs``' ``kv_events_config`` publishes on (none when events are off);
        returns the keys to :meth:`release`."""
        config = kwargs.get(KV_EVENTS)
        if config is None:
            return []
        if not isinstance(config, dict):
            raise InvalidArgument(f"{owner}: engine argument '{KV_EVENTS}' must be a JSON object, got "
                                  f"{type(config).__name__}")
        if not config.get("enable_kv_cache_events") or config.get("publisher", "zmq") != "zmq":
            return []
        endpoints = [("endpoint", config.get("endpoint", KV_EVENTS_DEFAULT_ENDPOINT))]
        if config.get("replay_endpoint"):
            endpoints.append(("replay_endpoint", config["replay_endpoint"]))
        keys: list[tuple[str, str]] = []
        for field, endpoint in endpoints:
            key = _endpoint_key(endpoint, owner, field)
            if key is None or (field == "endpoint" and not _binds(str(endpoint))):
                continue  # the publisher connects to a subscriber that binds (several engines may), or port 0
            holder = self._owners.get(key) or (owner if key in keys else None)
            if holder is not None:
                raise InvalidArgument(f"{owner}: {KV_EVENTS}.{field} '{endpoint}' is already used by {holder}'s KV "
                                      "event publisher; give each model its own endpoint (port)")
            keys.append(key)
        for key in keys:
            self._owners[key] = owner
        return keys

    def release(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            self._owners.pop(key, None)


def _binds(endpoint: str) -> bool:
    """vLLM's publisher binds a wildcard or IPC endpoint and connects to any other (its replay endpoint binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _endpoint_key(endpoint: Any, owner: str, field: str) -> tuple[str, str] | None:
    """What makes two bound ZMQ endpoints collide: a TCP port (whatever the host), an IPC path; None for TCP port
    0 (the system picks a free one)."""
    scheme, sep, rest = str(endpoint).partition("://")
    if not sep or not rest:
        raise InvalidArgument(f"{owner}: {KV_EVENTS}.{field} must be a ZMQ endpoint such as 'tcp://*:5557', "
                              f"got '{endpoint}'")
    if scheme == "tcp":
        port = rest.rsplit(":", 1)[-1]
        if not port.isdigit():
            raise InvalidArgument(f"{owner}: {KV_EVENTS}.{field} '{endpoint}' names no port")
        return (scheme, str(int(port))) if int(port) else None
    return scheme, rest


KV_EVENT_ENDPOINTS = KvEventEndpoints()


def _flag(config: mc.ModelConfig, key: str, default: bool) -> bool:
    if key not in config.parameters:
        return default
    text = config.parameters[key].string_value
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0"):
        raise InvalidArgument(f"model '{config.name}': config parameter '{key}' must be \"true\" or \"false\", "
                              f"got '{text}'")
    return lowered in ("true", "1")


def auto_complete(config: mc.ModelConfig) -> None:
    """Add the missing tensors, make the model decoupled, unbatched and one engine (KIND_MODEL)."""
    name = config.name
    if config.max_batch_size != 0:
        raise InvalidArgument(f"model '{name}': the vllm backend batches in the engine; max_batch_size must be 0, "
                              f"got {config.max_batch_size}")
    present = {t.name for t in config.input}
    for tensor_name, data_type, dims in INPUTS:
        if tensor_name not in present:
            config.input.add(name=tensor_name, data_type=data_type, dims=dims, optional=True)
    present = {t.name for t in config.output}
    for tensor_name, data_type, dims in OUTPUTS:
        if tensor_name not in present:
            config.output.add(name=tensor_name, data_type=data_type, dims=dims)
    config.model_transaction_policy.decoupled = True
    groups = config.instance_group
    if len(groups) != 1 or groups[0].count != 1:
        count = sum(g.count for g in groups)
        raise InvalidArgument(f"model '{name}': the vllm backend runs one engine per model version: "
                              f"instance_group must be one group of count 1, got {count} instances")
    if groups[0].kind in (mc.ModelInstanceGroup.KIND_CPU, mc.ModelInstanceGroup.KIND_AUTO):
        groups[0].kind = mc.ModelInstanceGroup.KIND_MODEL  # the engine places itself on its devices


def engine_kwargs(ctx: ModelContext, field_defaults: dict[str, Any]) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments: ``model.json``, then config parameters named like an argument.

    ``field_defaults`` maps each ``AsyncEngineArgs`` field to its default (it types the overrides).
    """
    path = ctx.version_path / ENGINE_ARGS_FILE
    if not path.is_file():
        raise Unavailable(f"'{ENGINE_ARGS_FILE}' containing the vLLM engine arguments must be provided in "
                          f"'{ctx.version_path}'")
    try:
        kwargs = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"failed to parse '{path}': {exc}") from None
    if not isinstance(kwargs, dict):
        raise InvalidArgument(f"'{path}' must hold a JSON object of engine arguments")
    for key, param in ctx.config.parameters.items():
        if key in field_defaults:
            kwargs[key] = _coerce(key, param.string_value, field_defaults[key])
    if "model" not in kwargs:
        raise InvalidArgument(f"'{path}' names no 'model' (a local directory or a model id)")
    for key in PATH_ARGS:
        if isinstance(kwargs.get(key), str):
            kwargs[key] = _resolve_path(kwargs[key], ctx, key)
    return kwargs


def field_defaults(args_class: type) -> dict[str, Any]:
    """Field name -> default value of a dataclass (``None`` where there is none)."""
    defaults = {}
    for field in dataclasses.fields(args_class):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            defaults[field.name] = None
        else:
            defaults[field.name] = None
    return defaults


def _resolve_path(value: str, ctx: ModelContext, key: str) -> str:
    """A relative path resolves against the version directory when it exists there or starts with ``.``;
    a local path must lie inside the model repository (or an allowed root); anything else must look like
    a model id (``org/name``), which the engine reads from its hub."""
    field = f"engine argument '{key}'"
    candidate = Path(value)
    if candidate.is_absolute():
        return str(ctx.check_file(candidate, field, value))
    local = ctx.version_path / candidate
    if local.exists() or value.startswith("."):
        return str(ctx.check_file(local, field, value))
    if model_paths.is_hub_id(value):
        return value
    raise InvalidArgument(f"model '{ctx.name}': {field} '{value}' is neither a path in the version directory "
                          f"'{ctx.version_path}' nor a model id of the form 'org/name'")


def _coerce(key: str, text: str, default: Any) -> Any:
    """A config parameter's string value as the type of the engine argument's default."""
    try:
        if isinstance(default, bool):
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError(f"expected true or false, got '{text}'")
            return lowered in ("true", "1")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError as exc:
        raise InvalidArgument(f"config parameter '{key}' (an engine argument): {exc}") from None
    if default is None:  # an optional argument: JSON objects, lists, booleans and numbers keep their type
        stripped = text.strip()
        if stripped[:1] in ("{", "[") or stripped in ("true", "false", "null"):
            try:
                return json.loads(stripped)
            except ValueError:
                pass
        for convert in (int, float):
            try:
                return convert(text)
            except ValueError:
                pass
    return text

"""The KServe v2 REST API as tideserve serves it: the open inference protocol, Triton's extensions
(repository, statistics, configuration, binary tensor data, classification) and the generate extension.

Field names are the protocol's (``inputs``, ``datatype``, ``shape``, ``data``, ``parameters``...); what
is described is what ``server/http`` answers, including its error statuses (one table for every
frontend: ``server/errors.py``).
"""

from __future__ import annotations

from typing import Any

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BYTES", "BF16"]

ERROR_STATUSES = {
    "400": "Invalid request: the message names the field or tensor at fault",
    "404": "Unknown model or version",
    "409": "Already exists",
    "415": "A Content-Encoding the server cannot read",
    "499": "Cancelled",
    "501": "Not supported by this server or model (e.g. several responses from a decoupled model on /infer)",
    "503": "Model not ready, request rejected by a queue policy, or the server is shutting down",
    "504": "The request's timeout expired",
}

MODEL_NAME = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
              "description": "Name of a model of the repository"}
MODEL_VERSION = {"name": "model_version", "in": "path", "required": True,
                 "schema": {"type": "string", "pattern": "^[0-9]+$"},
                 "description": "Version number; without it the server picks the highest ready version"}
CONTENT_ENCODING = {"name": "Content-Encoding", "in": "header", "required": False,
                    "schema": {"type": "string", "enum": ["gzip", "deflate", "identity", ""]},
                    "description": "Compression of the request body (another coding: 415)"}
ACCEPT_ENCODING = {"name": "Accept-Encoding", "in": "header", "required": False, "schema": {"type": "string"},
                   "description": "gzip or deflate: responses of 1 KiB or more come back compressed"}
HEADER_LENGTH = {"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                 "schema": {"type": "integer", "minimum": 0},
                 "description": "Binary tensor data extension: length of the JSON header at the start of the "
                                "body, the tensors' raw bytes follow it. 0: the whole body is the raw data of "
                                "the model's only input"}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def json_body(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def errors(*statuses: str) -> dict[str, dict]:
    return {status: json_body(ref("Error"), ERROR_STATUSES[status]) for status in statuses}


def sse_events(data: dict, description: str) -> dict:
    """A ``text/event-stream`` answer whose events' ``data`` is JSON described by ``data`` (before OpenAPI 3.2
    the schema of an event stream describes one event)."""
    return {"description": description, "content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data}}}}}}


SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}},
              "description": "Every /v2 error: the message says what was wrong, never with a stack trace"},
    "ServerMetadata": {
        "type": "object", "required": ["name", "version", "extensions"],
        "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                       "extensions": {"type": "array", "items": {"type": "string"}}}},
    "TensorMetadata": {
        "type": "object", "required": ["name", "datatype", "shape"],
        "properties": {"name": {"type": "string"}, "datatype": {"type": "string", "enum": DATATYPES},
                       "shape": {"type": "array", "items": {"type": "integer", "minimum": -1},
                                 "description": "-1: any size"}}},
    "ModelMetadata": {
        "type": "object", "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {"name": {"type": "string"}, "versions": {"type": "array", "items": {"type": "string"}},
                       "platform": {"type": "string"},
                       "inputs": {"type": "array", "items": ref("TensorMetadata")},
                       "outputs": {"type": "array", "items": ref("TensorMetadata")}}},
    "ModelConfig": {"type": "object", "description": "Triton's ModelConfig message as JSON (protobuf JSON mapping "
                                                     "with the field names of config.pbtxt)"},
    "Duration": {"type": "object", "required": ["count", "ns"],
                 "properties": {"count": {"type": "integer", "minimum": 0}, "ns": {"type": "integer", "minimum": 0}}},
    "ModelStatistics": {
        "type": "object", "required": ["name", "version", "inference_count", "execution_count", "inference_stats"],
        "properties": {
            "name": {"type": "string"}, "version": {"type": "string"},
            "last_inference": {"type": "integer", "description": "milliseconds since the epoch"},
            "inference_count": {"type": "integer", "minimum": 0},
            "execution_count": {"type": "integer", "minimum": 0},
            "inference_stats": {"type": "object", "additionalProperties": ref("Duration")},
            "batch_stats": {"type": "array", "items": {"type": "object"}},
            "memory_usage": {"type": "array", "items": {"type": "object"}}}},
    "ModelStatisticsResponse": {
        "type": "object", "required": ["model_stats"],
        "properties": {"model_stats": {"type": "array", "items": ref("ModelStatistics")}}},
    "Parameters": {
        "type": "object", "additionalProperties": {"type": ["string", "number", "integer", "boolean"]},
        "description": "Request parameters. Reserved: priority, timeout (microseconds), sequence_id, "
                       "sequence_start, sequence_end, binary_data_output; keys starting with triton_ are "
                       "refused. Others pass through to the model"},
    "TensorData": {
        "type": "array", "description": "The elements in row-major order, flat or nested as the shape",
        "items": {"anyOf": [ref("TensorData"), {"type": "number"}, {"type": "string"}, {"type": "boolean"}]}},
    "RequestInput": {
        "type": "object", "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"type": "string", "enum": DATATYPES},
            "parameters": {"type": "object", "properties": {
                "binary_data_size": {"type": "integer", "minimum": 0,
                                     "description": "the tensor's raw bytes follow the JSON header"}}},
            "data": ref("TensorData")},
        "description": "A tensor: 'data', or parameters.binary_data_size with the bytes after the JSON"},
    "RequestOutput": {
        "type": "object", "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "parameters": {"type": "object", "properties": {
                "binary_data": {"type": "boolean"},
                "classification": {"type": "integer", "minimum": 0,
                                   "description": "return the top N classes instead of the tensor"}}}}},
    "InferenceRequest": {
        "type": "object", "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": ref("Parameters"),
            "inputs": {"type": "array", "items": ref("RequestInput")},
            "outputs": {"type": "array", "items": ref("RequestOutput")}},
        "example": {"id": "42", "inputs": [
            {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
            {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}},
    "ResponseOutput": {
        "type": "object", "required": ["name", "shape", "datatype"],
        "properties": {"name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}},
                       "datatype": {"type": "string", "enum": DATATYPES},
                       "parameters": {"type": "object"}, "data": ref("TensorData")}},
    "InferenceResponse": {
        "type": "object", "required": ["model_name", "outputs"],
        "properties": {"model_name": {"type": "string"}, "model_version": {"type": "string"},
                       "id": {"type": "string"}, "parameters": {"type": "object"},
                       "outputs": {"type": "array", "items": ref("ResponseOutput")}}},
    "GenerateRequest": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "text_input": {"type": "string", "description": "the prompt, for a model with a text_input input"},
            "parameters": {
                "type": "object", "description": "the same rules as top-level fields",
                "additionalProperties": {"anyOf": [{"type": ["string", "number", "integer", "boolean"]},
                                                   {"type": "array"}]}}},
        "additionalProperties": {"anyOf": [{"type": ["string", "number", "integer", "boolean"]},
                                           {"type": "array"}]},
        "description": "One flat object. A field named like a model input becomes that tensor (a value or an "
                       "array, in the input's datatype); any other field is a request parameter (string, number "
                       "or boolean)",
        "example": {"text_input": "Once upon a time", "max_tokens": 8, "stream": False}},
    "GenerateResponse": {
        "type": "object", "required": ["model_name", "model_version"],
        "properties": {"id": {"type": "string"}, "model_name": {"type": "string"},
                       "model_version": {"type": "string"}, "text_output": {"type": "string"}},
        "additionalProperties": True,
        "description": "One field per output tensor (one element: the value, else an array) and per response "
                       "parameter"},
    "RepositoryIndexRequest": {"type": "object", "properties": {"ready": {"type": "boolean"}}},
    "RepositoryIndexEntry": {
        "type": "object", "required": ["name", "version", "state", "reason"],
        "properties": {"name": {"type": "string"}, "version": {"type": "string"}, "state": {"type": "string"},
                       "reason": {"type": "string"}}},
    "LoadRequest": {
        "type": "object",
        "properties": {"parameters": {"type": "object", "properties": {
            "config": {"type": "string", "description": "the model configuration as JSON, instead of "
                                                        "config.pbtxt"}}}}},
    "UnloadRequest": {
        "type": "object",
        "properties": {"parameters": {"type": "object", "properties": {"unload_dependents": {"type": "boolean"}}}}},
    "SystemSharedMemoryRegisterRequest": {
        "type": "object", "required": ["key", "byte_size"],
        "properties": {"key": {"type": "string", "description": "POSIX shared memory name (shm_open), e.g. /input"},
                       "offset": {"type": "integer", "minimum": 0}, "byte_size": {"type": "integer", "minimum": 1}}},
    "SystemSharedMemoryRegion": {
        "type": "object", "required": ["name", "key", "offset", "byte_size"],
        "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "offset": {"type": "integer"},
                       "byte_size": {"type": "integer"}}},
    "CudaSharedMemoryRegisterRequest": {
        "type": "object", "required": ["raw_handle", "device_id", "byte_size"],
        "properties": {"raw_handle": {"type": "object", "properties": {"b64": {"type": "string"}}},
                       "device_id": {"type": "integer", "minimum": 0}, "byte_size": {"type": "integer", "minimum": 1}}},
    "TraceSettings": {
        "type": "object", "additionalProperties": {"anyOf": [
            {"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "description": "trace_level (array: OFF, TIMESTAMPS, TENSORS), trace_rate, trace_count, log_frequency, "
                       "and (read only) trace_file, trace_mode and the opentelemetry settings; in a request, null "
                       "clears a setting",
        "example": {"trace_level": ["TIMESTAMPS"], "trace_rate": "100"}},
    "CudaSharedMemoryRegion": {
        "type": "object", "required": ["name", "device_id", "byte_size"],
        "properties": {"name": {"type": "string"}, "device_id": {"type": "integer"}, "byte_size": {"type": "integer"}}},
}

REGION_NAME = {"name": "region_name", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
               "description": "Name of a shared memory region"}


def _health(summary: str) -> dict:
    return {"get": {"summary": summary, "tags": ["health"], "responses": {
        "200": {"description": "Yes"}, "400": {"description": "No"}}}}


def _model_routes(suffix: str, summary: str, operation: dict, method: str = "get") -> dict[str, dict]:
    """The route without and with /versions/{model_version}."""
    extra = operation.get("parameters", [])
    plain = {**operation, "summary": summary, "parameters": [MODEL_NAME, *extra]}
    versioned = {**operation, "summary": f"{summary} (one version)", "parameters": [MODEL_NAME, MODEL_VERSION, *extra]}
    return {f"/v2/models/{{model_name}}{suffix}": {method: plain},
            f"/v2/models/{{model_name}}/versions/{{model_version}}{suffix}": {method: versioned}}


def _infer() -> dict:
    return {
        "tags": ["inference"],
        "parameters": [HEADER_LENGTH, CONTENT_ENCODING, ACCEPT_ENCODING],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref("InferenceRequest")},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"},
                                         "description": "JSON header then raw tensor bytes "
                                                        "(Inference-Header-Content-Length)"}}},
        "responses": {
            "200": {"description": "The model's response", "content": {
                "application/json": {"schema": ref("InferenceResponse")},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
            **errors("400", "404", "415", "499", "501", "503", "504")}}


def _generate(streaming: bool) -> dict:
    if streaming:
        ok = sse_events({"anyOf": [ref("GenerateResponse"), ref("Error")]},
                        "Server-sent events: one 'data: {GenerateResponse}' per model response; an error after "
                        "the first is a 'data: {\"error\": ...}' event")
    else:
        ok = json_body(ref("GenerateResponse"), "The model's one response")
    return {"tags": ["generate"], "parameters": [CONTENT_ENCODING],
            "requestBody": {"required": False, "content": {"application/json": {"schema": ref("GenerateRequest")}}},
            "responses": {"200": ok, **errors("400", "404", "415", "499", "501", "503", "504")}}


def paths() -> dict[str, dict]:
    out: dict[str, dict] = {
        "/v2/health/live": _health("Server live"),
        "/v2/health/ready": _health("Server ready (every model ready, with --strict-readiness)"),
        "/v2": {"get": {"summary": "Server metadata", "tags": ["metadata"],
                        "responses": {"200": json_body(ref("ServerMetadata"))}}},
        "/v2/models/stats": {"get": {"summary": "Statistics of every model", "tags": ["statistics"],
                                     "responses": {"200": json_body(ref("ModelStatisticsResponse"))}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (nv_inference_*, tideserve:*, vllm:*), as on the "
                                        "metrics port", "tags": ["statistics"],
                             "responses": {"200": {"description": "Prometheus text exposition",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}},
                                           "401": json_body(ref("Error"), "Invalid or missing API key "
                                                                          "(--api-key-scope all)")}}},
        "/load": {"get": {"summary": "The replica's load, as vLLM's /load with the engines' figures: server_load "
                                     "(requests in flight), num_requests_running, num_requests_waiting, "
                                     "kv_cache_usage_perc, and per model under 'models'", "tags": ["statistics"],
                          "parameters": [{"name": "model", "in": "query", "required": False,
                                          "schema": {"type": "string", "minLength": 1},
                                          "description": "one model's load"}],
                          "responses": {"200": json_body({"type": "object"}), **errors("400", "404")}}},
        "/reset_prefix_cache": {"post": {
            "summary": "vLLM's prefix-cache reset on the engine of one model or of every model with a prefix cache: "
                       "{\"success\": bool} (false while blocks are held)", "tags": ["model-repository"],
            "parameters": [{"name": "model", "in": "query", "required": False,
                            "schema": {"type": "string", "minLength": 1}},
                           {"name": "reset_running_requests", "in": "query", "required": False,
                            "schema": {"type": "boolean"}}],
            "responses": {"200": json_body({"type": "object", "properties": {"success": {"type": "boolean"}}}),
                          **errors("400", "404")}}},
    }
    out.update(_model_routes("", "Model metadata", {
        "tags": ["metadata"], "responses": {"200": json_body(ref("ModelMetadata")), **errors("400", "404", "503")}}))
    out.update(_model_routes("/ready", "Model ready", {
        "tags": ["health"], "responses": {"200": {"description": "Ready"}, **errors("400")}}))
    out.update(_model_routes("/config", "Model configuration", {
        "tags": ["metadata"], "responses": {"200": json_body(ref("ModelConfig")), **errors("400", "404", "503")}}))
    out.update(_model_routes("/stats", "Model statistics", {
        "tags": ["statistics"],
        "responses": {"200": json_body(ref("ModelStatisticsResponse")), **errors("400", "404", "503")}}))
    out.update(_model_routes("/infer", "Inference", _infer(), "post"))
    out.update(_model_routes("/generate", "Generate: one JSON answer", _generate(False), "post"))
    out.update(_model_routes("/generate_stream", "Generate: server-sent events", _generate(True), "post"))
    body = {"required": False, "content": {"application/json": {"schema": ref("RepositoryIndexRequest")}}}
    out["/v2/repository/index"] = {"post": {
        "summary": "Repository index", "tags": ["repository"], "requestBody": body, "parameters": [CONTENT_ENCODING],
        "responses": {"200": json_body({"type": "array", "items": ref("RepositoryIndexEntry")}),
                      **errors("400", "415")}}}
    for action, schema in (("load", "LoadRequest"), ("unload", "UnloadRequest")):
        out[f"/v2/repository/models/{{model_name}}/{action}"] = {"post": {
            "summary": f"Model {action} (--model-control-mode explicit; otherwise 501)", "tags": ["repository"],
            "parameters": [MODEL_NAME, CONTENT_ENCODING],
            "requestBody": {"required": False, "content": {"application/json": {"schema": ref(schema)}}},
            "responses": {"200": {"description": "Done"}, **errors("400", "404", "409", "415", "501", "503")}}}
    out.update(_shared_memory_routes("system", "System", "SystemSharedMemoryRegisterRequest",
                                     "SystemSharedMemoryRegion"))
    out.update(_shared_memory_routes("cuda", "CUDA", "CudaSharedMemoryRegisterRequest", "CudaSharedMemoryRegion"))
    for path, whose, params in (("/v2/trace/setting", "global", []),
                                ("/v2/models/{model_name}/trace/setting", "a model's", [MODEL_NAME])):
        settings = json_body(ref("TraceSettings"))
        out[path] = {
            "get": {"summary": f"Trace settings ({whose})", "tags": ["trace"], "parameters": params,
                    "responses": {"200": settings, **errors("400")}},
            "post": {"summary": f"Update trace settings ({whose})", "tags": ["trace"],
                     "parameters": [*params, CONTENT_ENCODING],
                     "requestBody": {"required": False, "content": {"application/json": {"schema": ref("TraceSettings")}}},
                     "responses": {"200": settings, **errors("400", "415")}}}
    return out


def _shared_memory_routes(kind: str, title: str, register: str, region: str) -> dict[str, dict]:
    """Triton's shared-memory extension: status and unregister of one region or all, register of one."""
    base, one = f"/v2/{kind}sharedmemory", f"/v2/{kind}sharedmemory/region/{{region_name}}"
    note = " (not supported on a machine without a GPU and CuPy: 400)" if kind == "cuda" else ""
    tags = ["shared-memory"]
    status = {"200": json_body({"type": "array", "items": ref(region)})}
    return {
        f"{base}/status": {"get": {"summary": f"{title} shared memory: every region", "tags": tags,
                                   "responses": status}},
        f"{one}/status": {"get": {"summary": f"{title} shared memory: one region", "tags": tags,
                                  "parameters": [REGION_NAME], "responses": {**status, **errors("404")}}},
        f"{one}/register": {"post": {
            "summary": f"Register a {title} shared memory region{note}", "tags": tags,
            "parameters": [REGION_NAME, CONTENT_ENCODING],
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(register)}}},
            "responses": {"200": {"description": "Registered"}, **errors("400", "409", "415")}}},
        f"{base}/unregister": {"post": {"summary": f"Unregister every {title} shared memory region", "tags": tags,
                                        "responses": {"200": {"description": "Done"}}}},
        f"{one}/unregister": {"post": {"summary": f"Unregister a {title} shared memory region", "tags": tags,
                                       "parameters": [REGION_NAME], "responses": {"200": {"description": "Done"}}}},
    }

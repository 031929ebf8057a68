"""gRPC over ASGI (server/grpc/asgi_transport.py, ``--grpc-frontend pyvoy``) without a server: the app driven with
ASGI events, over a stand-in for the serving interface."""

from __future__ import annotations

import gzip
import zlib

import grpc
import pytest
from grpc_health.v1 import health_pb2
from tideserve.access import AccessPolicy, parse_restrictions
from tideserve.app import ServerOptions
from tideserve.cli import build_parser, options_from_args
from tideserve.grpc import asgi_transport
from tideserve.grpc.asgi_transport import (
    CallContext,
    GrpcAsgiApp,
    RpcAbort,
    _Messages,
    _percent_encoded,
    _timeout_seconds,
    envoy_config,
    frame,
)
from tritonclient.grpc import service_pb2 as pb

SERVICE = "/inference.GRPCInferenceService"


class Serving:
    """What ServerLive / ServerReady / ServerMetadata and the health service ask of the serving interface."""

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def server_metadata(self) -> dict:
        return {"name": "tideserve", "version": "0", "extensions": ["x"]}


def _app(**options) -> GrpcAsgiApp:
    app = GrpcAsgiApp()
    opts = ServerOptions(model_repositories=[], **options)
    access = AccessPolicy(opts.http_restricted_apis, opts.grpc_restricted_protocols, opts.api_key, opts.api_key_scope)
    app.configure(Serving(), opts, access)
    return app


def _receiver(*chunks: bytes, disconnect: bool = False):
    events = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
              for i, chunk in enumerate(chunks)]
    if disconnect:
        events[-1]["more_body"] = True
        events.append({"type": "http.disconnect"})

    async def receive():
        return events.pop(0)
    return receive


async def _call(app: GrpcAsgiApp, path: str, *chunks: bytes, headers=()) -> tuple[list[bytes], dict]:
    """(the response messages, the trailers) of one call."""
    sent = []

    async def send(event):
        sent.append(event)

    scope = {"type": "http", "path": path, "headers": [(b"content-type", b"application/grpc"), *headers]}
    await app(scope, _receiver(*chunks), send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"application/grpc") in sent[0]["headers"]
    assert sent[-1]["type"] == "http.response.trailers"
    body = b"".join(e["body"] for e in sent if e["type"] == "http.response.body")
    messages = []
    while body:
        size = int.from_bytes(body[1:5], "big")
        messages.append(body[5:5 + size])
        body = body[5 + size:]
    return messages, dict(sent[-1]["headers"])


async def test_unary_call_answers_with_its_message_and_status_ok():
    messages, trailers = await _call(_app(), f"{SERVICE}/ServerMetadata", frame(b""))
    assert pb.ServerMetadataResponse.FromString(messages[0]).name == "tideserve"
    assert trailers == {b"grpc-status": b"0"}


async def test_a_message_split_across_chunks_is_put_together():
    data = frame(pb.ServerLiveRequest().SerializeToString())
    messages, trailers = await _call(_app(), f"{SERVICE}/ServerLive", data[:2], data[2:4], data[4:])
    assert pb.ServerLiveResponse.FromString(messages[0]).live and trailers[b"grpc-status"] == b"0"


async def test_unknown_method_is_unimplemented_and_health_check_serves():
    _, trailers = await _call(_app(), f"{SERVICE}/Nope", frame(b""))
    assert trailers[b"grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0]).encode()
    messages, trailers = await _call(_app(), "/grpc.health.v1.Health/Check",
                                     frame(health_pb2.HealthCheckRequest().SerializeToString()))
    assert health_pb2.HealthCheckResponse.FromString(messages[0]).status == health_pb2.HealthCheckResponse.SERVING
    _, trailers = await _call(_app(), "/grpc.health.v1.Health/Check",
                              frame(health_pb2.HealthCheckRequest(service="other").SerializeToString()))
    assert trailers[b"grpc-status"] == str(grpc.StatusCode.NOT_FOUND.value[0]).encode()
    assert trailers[b"grpc-message"] == b"unknown service 'other'"


async def test_restricted_protocol_needs_its_header():
    restricted = parse_restrictions(["health:probe=yes"], "--grpc-restricted-protocol", "triton-grpc-protocol-")
    app = _app(grpc_restricted_protocols=restricted)
    _, trailers = await _call(app, f"{SERVICE}/ServerLive", frame(b""))
    assert trailers[b"grpc-status"] == str(grpc.StatusCode.PERMISSION_DENIED.value[0]).encode()
    assert b"triton-grpc-protocol-probe" in trailers[b"grpc-message"]
    _, trailers = await _call(app, f"{SERVICE}/ServerLive", frame(b""),
                              headers=[(b"triton-grpc-protocol-probe", b"yes")])
    assert trailers[b"grpc-status"] == b"0"


async def test_unparsable_request_is_internal():
    _, trailers = await _call(_app(), f"{SERVICE}/ModelReady", frame(b"\xff\xff\xff"))
    assert trailers[b"grpc-status"] == str(grpc.StatusCode.INTERNAL.value[0]).encode()


async def test_messages_compressed_too_large_and_cut_short():
    payload = b"x" * 1000
    got = await _Messages(_receiver(b"\x01" + len(gz := gzip.compress(payload)).to_bytes(4, "big") + gz),
                          b"gzip", 10_000).next()
    assert got == payload
    deflated = zlib.compress(payload)
    messages = _Messages(_receiver(b"\x01" + len(deflated).to_bytes(4, "big") + deflated + frame(b"ab")),
                         b"deflate", 10_000)
    assert [m async for m in messages] == [payload, b"ab"]
    with pytest.raises(RpcAbort) as info:  # the length prefix alone says it is too large
        await _Messages(_receiver(frame(b"y" * 100)[:7]), None, 50).next()
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details == "Received message larger than max (100 vs. 50)"
    with pytest.raises(RpcAbort) as info:  # inflates past the limit
        await _Messages(_receiver(b"\x01" + len(deflated).to_bytes(4, "big") + deflated), b"deflate", 500).next()
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(RpcAbort) as info:
        await _Messages(_receiver(b"\x01" + len(deflated).to_bytes(4, "big") + deflated), b"snappy", 5000).next()
    assert info.value.code is grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(RpcAbort) as info:
        await _Messages(_receiver(frame(b"abc")[:6]), None, 50).next()
    assert info.value.code is grpc.StatusCode.INTERNAL
    with pytest.raises(asgi_transport._Disconnected):
        await _Messages(_receiver(b"\x00\x00", disconnect=True), None, 50).next()


async def test_model_infer_takes_the_traceparent_read_with_the_headers():
    """ModelInfer reads the traceparent the app picked from the call's headers (service.traceparent_of), the first
    as invocation_metadata lists it; grpc.aio's contexts, which have no such attribute, are searched."""
    from tideserve.grpc.service import traceparent_of

    seen = {}

    async def handler(data, context):
        seen["traceparent"] = traceparent_of(context)
        seen["metadata"] = context.invocation_metadata()
        return b""

    app = _app()
    app.methods[f"{SERVICE}/ModelInfer"] = (asgi_transport.RAW_UNARY, handler, None)
    _, trailers = await _call(app, f"{SERVICE}/ModelInfer", frame(b""),
                              headers=[(b"traceparent", b"00-first"), (b"traceparent", b"00-second")])
    assert trailers[b"grpc-status"] == b"0"
    assert seen["traceparent"] == "00-first"
    assert [value for key, value in seen["metadata"] if key == "traceparent"][0] == "00-first"
    await _call(app, f"{SERVICE}/ModelInfer", frame(b""))
    assert seen["traceparent"] is None

    class AioContext:
        __slots__ = ()

        def invocation_metadata(self):
            return (("user-agent", "x"), ("traceparent", "00-aio"))

    assert traceparent_of(AioContext()) == "00-aio"


def test_metadata_timeouts_and_messages_in_grpc_wording():
    context = CallContext([(b":path", b"/x"), (b"content-type", b"application/grpc"), (b"grpc-timeout", b"5S"),
                           (b"traceparent", b"00-ab"), (b"token-bin", b"AAEC")], None, 10, None)
    assert context.invocation_metadata() == (("traceparent", "00-ab"), ("token-bin", b"\x00\x01\x02"))
    assert context.header("traceparent") == b"00-ab" and context.header("nope") is None
    assert _timeout_seconds(b"5S") == 5 and _timeout_seconds(b"250m") == 0.25 and _timeout_seconds(b"2M") == 120
    assert _timeout_seconds(b"x") is None and _timeout_seconds(b"123456789S") is None
    assert _percent_encoded("unknown model: 'ä' 100%") == b"unknown model: '%C3%A4' 100%25"


def test_envoy_listener_does_not_share_its_port_and_has_no_admin_port():
    config = envoy_config("127.0.0.1", 8001)
    listener = config["static_resources"]["listeners"][0]
    assert listener["enable_reuse_port"] is False
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8001}
    assert "admin" not in config


def test_envoy_process_keeps_the_cores_python_path(monkeypatch):
    """The Envoy process's Python searches the core's PYTHONPATH first (pyvoy sets its own), so that it imports
    what the core imports (e.g. bench/addsub.py's tideserve:w1:pyvoy@TREE)."""
    pytest.importorskip("pyvoy")
    options = options_from_args(build_parser().parse_args(["--model-repository", "/tmp"]))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/first")
    _, env = asgi_transport.envoy_process(options, 3, 4, 5, 4096)
    assert env["PYTHONPATH"].startswith("/somewhere/first" + ":") and "site-packages" in env["PYTHONPATH"]
    monkeypatch.delenv("PYTHONPATH")
    _, env = asgi_transport.envoy_process(options, 3, 4, 5, 4096)
    assert not env["PYTHONPATH"].startswith("/somewhere")


def test_cli_flag_and_its_error_without_pyvoy(monkeypatch):
    args = ["--model-repository", "x"]
    assert options_from_args(build_parser().parse_args(args)).grpc_frontend == "grpcio"
    monkeypatch.setattr(asgi_transport, "available", lambda: True)
    assert options_from_args(build_parser().parse_args([*args, "--grpc-frontend", "pyvoy"])).grpc_frontend == "pyvoy"
    monkeypatch.setattr(asgi_transport, "available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'tideserve\[pyvoy\]'"):
        options_from_args(build_parser().parse_args([*args, "--grpc-frontend", "pyvoy"]))
    # no gRPC port at all: pyvoy is not needed
    assert options_from_args(build_parser().parse_args([*args, "--grpc-frontend", "pyvoy", "--allow-grpc",
                                                        "false"])).grpc_frontend == "pyvoy"

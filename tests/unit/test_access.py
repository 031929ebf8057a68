"""Access control without a server: restriction specs parsed as Triton spells them, the flags onto the options,
every gRPC method and HTTP route in an API group."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from tritonclient.grpc import service_pb2 as pb

from tideserve.access import (
    GROUPS,
    GRPC_METHOD_GROUPS,
    HTTP_ROUTE_GROUPS,
    AccessPolicy,
    ApiKeyScope,
    guard_routes,
    parse_restrictions,
)
from tideserve.app import ServerOptions
from tideserve.cli import build_parser, main, options_from_args


# -- the flags ------------------------------------------------------------------------------------
def test_restrictions_parse_as_triton_spells_them():
    parsed = parse_restrictions(["inference:Infer-Key=infer-secret", "model-repository,model-config:admin-key=a:b=c"],
                                "--http-restricted-api")
    assert sorted(parsed) == ["inference", "model-config", "model-repository"]
    assert (parsed["inference"].header, parsed["inference"].value) == ("infer-key", b"infer-secret")
    assert parsed["model-config"].value == b"a:b=c"  # the list ends at the first ':', the header at the next '='
    grpc_parsed = parse_restrictions(["health:probe=p"], "--grpc-restricted-protocol", "triton-grpc-protocol-")
    assert grpc_parsed["health"].header == "triton-grpc-protocol-probe"


@pytest.mark.parametrize("specs, message", [
    (["inference"], "the ':' after the API list is missing"),
    (["inference:key"], "the '=' after the header name is missing"),
    ([":key=value"], "must not be empty"),
    (["inference:=value"], "must not be empty"),
    (["inference:key="], "must not be empty"),
    (["infer:key=value"], "unknown restricted api 'infer'; the groups are health, metadata"),
    (["inference, health:key=value"], "unknown restricted api ' health'"),
    (["inference,inference:key=value"], "restricted api 'inference' can not be specified in multiple config groups"),
    (["inference:a=1", "health,inference:b=2"], "restricted api 'inference' can not be specified in multiple"),
    (["inference:bad key=value"], "'bad key' is not a valid header name"),
    (["inference:key= value"], "printable ASCII without leading or trailing spaces"),
])
def test_malformed_restrictions_are_refused(specs, message):
    with pytest.raises(ValueError, match=message):
        parse_restrictions(specs, "--http-restricted-api")


def test_secret_values_are_never_echoed():
    for spec in ("inference=s3cr3t", "nope:key=s3cr3t", "inference:key= s3cr3t"):
        with pytest.raises(ValueError) as info:
            parse_restrictions([spec], "--http-restricted-api")
        assert "s3cr3t" not in str(info.value)


def test_bad_flags_stop_the_command_at_start_up(capsys, monkeypatch):
    monkeypatch.delenv("TIDESERVE_API_KEY", raising=False)
    for argv in (["--http-restricted-api", "inference:k=v", "--http-restricted-api", "inference:x=y"],
                 ["--grpc-restricted-protocol", "everything:k=v"],
                 ["--api-key-scope", "all"]):
        with pytest.raises(SystemExit) as info:
            main(["--model-repository", "unused", *argv])
        assert info.value.code == 2
    err = capsys.readouterr().err
    # tritonserver's words (Triton qa L0_http / L0_grpc grep the server log for them)
    assert "restricted api 'inference' can not be specified in multiple config groups" in err
    assert "unknown restricted protocol 'everything'" in err
    assert "--api-key-scope all needs an API key" in err


def test_flags_map_onto_the_options():
    args = build_parser().parse_args([
        "--model-repository", "x", "--host", "0.0.0.0", "--api-key", "k", "--api-key-scope", "all",
        "--http-restricted-api=inference:infer-key=v", "--grpc-restricted-protocol", "health,metadata:probe=p"])
    options = options_from_args(args)
    assert options.metrics_address == "127.0.0.1"  # loopback by default, whatever --host says
    assert options.api_key_scope is ApiKeyScope.ALL
    assert list(options.http_restricted_apis) == ["inference"]
    assert options.grpc_restricted_protocols["metadata"].header == "triton-grpc-protocol-probe"
    defaults = options_from_args(build_parser().parse_args(["--model-repository", "x"]))
    assert defaults.api_key_scope is ApiKeyScope.OPENAI and not defaults.http_restricted_apis
    assert ServerOptions(model_repositories=[]).metrics_address == "127.0.0.1"


def test_an_empty_api_key_is_no_key():
    assert AccessPolicy(api_key="", api_key_scope=ApiKeyScope.ALL).http_guard("inference", openai=True) is None
    with pytest.raises(ValueError, match="needs an API key"):
        options_from_args(build_parser().parse_args(["--model-repository", "x", "--api-key", "",
                                                     "--api-key-scope", "all"]))


def test_every_grpc_method_and_the_groups_are_known():
    methods = {f"/{service.full_name}/{method.name}"
               for service in (pb.DESCRIPTOR.services_by_name["GRPCInferenceService"],
                               health_pb2.DESCRIPTOR.services_by_name["Health"])
               for method in service.methods}
    assert methods == set(GRPC_METHOD_GROUPS)
    assert set(GRPC_METHOD_GROUPS.values()) == set(GROUPS)
    assert HTTP_ROUTE_GROUPS["/v2/models/{model_name}/infer"] == "inference"


def test_a_route_of_no_group_stops_the_app_from_building():
    async def endpoint(_request):
        return Response()

    app = Starlette(routes=[Route("/v2", endpoint), Route("/v2/secret", endpoint)])
    with pytest.raises(RuntimeError, match="'/v2/secret' belongs to no API group"):
        guard_routes(app, AccessPolicy(), lambda refusal: b"")


def test_no_restriction_leaves_routes_unwrapped():
    async def endpoint(_request):
        return Response()

    app = Starlette(routes=[Route("/v2", endpoint)])
    original = app.router.routes[0].app
    guard_routes(app, AccessPolicy(api_key="k"), lambda refusal: b"")  # scope openai: /v2 stays open
    assert app.router.routes[0].app is original

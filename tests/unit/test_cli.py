"""The command line: flags map onto ServerOptions, nonsense stops the command before anything starts."""

from __future__ import annotations

import pytest
from limits_fixtures import (
    CONNECTIONS,
    DECOMPRESSED,
    GRPC_RECEIVE,
    GRPC_SEND,
    HEADER_COUNT,
    HEADER_SIZE,
    JSON_DEPTH,
    LIMIT_FLAGS,
    TENSOR_ELEMENTS,
    TENSOR_RANK,
    TIMEOUT_S,
)

from tideserve.cli import build_parser, options_from_args
from tideserve.openai.limits import OpenAILimits


def test_api_key_flag_and_environment(monkeypatch):
    monkeypatch.delenv("TIDESERVE_API_KEY", raising=False)
    assert options_from_args(build_parser().parse_args(["--model-repository", "x"])).api_key is None
    assert options_from_args(build_parser().parse_args(["--model-repository", "x", "--api-key", "k"])).api_key == "k"
    monkeypatch.setenv("TIDESERVE_API_KEY", "from-env")
    assert options_from_args(build_parser().parse_args(["--model-repository", "x"])).api_key == "from-env"


def test_openai_limit_flags():
    assert options_from_args(build_parser().parse_args(["--model-repository", "x"])).openai_limits == OpenAILimits()
    args = ["--model-repository", "x", "--openai-max-prompts", "3", "--openai-max-prompt-tokens", "100",
            "--openai-max-n", "2", "--openai-max-logprobs", "0", "--openai-chat-template-timeout-secs", "0.5"]
    assert options_from_args(build_parser().parse_args(args)).openai_limits == OpenAILimits(3, 100, 2, 0, 0.5)
    for bad in (["--openai-max-prompts", "0"], ["--openai-max-logprobs", "-1"],
                ["--openai-chat-template-timeout-secs", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model-repository", "x", *bad])


def test_limit_flags_map_onto_the_options_and_refuse_nonsense():
    options = options_from_args(build_parser().parse_args(["--model-repository", "/models", *LIMIT_FLAGS]))
    assert (options.http_max_header_size, options.http_max_header_count) == (HEADER_SIZE, HEADER_COUNT)
    assert (options.http_header_timeout_secs, options.http_body_timeout_secs) == (TIMEOUT_S, TIMEOUT_S)
    assert (options.http_max_connections, options.http_max_json_depth) == (CONNECTIONS, JSON_DEPTH)
    assert (options.max_tensor_rank, options.max_tensor_elements) == (TENSOR_RANK, TENSOR_ELEMENTS)
    assert options.http_max_decompressed_size == DECOMPRESSED
    assert (options.grpc_max_receive_message_length, options.grpc_max_send_message_length) == (GRPC_RECEIVE, GRPC_SEND)
    defaults = options_from_args(build_parser().parse_args(["--model-repository", "/models"]))
    assert defaults.http_max_decompressed_size is None  # follows --http-max-input-size
    unlimited = build_parser().parse_args(["--model-repository", "/models", "--http-max-connections", "0"])
    assert options_from_args(unlimited).http_max_connections is None
    for flag, value in (("--http-max-header-size", "0"), ("--http-header-timeout-secs", "-1"),
                        ("--max-tensor-rank", "x"), ("--http-max-connections", "-1")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model-repository", "/models", flag, value])


def test_openapi_flag_defaults_off_with_restricted_apis():
    def options(*flags):
        return options_from_args(build_parser().parse_args(["--model-repository", "x", *flags]))

    assert options().openapi is True
    assert options("--openapi", "false").openapi is False
    assert options("--http-restricted-api", "model-repository:admin=s").openapi is False
    assert options("--http-restricted-api", "model-repository:admin=s", "--openapi", "true").openapi is True


def test_backend_config_flags_parse_as_tritonserver_takes_them():
    import pytest

    from tideserve.cli import backend_settings

    assert backend_settings(["python,default-max-batch-size=8", "onnxruntime,a=1", "onnxruntime,b=x=y",
                             "default-max-batch-size=2"]) == {
        "python": {"default-max-batch-size": "8"}, "onnxruntime": {"a": "1", "b": "x=y"},
        "": {"default-max-batch-size": "2"}}
    for bad in ("python", "python,", "python,=3", "a,b,c=1"):
        with pytest.raises(ValueError, match="--backend-config option format is '<backend name>,<setting>=<value>'"):
            backend_settings([bad])


def test_frontend_direct_follows_the_worker_count_unless_named():
    def options(*flags):
        return options_from_args(build_parser().parse_args(["--model-repository", "x", *flags]))

    assert options("--frontend-workers", "1").frontend_direct is False
    assert options("--frontend-workers", "4").frontend_direct is True  # auto: on with more than one worker
    assert options("--frontend-workers", "4", "--frontend-direct", "auto").frontend_direct is True
    assert options("--frontend-workers", "4", "--frontend-direct", "off").frontend_direct is False
    assert options("--frontend-workers", "1", "--frontend-direct", "on").frontend_direct is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-repository", "x", "--frontend-direct", "sometimes"])


def test_frontend_workers_auto_leaves_the_layout_to_the_models_only_where_it_means_one():
    """``auto`` (the default) counts one worker per two cores; where that is one and ``--frontend-direct`` is not
    named, the server chooses the layout once its models are loaded (``frontend_auto``); a named count or a named
    ``--frontend-direct`` is kept as given."""
    from tideserve.workers.pool import worker_count

    def options(*flags):
        return options_from_args(build_parser().parse_args(["--model-repository", "x", *flags]))

    one = worker_count(None) == 1
    assert options().frontend_workers == worker_count(None)
    assert options().frontend_auto is one and options("--frontend-direct", "auto").frontend_auto is one
    assert options().frontend_direct is (not one)  # more than one worker: direct, as with a named count
    assert options("--frontend-workers", "1").frontend_auto is False
    assert options("--frontend-direct", "off").frontend_auto is False
    assert options("--frontend-direct", "on").frontend_auto is False

"""The command line: flags map onto ServerOptions, nonsense stops the command before anything starts."""

from __future__ import annotations

import pytest

from tideserve.openai.limits import OpenAILimits


def test_api_key_flag_and_environment(monkeypatch):
    from tideserve.cli import build_parser, options_from_args

    monkeypatch.delenv("TIDESERVE_API_KEY", raising=False)
    assert options_from_args(build_parser().parse_args(["--model-repository", "x"])).api_key is None
    assert options_from_args(build_parser().parse_args(["--model-repository", "x", "--api-key", "k"])).api_key == "k"
    monkeypatch.setenv("TIDESERVE_API_KEY", "from-env")
    assert options_from_args(build_parser().parse_args(["--model-repository", "x"])).api_key == "from-env"


def test_openai_limit_flags():
    from tideserve.cli import build_parser, options_from_args

    assert options_from_args(build_parser().parse_args(["--model-repository", "x"])).openai_limits == OpenAILimits()
    args = ["--model-repository", "x", "--openai-max-prompts", "3", "--openai-max-prompt-tokens", "100",
            "--openai-max-n", "2", "--openai-max-logprobs", "0", "--openai-chat-template-timeout-secs", "0.5"]
    assert options_from_args(build_parser().parse_args(args)).openai_limits == OpenAILimits(3, 100, 2, 0, 0.5)
    for bad in (["--openai-max-prompts", "0"], ["--openai-max-logprobs", "-1"],
                ["--openai-chat-template-timeout-secs", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model-repository", "x", *bad])

"""``--mcp-allow``: which MCP server URLs ``/v1/responses`` may reach (``McpSettings.allows``), no server."""

from __future__ import annotations

import pytest

from tideserve.cli import build_parser, options_from_args
from tideserve.openai.responses.mcp import McpSettings

SETTINGS = McpSettings(("http://127.0.0.1:5000/mcp", "https://tools.example.com/"))


@pytest.mark.parametrize("url", ["http://127.0.0.1:5000/mcp", "http://127.0.0.1:5000/mcp/", "http://127.0.0.1:5000/mcp?x=1",
                                 "https://tools.example.com/a/b", "https://tools.example.com/.well-known/x"])
def test_allowed(url):
    assert SETTINGS.allows(url)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:5000/mcpx",            # not at a boundary of the prefix
    "http://127.0.0.1:50001/mcp",            # another port
    "https://tools.example.com.evil.net/",   # another host
    "https://tools.example.com@evil.net/",   # user info: another host
    "http://127.0.0.1:5000/mcp/../admin",    # a dot segment steps out of the prefix
    "http://127.0.0.1:5000/mcp/%2e%2E/admin",
    "https://tools.example.com/a\\b", "https://tools.example.com/a b", "https://tools.example.com/a\nb",
    "ftp://127.0.0.1:5000/mcp", "HTTP://127.0.0.1:5000/mcp",
])
def test_refused(url):
    assert not SETTINGS.allows(url)


def test_none_by_default():
    assert not McpSettings().allows("http://127.0.0.1:5000/mcp")
    options = options_from_args(build_parser().parse_args(["--model-repository", "/models"]))
    assert options.mcp.allow == () and options.mcp.max_tool_rounds == 8


def test_flags():
    args = build_parser().parse_args(["--model-repository", "/models", "--mcp-allow", "http://a:1/mcp",
                                      "--mcp-allow", "https://b/", "--mcp-max-tool-rounds", "3"])
    options = options_from_args(args)
    assert options.mcp.allow == ("http://a:1/mcp", "https://b/") and options.mcp.max_tool_rounds == 3
    with pytest.raises(ValueError, match="--mcp-allow"):
        options_from_args(build_parser().parse_args(["--model-repository", "/m", "--mcp-allow", "file:///etc"]))

"""Streaming tool-call parsing: tideserve's hermes parser vs vLLM's own, on the same output, in one process.

One ``hermes`` tool call whose ``arguments`` hold a string of ``--sizes`` KiB, streamed in deltas of
``--delta`` characters (about one token each), is fed to tideserve's :class:`~tideserve.tool_parsers.ToolCallStream`
and to vLLM's ``Hermes2ProToolParser.extract_tool_calls_streaming`` (the class ``--tool-call-parser hermes``
uses, given a real tokenizer that holds the markers). Both must stream the same arguments; the table gives
the CPU seconds each spends on the whole output (the best of ``--repeat`` runs) and their ratio. vLLM re-reads
the whole output on every delta; tideserve re-reads only the unfinished call, and not past 64 KiB.

    python bench/tool_parsing.py [--sizes 4 16 64] [--delta 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import time


def _tideserve(text: str, delta: int) -> str:
    from tideserve.tool_parsers import ToolCallStream, tool_parser

    stream = ToolCallStream(tool_parser("hermes"))
    pieces = [stream.feed(text[i:i + delta])[1] for i in range(0, len(text), delta)] + [stream.finish()[1]]
    return "".join(e["function"].get("arguments", "") for entries in pieces for e in entries)


def _vllm(text: str, delta: int, tokenizer, request) -> str:
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    parser = Hermes2ProToolParser(tokenizer)
    out, previous = [], ""
    for i in range(0, len(text), delta):
        current = text[:i + delta]
        message = parser.extract_tool_calls_streaming(previous, current, current[len(previous):], [], [], [], request)
        previous = current
        for call in (message.tool_calls if message is not None else []):
            if call.function is not None and call.function.arguments:
                out.append(call.function.arguments)
    return "".join(out)


def _best(fn, repeat: int) -> tuple[float, str]:
    best, result = float("inf"), ""
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        best = min(best, time.process_time() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64], help="argument sizes in KiB")
    parser.add_argument("--delta", type=int, default=4, help="characters per streamed delta")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    vocab = {"<unk>": 0, "<tool_call>": 1, "</tool_call>": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    print(f"{'KiB':>5} {'deltas':>7} {'tideserve s':>12} {'vLLM s':>9} {'vLLM / tideserve':>17}")
    for size in args.sizes:
        arguments = json.dumps({"text": "x" * (size << 10)})
        text = '<tool_call>\n{"name": "write", "arguments": ' + arguments + "}\n</tool_call>"
        ours, ours_args = _best(lambda: _tideserve(text, args.delta), args.repeat)
        theirs, theirs_args = _best(lambda: _vllm(text, args.delta, tokenizer, request), args.repeat)
        assert json.loads(ours_args) == json.loads(theirs_args) == json.loads(arguments)
        print(f"{size:5d} {len(text) // args.delta:7d} {ours:12.3f} {theirs:9.3f} {theirs / ours:16.1f}x")


if __name__ == "__main__":
    main()

"""A model repository for the agent API tests (``/v1/responses``, ``/v1/messages``): toy Python models with
Triton's text interface, no engine.

* ``agent`` and ``thinker`` (``tests/openai_models/scripted.py``: answers the last message's content verbatim, token-sized
  pieces when streaming; ``LIST_TOOLS`` answers everything before the first ``|`` of the prompt) with a chat
  template that renders the whole conversation (roles, contents, tool calls, tool results, then the tools),
  so ``LIST_TOOLS`` shows the prompt the server built; ``hermes`` tool calls (both) and ``deepseek_r1``
  reasoning (``thinker``: all its output is reasoning until a ``</think>``) are parsed from what it writes. Its tokenizer (built here) has one token per UTF-8 byte, so
  usage counts are exact.
* ``slow`` (``tests/openai_models/words.py``): ``w0 w1 ...``, one word per 200 ms when streaming, stops
  when cancelled (background responses and cancel).
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOY = Path(__file__).resolve().parent / "openai_models"

AGENT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}>"
    "{% endfor %}{% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}{% endfor %}"
    "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}|{{ messages[-1].content }}")


def _parameter(key: str, value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'parameters {{ key: "{key}" value {{ string_value: "{escaped}" }} }}\n'


def byte_tokenizer(directory: Path) -> Path:
    """``directory/tokenizer.json``: a byte-level tokenizer, one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {char: i for i, char in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def agent_repository(root: Path) -> Path:
    repository = root / "models"
    config = (TOY / "scripted.pbtxt").read_text()
    config = "\n".join(line for line in config.splitlines() if "chat_template" not in line) + "\n"
    for name, reasoning in (("agent", ""), ("thinker", "deepseek_r1")):
        agent = repository / name
        (agent / "1").mkdir(parents=True)
        shutil.copy(TOY / "scripted.py", agent / "1" / "model.py")
        byte_tokenizer(agent / "tokenizer")
        (agent / "config.pbtxt").write_text(f'name: "{name}"\n' + config + _parameter("chat_template", AGENT_TEMPLATE)
                                            + _parameter("tool_call_parser", "hermes")
                                            + _parameter("reasoning_parser", reasoning)
                                            + _parameter("tokenizer_dir", "tokenizer"))
    slow = repository / "slow"
    (slow / "1").mkdir(parents=True)
    shutil.copy(TOY / "words.py", slow / "1" / "model.py")
    (slow / "config.pbtxt").write_text('name: "slow"\n' + (TOY / "words.pbtxt").read_text()
                                       + _parameter("chat_template", "{{ messages[-1].content }}")
                                       + _parameter("delay_ms", "200"))
    return repository

"""What the OpenAI frontend's unit tests (tests/unit) and its server tests (tests/e2e) share."""

from __future__ import annotations

import json

# a chat template of the toy text models, as the server tests configure it
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}assistant:{% endif %}"

# tool calls as the models of each parser write them (tests/unit/test_tool_parsers.py, tests/e2e/test_openai_tools.py)
WEATHER_ARGS = {"city": "Paris", "days": [1, 2], "note": 'a "quoted" } brace, ü'}
WEATHER_JSON = json.dumps(WEATHER_ARGS, ensure_ascii=False)

# parser -> (model output, expected content, expected calls)
SCRIPTS = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER_JSON + '}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.\n"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER_JSON + '}; '
                    '{"name": "get_time", "parameters": {}}', None),
    "mistral": ('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER_JSON + '}, '
                '{"name": "get_time", "arguments": {}}]', "Checking."),
    "mistral_v11": ("[TOOL_CALLS]get_weather[ARGS]" + WEATHER_JSON + "[TOOL_CALLS]get_time[ARGS]{}", None),
    "pythonic": ("[get_weather(city='Paris', days=[1, 2], note='a \"quoted\" } brace, ü'), get_time()]", None),
}
CALLS = [("get_weather", WEATHER_ARGS), ("get_time", {})]

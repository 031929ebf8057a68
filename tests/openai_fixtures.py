"""What the OpenAI frontend's unit tests (tests/unit) and its server tests (tests/e2e) share."""

from __future__ import annotations

# a chat template of the toy text models, as the server tests configure it
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}assistant:{% endif %}"

"""What the tokenizer backend's unit tests (tests/unit/test_detokenizer.py) and its server tests
(tests/e2e/test_tokenizer_models.py) share; the tiny Llama's tokenizer fixtures are in tests/conftest.py."""

from __future__ import annotations

# Texts whose streams must come out exactly: CJK, multi-codepoint emoji (skin tone, flags, ZWJ family),
# accents, and runs of spaces.
STREAM_TEXTS = [
    "日本語のテキスト、你好世界！한국어도 있어요.",
    "Thumbs 👍🏽 flags 🇯🇵🇫🇷 family 👨\u200d👩\u200d👧 party 🎉!",
    "café naïve résumé Ünïcödé — “quotes” … done",
    "  leading and   multiple    spaces\tand\nnew lines  ",
    "Mixed: 東京 👍🏽 São Paulo 🇧🇷 and   spaces 😀",
]

"""The tokenizer backend's incremental detokenizer and sequence table without a server, and the premise of the
streaming tests: the tiny Llama's byte-level BPE tokens hold partial UTF-8 characters."""

from __future__ import annotations

import json
import random
from functools import partial

from tokenizer_fixtures import STREAM_TEXTS

from tideserve.llm_backends.tokenizer.detokenizer import IncrementalDetokenizer, SequenceTable


def cuts_through_a_character(decode, ids) -> bool:
    """True if a single token of ``ids`` holds complete text and part of a multi-byte character."""
    return any(decode([t]).endswith("\ufffd") and decode([t]).rstrip("\ufffd") for t in ids)


# -- the texts of the streaming tests -------------------------------------------------------------
def test_the_texts_really_split_characters_across_tokens(tokenizer, decode):
    """The premise of the streaming tests: byte-level BPE tokens hold partial UTF-8, so decoding
    token by token garbles the text (and a single token holds ' 👍' plus half of the skin tone)."""
    for text in STREAM_TEXTS[:2] + STREAM_TEXTS[4:]:
        ids = tokenizer.encode(text)
        assert any(decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids))), text
        assert "\ufffd" in "".join(decode([t]) for t in ids)
    assert any(cuts_through_a_character(decode, tokenizer.encode(text)) for text in STREAM_TEXTS)


# -- the detokenizer on its own -----------------------------------------------------------------
def _sentencepiece_like_tokenizer():
    """A Llama-style tokenizer (metaspace, byte fallback, a decoder that strips the first space),
    trained offline: decoding a token on its own drops its leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from tideserve.bench.examples.tiny_llama import CORPUS

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train([str(CORPUS)], trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                                 show_progress=False, limit_alphabet=100))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def test_detokenizer_keeps_spaces_of_a_sentencepiece_style_decoder():
    tok = _sentencepiece_like_tokenizer()
    decode = partial(tok.decode, skip_special_tokens=True)
    for text in STREAM_TEXTS:
        ids = tok.encode(text).ids
        assert "".join(decode([t]) for t in ids) != decode(ids)  # naive decoding loses spaces / bytes
        for seed in range(5):
            rng = random.Random(seed)
            state, pieces, i, window = IncrementalDetokenizer(), [], 0, 0
            while i < len(ids):
                n = 1 if seed == 0 else rng.randint(1, 4)
                pieces.append(state.push(decode, ids[i:i + n]))
                window = max(window, state.window)
                i += n
            pieces.append(state.push(decode, [], final=True))
            assert "".join(pieces) == decode(ids)
            assert not any("\ufffd" in p for p in pieces)
            if seed == 0:  # token by token, only a short window is kept (a character has at most 4 bytes)
                assert window <= 8 < len(ids)


def test_sequence_table_bounds():
    now = [0.0]
    table = SequenceTable(max_sequences=2, idle_timeout_s=10, clock=lambda: now[0])
    first = table.start("a")
    table.start("b")
    assert table.get("a") is first  # "a" is now the most recently used
    table.start("c")
    assert "b" not in table and {"a", "c"} <= {k for k in ("a", "b", "c") if k in table}
    now[0] = 11.0
    assert table.get("a") is None and len(table) == 0 and table.evicted == 3
    table.start("d")
    table.end("d")
    assert len(table) == 0

"""Make a small Llama-architecture model with seeded random weights and an offline-trained tokenizer.

Nothing is downloaded: the byte-level BPE tokenizer is trained with ``tokenizers`` on
``bench/examples/data/corpus.txt`` and the weights come from a fixed seed, so the same command makes
the same model on any machine. Used by the tests, the benchmarks and the example repository.

    python -m tideserve.bench.examples.tiny_llama OUT_DIR [--size tiny|100m] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"

# A ChatML-style template so chat requests can be rendered with the model's own tokenizer files.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SIZES = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    # head_dim 32: the smallest head size vLLM's CPU attention supports
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=8192),
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _spec(size: str, seed: int) -> dict:
    return {"size": size, "seed": seed, "corpus_bytes": CORPUS.stat().st_size, "dims": SIZES[size]}


def is_made(out_dir: Path, size: str = "tiny", seed: int = 0) -> bool:
    """Whether ``out_dir`` holds the model :func:`make_model` would make (its marker file says so)."""
    marker = Path(out_dir) / "tideserve-model.json"
    try:
        return json.loads(marker.read_text()) == _spec(size, seed)
    except (OSError, ValueError):
        return False


def make_model(out_dir: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files into ``out_dir``."""
    out_dir = Path(out_dir)
    if is_made(out_dir, size, seed):
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    marker = out_dir / "tideserve-model.json"
    spec = _spec(size, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(SIZES[size]["vocab_size"])
    dims = dict(SIZES[size], vocab_size=len(tokenizer))
    config = LlamaConfig(**dims, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger random weights than the default init: outputs vary with the prompt
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    marker.write_text(json.dumps(spec))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_model(args.out_dir, args.size, args.seed))


if __name__ == "__main__":
    main()

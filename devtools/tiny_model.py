"""Builds a tiny random Llama checkpoint locally, since no model hub is reachable in dev or CI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The CPU attention kernel rejects head_dim 16; 128 hidden / 2 heads = head_dim 64 works.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}

# transformers >= 4.44 has no default chat template; without one every chat request fails.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. a queue decides who gets the gpu when. "
    "tenants send prompts, workers batch them, results come back. hello world, how are you? "
    "one two three four five six seven eight nine ten. llmqueue admits, routes and serves."
)


def _train_tokenizer(vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([_CORPUS] * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write the tiny model to `path` unless a complete one is already there; return the path."""
    marker = path / ".complete"
    if marker.exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(TINY_LLAMA_CONFIG["vocab_size"])
    config = LlamaConfig(
        **TINY_LLAMA_CONFIG,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(TINY_LLAMA_CONFIG))
    return path


if __name__ == "__main__":
    import sys

    print(
        build_tiny_model(Path(sys.argv[1] if len(sys.argv) > 1 else ".llmqueue/models/tiny-llama"))
    )

"""Generate a tiny random-weight Llama model in Hugging Face format, for the vLLM tests.

Run with the vLLM venv's Python (it has torch and transformers):
``.venv-vllm/bin/python tests/vllm_model.py OUT_DIR``. Nothing is downloaded: the BPE tokenizer is
trained here on generated words and the weights are a seeded random init, so the output is the same
on every machine. head_dim is 64 because vLLM's CPU attention kernels support no smaller head.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

#: A two-message chat template: enough for /v1/chat/completions to render system + user turns.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 512


def _corpus(seed: int = 0, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "zu", "an", "el", "or"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(lines)]


def make_tokenizer(out: Path) -> None:
    """Train a byte-level BPE tokenizer and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_model(out: Path) -> Path:
    """Write config, weights (safetensors) and tokenizer of a ~1M-parameter Llama to ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    print(make_model(Path(sys.argv[1])))

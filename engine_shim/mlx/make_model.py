"""Write a random-weight llama (or qwen2) model in mlx-lm format, with a BPE tokenizer trained on
built-in text and a ChatML chat template, so that tests and the demo run a real engine without
downloading anything. ``tiny`` steps in about a millisecond on a laptop CPU; ``small`` takes a few
milliseconds per decode step so that phases are visible in traces. ``--arch qwen2`` writes the same
shape as mlx-lm's qwen2, whose model supports both distributed placements mlx-lm offers: tensor
parallel (``Model.shard``) and a split of its layers between ranks (``PipelineMixin.pipeline``),
which llama supports only the first of (issue 46).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tokentrace.errors import ConfigError

#: Special tokens, in id order (ids 0..2 of the vocabulary).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: ChatML with an optional tools block in front of the messages. Every message renders to text
#: that only depends on that message, so rendering ``messages[:k]`` is a prefix of rendering
#: ``messages[:k+1]``: the engine derives segment boundaries from exactly that property.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    """Shape of a generated model."""

    hidden: int  #: hidden size
    layers: int  #: transformer blocks
    heads: int  #: attention heads
    kv_heads: int  #: key/value heads (grouped-query attention when fewer than ``heads``)
    ffn: int  #: MLP intermediate size
    vocab: int  #: target vocabulary size for the BPE trainer
    context: int  #: max_position_embeddings: longer prompts are rejected by the engine


#: Architectures make-model writes: mlx-lm's model module and the Hugging Face class name.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, context=2048),
    "small": ModelSize(hidden=256, layers=4, heads=4, kv_heads=2, ffn=704, vocab=1024, context=4096),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tokentrace make-model``."""
    parser.add_argument("dir", type=Path, help="directory to write the model into (created)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model shape (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama",
                        help="architecture (default: llama); qwen2's layers can also be split between the ranks "
                             "of a distributed engine (pipeline placement)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    parser.add_argument("--gguf", action="store_true",
                        help="also write the model as model.gguf, which llama.cpp's llama-server loads")


def run(args: argparse.Namespace) -> int:
    """Write the model and print where it went."""
    if args.gguf and args.arch != "llama":
        raise ConfigError(f"--gguf writes the llama architecture only, not --arch {args.arch}")
    out = write_model(args.dir, size=args.size, seed=args.seed, force=args.force, arch=args.arch)
    print(f"wrote {args.size} {args.arch} model to {out}")
    if args.gguf:
        from tokentrace.engine_shim.mlx.make_gguf import write_gguf

        print(f"wrote GGUF to {write_gguf(out)}")
    return 0


def write_model(directory: Path | str, size: str = "tiny", seed: int = 0, force: bool = False,
                arch: str = "llama") -> Path:
    """Write config, weights, tokenizer and chat template into ``directory``; deterministic in
    (``size``, ``seed``, ``arch``). Returns the directory."""
    if size not in SIZES:
        raise ConfigError(f"--size must be one of {sorted(SIZES)}, got {size!r}")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"--arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    out = Path(directory)
    if out.exists() and any(out.iterdir()) and not force:
        raise ConfigError(f"{out} exists and is not empty (use --force to overwrite)")
    out.mkdir(parents=True, exist_ok=True)
    shape = SIZES[size]
    vocab_size = _write_tokenizer(out, shape)
    config = _model_config(shape, vocab_size, arch)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_weights(out, config, seed)
    meta = {"generator": "tokentrace make-model", "size": size, "seed": seed, **asdict(shape)}
    if arch != "llama":  # a llama model's files stay byte for byte what they were
        meta["arch"] = arch
    (out / "tokentrace-model.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def _model_config(shape: ModelSize, vocab_size: int, arch: str = "llama") -> dict:
    return {
        "model_type": arch,
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "intermediate_size": shape.ffn,
        "vocab_size": vocab_size,
        "max_position_embeddings": shape.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        # float32 because the CPU backend is fastest and bit-stable in it; the engine reads the
        # dtype from here to compute KV bytes per token.
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")],
    }


def _write_tokenizer(out: Path, shape: ModelSize) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": shape.context,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return tokenizer.get_vocab_size()


def _write_weights(out: Path, config: dict, seed: int) -> None:
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    # Parameters are drawn in construction order from this key, so the weights depend on the
    # seed and the shape only.
    mx.random.seed(seed)
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    # The index a hub checkpoint has: mlx-lm's distributed loader reads it to find each rank's layers
    # (mlx_lm.utils.sharded_load), so stock `mlx_lm server --pipeline` under mlx.launch loads this model.
    index = {"metadata": {"total_size": sum(array.nbytes for array in weights.values())},
             "weight_map": {name: "model.safetensors" for name in sorted(weights)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


# --- built-in training text -----------------------------------------------------------------------
# The tokenizer only needs a plausible merge table over everyday English, chat markup and a little
# code; the weights are random, so what the model says is noise either way.

SENTENCES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A request waits in the queue until a batch slot frees up on the engine.",
    "Prefill computes the prompt; decode produces one token per step after that.",
    "When the prefix cache misses, the whole prompt has to be computed again.",
    "You are a helpful assistant. Answer briefly and cite your sources.",
    "Please summarise the following report in three sentences for a busy reader.",
    "What is the capital of France? The capital of France is Paris.",
    "How many tokens per second does the model produce on this machine?",
    "The operator restarted the cluster after the third node ran out of memory.",
    "Latency went up because a long prompt arrived while eight streams were decoding.",
    "Cold starts are slow: the weights must be read and the kernels warmed up first.",
    "She opened the window, listened to the rain, and wrote another chapter.",
    "In 1969 two astronauts walked on the Moon while millions watched on television.",
    "The recipe needs 200 grams of flour, 3 eggs, 50 ml of milk and a pinch of salt.",
    "Our meeting is on Tuesday at 10:30; bring the quarterly numbers and the slides.",
    "Mountains, rivers and forests cover most of the northern part of the country.",
    "Error 503: the service is unavailable, retry after a few seconds.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "SELECT request_id, ttft_ms FROM requests WHERE instance_id = 'a' ORDER BY ttft_ms DESC;",
    '{"role": "user", "content": "Hello there, how are you today?"}',
    "The tool returned a JSON object with the weather for Berlin: 18 degrees and cloudy.",
    "Thank you! Could you also translate that paragraph into German and Spanish?",
    "Machine learning models learn patterns from data rather than from explicit rules.",
    "The library closes at eight in the evening, but the reading room stays open later.",
    "Every morning the baker lights the oven at four and the first bread is ready by six.",
    "Network packets travel through routers, switches and cables to reach their destination.",
    "The committee approved the budget after a long discussion about priorities.",
    "Children played football in the park while their parents talked on the benches.",
    "A good test fails for the right reason and passes only when the code is correct.",
    "The cache stores key and value tensors so that a shared prefix is not computed twice.",
    "Scientists measured the temperature of the lake every hour for an entire year.",
    "Why was this request slow? Because it waited behind a long generation.",
    "Why did the cache miss? Because the system prompt changed at the very beginning.",
    "The train to Lyon leaves from platform nine at a quarter past seven.",
    "Music, painting and poetry were the three passions of her long and quiet life.",
    "Check the logs, then the metrics, then the traces; the traces tell you where time went.",
    "The garden was full of tomatoes, beans, roses and a very old apple tree.",
    "Numbers: zero one two three four five six seven eight nine ten eleven twelve.",
    "Questions, answers, summaries, translations and small programs are common requests.",
)

_CONNECTORS = ("and then", "because", "although", "so", "while", "after that")


def training_text(repeats: int = 3) -> Iterator[str]:
    """The sentences, then deterministic pairings of them, ``repeats`` times over.

    Pairings give the BPE trainer cross-sentence statistics; the order is fixed, so training on it
    yields the same merge table every time.
    """
    n = len(SENTENCES)
    for r in range(repeats):
        yield from SENTENCES
        for i, first in enumerate(SENTENCES):
            second = SENTENCES[(i * 7 + r + 3) % n]
            yield f"{first.rstrip('.')} {_CONNECTORS[(i + r) % len(_CONNECTORS)]} {second.lower()}"

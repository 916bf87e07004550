"""Write a model made by ``tokentrace make-model`` as one GGUF file that llama.cpp's ``llama-server``
loads, so that the gateway's adapters are tested against a real llama.cpp on the same tiny model.

llama.cpp's own ``convert_hf_to_gguf.py`` refuses make-model's tokenizer ("BPE pre-tokenizer was not
recognized": it identifies pre-tokenizers by hashing the token ids of a probe text against a list of
known models). The tokenizer needs no guessing: make-model trains a byte-level BPE whose
pre-tokenizer is GPT-2's (``tokenizers.pre_tokenizers.ByteLevel`` with its default regex), which
llama.cpp knows as the pre-type ``gpt-2``, so the file is written directly with the ``gguf``
package (llama.cpp's own GGUF library, on PyPI). ``tests/test_make_gguf.py`` checks that
llama-server's ``/tokenize`` and the Hugging Face tokenizer give the same ids.

Weights: the llama architecture's tensor names (``token_embd``, ``blk.N.attn_q``, ...); q and k
projections are permuted from the Hugging Face/MLX rotate-half RoPE layout into llama.cpp's
interleaved one (the permutation ``convert_hf_to_gguf.py`` applies to llama models); no
``output.weight``, so llama.cpp ties the output to the embeddings as the MLX model does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tokentrace.errors import ConfigError

#: File name of the GGUF written beside the MLX files.
GGUF_NAME = "model.gguf"

#: llama.cpp's pre-tokenizer name for GPT-2's regex (src/llama-vocab.cpp, ``tokenizer_pre == "gpt-2"``).
PRE_TOKENIZER = "gpt-2"

# Hugging Face/MLX parameter names -> GGUF tensor names for one transformer block.
_BLOCK_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(model_dir: Path | str, out: Path | str | None = None) -> Path:
    """Write the make-model model in ``model_dir`` as GGUF (``model_dir/model.gguf`` by default)."""
    import gguf

    model_dir = Path(model_dir)
    path = Path(out) if out is not None else model_dir / GGUF_NAME
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ConfigError(f"GGUF export needs a llama model, {model_dir} has {config.get('model_type')!r}")
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_hparams(writer, config, model_dir.name)
    _add_tokenizer(writer, model_dir, config)
    for name, array in _tensors(model_dir, config):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hparams(writer, config: dict, name: str) -> None:
    import gguf

    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def _add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    specials = {entry["content"]: entry["id"] for entry in spec.get("added_tokens", [])}
    vocab.update(specials)
    tokens = [""] * len(vocab)
    for text, index in vocab.items():
        tokens[index] = text
    if "" in tokens or len(tokens) != config["vocab_size"]:
        raise ConfigError(f"{model_dir}/tokenizer.json: token ids are not 0..{config['vocab_size'] - 1}")
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_pad_token_id(vocab[tok_config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok_config["chat_template"])


def _tensors(model_dir: Path, config: dict):
    import mlx.core as mx

    weights = {k: np.array(v, dtype=np.float32) for k, v in mx.load(str(model_dir / "model.safetensors")).items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    yield "token_embd.weight", weights.pop("model.embed_tokens.weight")
    yield "output_norm.weight", weights.pop("model.norm.weight")
    for layer in range(config["num_hidden_layers"]):
        for source, target in _BLOCK_TENSORS.items():
            array = weights.pop(f"model.layers.{layer}.{source}")
            if source == "self_attn.q_proj.weight":
                array = _interleave_rope(array, heads)
            elif source == "self_attn.k_proj.weight":
                array = _interleave_rope(array, kv_heads)
            yield f"blk.{layer}.{target}", array
    if weights:
        raise ConfigError(f"{model_dir}/model.safetensors has tensors GGUF export does not map: {sorted(weights)}")


def _interleave_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q/k projection reordered from rotate-half pairs (i, i + d/2) to adjacent pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

"""tokentrace make-model: a loadable mlx-lm model, deterministic per size and seed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest


def _make(directory: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(directory), *args],
                          capture_output=True, text=True, timeout=300)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_same_seed_gives_identical_files_across_processes(tmp_path, tiny_model):
    again = tmp_path / "again"
    assert _make(again).returncode == 0
    assert _digests(again) == _digests(tiny_model)


def test_another_seed_changes_the_weights_only(tmp_path, tiny_model):
    other = tmp_path / "other"
    assert _make(other, "--seed", "1").returncode == 0
    a, b = _digests(tiny_model), _digests(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_model_loads_in_mlx_lm_and_generates(tmp_path, size):
    from mlx_lm import load, stream_generate

    directory = tmp_path / size
    result = _make(directory, "--size", size)
    assert result.returncode == 0, result.stderr
    model, tokenizer = load(str(directory))
    config = json.loads((directory / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer.get_vocab())
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Why was this request slow?"}],
                                           add_generation_prompt=True)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=4))
    assert 1 <= len(responses) <= 4
    assert tokenizer.eos_token_ids == {0, 2}


def test_refuses_a_non_empty_directory_without_force(tmp_path):
    directory = tmp_path / "busy"
    directory.mkdir()
    (directory / "keep.txt").write_text("x")
    result = _make(directory)
    assert result.returncode == 2
    assert "exists and is not empty" in result.stderr
    assert _make(directory, "--force").returncode == 0


def test_qwen2_loads_generates_and_can_be_split_between_ranks(tmp_path):
    """Issue 46 item 1: --arch qwen2 writes a model mlx-lm loads as qwen2, whose layers a distributed
    engine can split (PipelineMixin) as well as shard; llama stays the default."""
    from mlx_lm import load, stream_generate
    from mlx_lm.models.pipeline import PipelineMixin

    directory = tmp_path / "qwen2"
    result = _make(directory, "--arch", "qwen2")
    assert result.returncode == 0, result.stderr
    config = json.loads((directory / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen2", ["Qwen2ForCausalLM"])
    model, tokenizer = load(str(directory))
    assert isinstance(model.model, PipelineMixin) and callable(model.shard)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    first = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=4)]
    again = [r.token for r in stream_generate(*load(str(directory)), prompt, max_tokens=4)]
    assert first == again and 1 <= len(first) <= 4
    assert json.loads((directory / "tokentrace-model.json").read_text())["arch"] == "qwen2"
    refused = _make(tmp_path / "gguf", "--arch", "qwen2", "--gguf")
    assert refused.returncode == 2 and "--gguf writes the llama architecture only" in refused.stderr

"""Load a model in timed stages: files resolved, weights read, tokenizer loaded, warmed up.

``mlx_lm.load`` fuses these stages; it is recomposed here from its public parts (notes §1):
``load_model(lazy=True)`` then ``mx.eval(model.parameters())`` (where the bytes are really read),
``load_tokenizer``, and one warm-up generation through ``BatchGenerator`` — the serving path —
because mlx-lm has no warm-up of its own and the first forward pass pays one-off costs.

A server (``LoadOptions.freeze_heap``) ends the warm-up by collecting the garbage and freezing
what is left, as vLLM does after its warm-up: the load leaves some 100k long-lived Python objects
(mlx-lm, transformers' tokenizer) whose first full collection would otherwise fall on whichever
request allocates next, holding the GIL for 50-70 ms on a 2-core machine — the first request
after a lazy load was measured as a prefill, not a cold start, when it fell in its prefill.
"""

from __future__ import annotations

import gc
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokentrace.contract import (
    LOAD_BYTES,
    NODE_PLACEMENT,
    SPAN_LOAD_GROUP,
    SPAN_LOAD_RESOLVE,
    SPAN_LOAD_SHARD,
    SPAN_LOAD_TOKENIZER,
    SPAN_LOAD_WARMUP,
    SPAN_LOAD_WEIGHTS,
)
from tokentrace.engine_shim.mlx.records import LoadRecord
from tokentrace.errors import EngineError

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass
class Runtime:
    """A loaded, warmed-up model and what the engine needs to know about it."""

    model: Any  #: the mlx-lm model
    tokenizer: Any  #: mlx-lm TokenizerWrapper
    config: dict[str, Any]  #: config.json as mlx-lm read it
    context_length: int  #: longest sequence the model takes (max_position_embeddings)
    kv_bytes_per_token: int  #: 2 x layers x kv_heads x head_dim x dtype bytes
    weight_bytes: int  #: bytes of parameters
    eos_token_ids: frozenset[int]  #: tokens that end a generation
    group: Any = None  #: a distributed engine's mlx group (None: one process)
    placement: str | None = None  #: what this rank holds, in words (distributed only)
    #: every rank's KV bytes per token, by rank, learned at load (distributed only; () on one process)
    kv_shares: tuple[int, ...] = ()
    memory_limit_bytes: int = 0  #: the GPU memory MLX may use (0: not known, the CPU backend)


@dataclass(frozen=True)
class LoadOptions:
    """How to load, as mlx_lm.server's options say (each maps to an ``mlx_lm.load`` argument)."""

    adapter_path: str | None = None  #: LoRA adapters applied after the weights (--adapter-path)
    trust_remote_code: bool = False  #: allow model/tokenizer code from the model directory
    chat_template: str | None = None  #: a chat template replacing the tokenizer's (--chat-template)
    use_default_chat_template: bool = False  #: the tokenizer's default template when it has none
    freeze_heap: bool = False  #: collect and freeze the heap after the warm-up (a server; not a host's process)
    placement: Any = None  #: a distributed engine's ``cluster.Placement``: join the ring and load this rank's part


def new_load_record(path: str, lazy: bool) -> LoadRecord:
    """A load record stamped now, with a fresh id."""
    return LoadRecord(load_id=uuid.uuid4().hex, path=path, lazy=lazy, start_ns=time.perf_counter_ns())


def kv_bytes_per_token(config: dict[str, Any], fallback_dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token occupies: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    text = config.get("text_config", config)
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    dtype = str(text.get("torch_dtype") or text.get("dtype") or "")
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, fallback_dtype_bytes)


def load_runtime(record: LoadRecord, options: LoadOptions = LoadOptions()) -> Runtime:
    """Load ``record.path`` stage by stage, appending each stage to ``record``.

    Raises ``EngineError`` with the failing stage named; ``record.error`` says the same.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_adapters, load_model, load_tokenizer

    from tokentrace.engine_shim.mlx import cluster

    group = placement = None
    stage = SPAN_LOAD_RESOLVE
    try:
        if options.placement is not None:
            stage, start = SPAN_LOAD_GROUP, time.perf_counter_ns()
            group = cluster.join_ring()
            record.stages.append((stage, start, time.perf_counter_ns(), {}))

        stage, start = SPAN_LOAD_RESOLVE, time.perf_counter_ns()
        path = _resolve(record.path)
        record.stages.append((stage, start, time.perf_counter_ns(), {}))

        model, config = load_model(path, lazy=True, trust_remote_code=options.trust_remote_code)
        if group is not None:
            stage, start = SPAN_LOAD_SHARD, time.perf_counter_ns()
            used, placement = cluster.place(model, group, options.placement)
            record.stages.append((stage, start, time.perf_counter_ns(), {NODE_PLACEMENT: placement}))
        stage, start = SPAN_LOAD_WEIGHTS, time.perf_counter_ns()
        if options.adapter_path:
            model = load_adapters(model, options.adapter_path)
            model.eval()
        params = [array for _, array in tree_flatten(model.parameters())]
        mx.eval(params)  # the safetensors bytes are paged in here (notes §1: U:602)
        weight_bytes = sum(array.nbytes for array in params)
        record.stages.append((stage, start, time.perf_counter_ns(), {LOAD_BYTES: weight_bytes}))

        stage, start = SPAN_LOAD_TOKENIZER, time.perf_counter_ns()
        extra: dict[str, Any] = {"trust_remote_code": options.trust_remote_code}
        if options.chat_template:
            extra["chat_template"] = options.chat_template
        tokenizer = load_tokenizer(path, extra, eos_token_ids=config.get("eos_token_id"))
        if options.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        record.stages.append((stage, start, time.perf_counter_ns(), {}))

        stage, start = SPAN_LOAD_WARMUP, time.perf_counter_ns()
        _warm_up(model, tokenizer)
        shares: tuple[int, ...] = ()
        if group is not None:
            cluster.same_seed(group)
            layers = int(config.get("text_config", config)["num_hidden_layers"])
            full = kv_bytes_per_token(config, params[0].dtype.size if params else 2)
            shares = cluster.kv_shares(group, cluster.kv_share(model, group, used, full, layers))
        if options.freeze_heap:
            gc.collect()
            gc.freeze()  # later collections skip what the process holds for good
        record.stages.append((stage, start, time.perf_counter_ns(), {}))
    except Exception as exc:
        record.end_ns = time.perf_counter_ns()
        record.error = f"{stage}: {type(exc).__name__}: {exc}"
        raise EngineError(f"model load failed at {stage}: {exc}") from exc
    record.end_ns = time.perf_counter_ns()
    dtype_bytes = params[0].dtype.size if params else 2
    kv_bytes = shares[group.rank()] if group is not None else kv_bytes_per_token(config, dtype_bytes)
    return Runtime(
        model=model,
        tokenizer=tokenizer,
        config=config,
        context_length=int(config.get("max_position_embeddings") or 0) or 1 << 30,
        kv_bytes_per_token=kv_bytes,
        weight_bytes=weight_bytes,
        memory_limit_bytes=memory_limit(),
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        group=group,
        placement=placement,
        kv_shares=shares,
    )


def memory_limit() -> int:
    """The GPU memory MLX may use on this node (Metal's recommended working set), 0 where it knows
    none (the CPU backend: the heartbeat then reports the host's available memory)."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return int(info.get("max_recommended_working_set_size") or 0)


def looks_like_path(model: str) -> bool:
    """Whether ``--model`` names a local path rather than a Hugging Face repo id (``owner/name``):
    it exists, is absolute or relative (./, ../, ~), or has more than one slash."""
    return (Path(model).expanduser().exists() or model.startswith(("/", ".", "~"))
            or model.count("/") > 1 or "\\" in model)


def _resolve(path_or_repo: str) -> Path:
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (not an mlx-lm model directory)")
        return path
    if looks_like_path(path_or_repo):
        # Not a hub id: no download attempt, no HFValidationError about repo id syntax.
        raise FileNotFoundError(f"{path_or_repo}: no such model directory")
    # A hub id: mlx-lm's own resolver (private, hence looked up at call time and checked).
    from mlx_lm import utils

    download = getattr(utils, "_download", None)
    if download is None:
        raise FileNotFoundError(f"{path_or_repo} is not a directory and mlx-lm offers no resolver")
    return Path(download(path_or_repo))


def _warm_up(model: Any, tokenizer: Any) -> None:
    from mlx_lm.generate import BatchGenerator

    prompt = tokenizer.encode("warm up", add_special_tokens=False) or [0]
    generator = BatchGenerator(model, max_tokens=2, completion_batch_size=1, prefill_batch_size=1)
    try:
        generator.insert([prompt + prompt], max_tokens=[2])
        done = False
        while not done:
            _, generated = generator.next()
            done = any(response.finish_reason for response in generated)
    finally:
        generator.close()

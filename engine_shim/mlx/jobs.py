"""A generation job as the scheduler sees it, and the mlx-lm sampling objects it needs.

Sampling objects are shared between jobs with equal settings: mlx-lm's ``GenerationBatch`` samples
the whole batch in one call only when every sequence holds the *same* sampler object
(generate.py ``GenerationBatch._step``), so per-request samplers would cost a call per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tokentrace.engine_shim.mlx.records import RequestRecord


@dataclass(frozen=True)
class Sampling:
    """Decoding settings of one request (OpenAI fields plus vLLM's extras)."""

    temperature: float = 0.0  #: 0 means greedy, as in mlx_lm.server
    top_p: float = 1.0  #: nucleus sampling; 1 disables it
    top_k: int = 0  #: 0 disables it
    min_p: float = 0.0  #: 0 disables it
    min_tokens: int = 0  #: EOS is suppressed until this many tokens were generated (vLLM)
    ignore_eos: bool = False  #: keep generating through EOS until max_tokens (vLLM)


@dataclass(eq=False)
class Job:
    """One request inside the scheduler."""

    record: RequestRecord  #: where the scheduler records what happened
    tokens: list[int]  #: prompt token ids
    max_tokens: int  #: completion limit
    sampling: Sampling = field(default_factory=Sampling)  #: decoding settings
    sink: Any = None  #: the consumer's delivery state (opaque to the scheduler)
    uid: int = -1  #: BatchGenerator uid once admitted
    prefilled: int = 0  #: uncached prompt tokens computed so far
    cancel_reason: str | None = None  #: set when the consumer cancels (cancelled, stop)


class SamplingObjects:
    """Builds, and shares between equal requests, mlx-lm samplers, stop matchers and processors."""

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int):
        from mlx_lm.generate import StopSequences

        self._eos = sorted(eos_token_ids)
        self._vocab_size = vocab_size
        self._samplers: dict[tuple, Any] = {}
        self._stop_on_eos = StopSequences([[token] for token in self._eos] or None)
        self._stop_never = StopSequences(None)
        self._eos_mask = None

    def sampler(self, sampling: Sampling) -> Any:
        """The shared sampler for these settings; None means the generator's greedy default."""
        if sampling.temperature <= 0:
            return None
        key = (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p)
        sampler = self._samplers.get(key)
        if sampler is None:
            from mlx_lm.sample_utils import make_sampler

            top_p = sampling.top_p if sampling.top_p < 1.0 else 0.0
            sampler = make_sampler(sampling.temperature, top_p=top_p, min_p=sampling.min_p, top_k=sampling.top_k)
            self._samplers[key] = sampler
        return sampler

    def stop_sequences(self, sampling: Sampling) -> Any:
        """EOS stops the sequence unless ``ignore_eos``."""
        return self._stop_never if sampling.ignore_eos or not self._eos else self._stop_on_eos

    def logits_processors(self, sampling: Sampling, prompt_length: int) -> list[Any]:
        """A processor masking EOS until ``min_tokens`` were generated, when asked for."""
        if sampling.min_tokens <= 0 or sampling.ignore_eos or not self._eos:
            return []
        import mlx.core as mx

        if self._eos_mask is None:
            mask = [0.0] * self._vocab_size
            for token in self._eos:
                if token < self._vocab_size:
                    mask[token] = -math.inf
            self._eos_mask = mx.array(mask)
        mask, min_tokens = self._eos_mask, sampling.min_tokens

        def suppress_eos(context: Any, logits: Any) -> Any:
            # ``context`` holds the prompt and every token fed so far (mlx-lm TokenBuffer), so its
            # length minus the prompt is the number of tokens generated before this sample.
            if context.size - prompt_length < min_tokens:
                return logits + mask
            return logits

        return [suppress_eos]

"""A generation job as the scheduler sees it, and the mlx-lm sampling objects it needs.

Sampling objects are shared between jobs with equal settings: mlx-lm's ``GenerationBatch`` samples
the whole batch in one call only when every sequence holds the *same* sampler object
(generate.py ``GenerationBatch._step``), so per-request samplers would cost a call per sequence.
A seeded request gets a sampler of its own (its random stream is its own). Samplers and logits
processors are guarded: what they raise is recorded against their sequences instead of breaking
the batched step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tokentrace.engine_shim.mlx.records import RequestRecord


@dataclass(frozen=True)
class Sampling:
    """Decoding settings of one request (OpenAI fields, mlx_lm.server's extras, vLLM's extras)."""

    temperature: float = 0.0  #: 0 means greedy, as in mlx_lm.server
    top_p: float = 1.0  #: nucleus sampling; 0 or 1 disable it (mlx-lm)
    top_k: int = 0  #: 0 disables it
    min_p: float = 0.0  #: 0 disables it
    xtc_probability: float = 0.0  #: mlx-lm's XTC sampling; 0 disables it
    xtc_threshold: float = 0.1  #: XTC threshold
    min_tokens: int = 0  #: EOS is suppressed until this many tokens were generated (vLLM)
    ignore_eos: bool = False  #: keep generating through EOS until max_tokens (vLLM)
    repetition_penalty: float = 0.0  #: mlx-lm's multiplicative penalty; 0 disables it
    repetition_context_size: int = 20  #: tokens it looks back on
    presence_penalty: float = 0.0  #: additive penalty for tokens present; 0 disables it
    presence_context_size: int = 20  #: tokens it looks back on
    frequency_penalty: float = 0.0  #: additive penalty per occurrence; 0 disables it
    frequency_context_size: int = 20  #: tokens it looks back on
    logit_bias: tuple[tuple[int, float], ...] = ()  #: (token id, bias) pairs
    seed: int | None = None  #: a private random stream for this sequence
    top_logprobs: int | None = None  #: alternatives per token to report; None: no log-probabilities

    @property
    def sampler_key(self) -> tuple:
        """What a sampler depends on; equal keys share one sampler object."""
        return (self.temperature, self.top_p, self.top_k, self.min_p, self.xtc_probability, self.xtc_threshold)


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
    sampler: Any = None  #: the Guarded sampler the job samples with (None: greedy)
    fault: str | None = None  #: why this sequence failed inside the batch (its processors raised)
    abandoned: bool = False  #: failed while a distributed engine's ring was stalled; still in the batch until it moves
    timed_phases: set[str] = field(default_factory=set)  #: phases a timed step was asked for (StepTimer.due)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    """Per generated token, when asked: (token, logprob, [(alternative, logprob), ...])."""


class Guarded:
    """A sampler that never raises into mlx-lm's batched step.

    ``GenerationBatch._step`` calls every sequence's sampler inside one step; an exception there
    would leave the whole batch half-stepped. A failing sampler instead records the error and
    samples greedily, so the step completes; the scheduler then removes the sequences holding it
    (issue 12: one request's failure stays its own).
    """

    def __init__(self, sampler: Any):
        self.sampler = sampler
        self.error: str | None = None  #: the first exception, as text

    def __call__(self, logprobs: Any) -> Any:
        if self.error is None:
            try:
                return self.sampler(logprobs)
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
        import mlx.core as mx

        return mx.argmax(logprobs, axis=-1)


class SamplingObjects:
    """Builds mlx-lm samplers, stop matchers and logits processors; shares samplers between equal
    requests without a seed."""

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int, xtc_special_tokens: list[int] | None = None):
        from mlx_lm.generate import StopSequences

        self._eos = sorted(eos_token_ids)
        self._vocab_size = vocab_size
        self._xtc_special = list(xtc_special_tokens or []) + self._eos
        self._samplers: dict[tuple, Guarded] = {}
        self._stop_on_eos = StopSequences([[token] for token in self._eos] or None)
        self._stop_never = StopSequences(None)
        self._eos_mask = None

    def sampler(self, sampling: Sampling) -> Guarded | None:
        """The sampler for these settings (shared unless seeded); None means greedy."""
        if sampling.temperature <= 0:
            return None
        if sampling.seed is not None:
            return Guarded(self._seeded(sampling))
        key = sampling.sampler_key
        sampler = self._samplers.get(key)
        if sampler is None or sampler.error is not None:
            from mlx_lm.sample_utils import make_sampler

            sampler = Guarded(make_sampler(sampling.temperature, top_p=sampling.top_p, min_p=sampling.min_p,
                                           top_k=sampling.top_k, xtc_probability=sampling.xtc_probability,
                                           xtc_threshold=sampling.xtc_threshold,
                                           xtc_special_tokens=self._xtc_special))
            self._samplers[key] = sampler
        return sampler

    def _seeded(self, sampling: Sampling) -> Any:
        # mlx_lm.server seeds the global generator and serves a seeded request alone; a private key
        # split once per token draws the same numbers (mx.random.seed(s) then one categorical per
        # token), so the answer equals mlx_lm.server's while the batch goes on.
        import mlx.core as mx
        from mlx_lm import sample_utils as su

        filters = []
        if 0 < sampling.top_p < 1.0:
            filters.append(lambda x: su.apply_top_p(x, sampling.top_p))
        if sampling.min_p != 0.0:
            filters.append(lambda x: su.apply_min_p(x, sampling.min_p))
        if sampling.xtc_probability > 0.0:
            filters.append(lambda x: su.apply_xtc(x, sampling.xtc_probability, sampling.xtc_threshold,
                                                  self._xtc_special))
        if sampling.top_k > 0:
            filters.append(lambda x: su.apply_top_k(x, sampling.top_k))
        state = [mx.random.key(sampling.seed % (1 << 64))]  # any integer, as a 64-bit key
        scale = 1.0 / sampling.temperature

        def sample(logprobs: Any) -> Any:
            for apply in filters:
                logprobs = apply(logprobs)
            state[0], key = mx.random.split(state[0])
            return mx.random.categorical(logprobs * scale, key=key)

        return sample

    def stop_sequences(self, sampling: Sampling) -> Any:
        """EOS stops the sequence unless ``ignore_eos``."""
        return self._stop_never if sampling.ignore_eos or not self._eos else self._stop_on_eos

    def logits_processors(self, job: Job) -> list[Any]:
        """mlx-lm's processors for the job's penalties and logit bias (as mlx_lm.server makes them),
        plus EOS suppression until ``min_tokens``; one guarded processor, or none."""
        from mlx_lm.sample_utils import make_logits_processors

        sampling = job.sampling
        processors = make_logits_processors(
            dict(sampling.logit_bias) or None,
            sampling.repetition_penalty, sampling.repetition_context_size,
            sampling.presence_penalty, sampling.presence_context_size,
            sampling.frequency_penalty, sampling.frequency_context_size,
        )
        processors += self._min_tokens(sampling, len(job.tokens))
        if not processors:
            return []

        def guarded(context: Any, logits: Any) -> Any:
            if job.fault is None:
                try:
                    for processor in processors:
                        logits = processor(context, logits)
                except Exception as exc:
                    job.fault = f"{type(exc).__name__}: {exc}"
            return logits

        return [guarded]

    def _min_tokens(self, sampling: Sampling, prompt_length: int) -> list[Any]:
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

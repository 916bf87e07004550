"""Python API for applications that embed mlx-lm themselves: the engine's spans from
``stream_generate``-style use, with no server and no scheduler.

    from tokentrace.engine_shim import Instrumentation

    shim = Instrumentation()                      # spans go to the global tracer provider
    model, tokenizer = shim.load("path/to/model")  # model.load with its stages
    for response in shim.stream_generate(model, tokenizer, "Hello", max_tokens=32):
        print(response.text, end="")
    shim.close()                                   # build what is pending and flush

Per call: ``llm.request`` with ``llm.prefill`` (one ``llm.prefill.chunk`` per chunk, from mlx-lm's
``prompt_progress_callback``), ``llm.decode`` (one offset per yielded token) and, when the prompt's
token ids are known, ``llm.cache.lookup`` with its fingerprint and segments; plus ``engine.steps``.
The loop only timestamps; spans are built on a background thread after the generator finishes.
Set the resource (``service.instance.id`` …) on your provider, e.g. with ``engine_resource``.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import trace

from tokentrace.contract import MATCH_NONE, MATCH_PREFIX
from tokentrace.engine_shim.mlx.exporter_process import ExporterConfig, ExporterProcess, engine_resource
from tokentrace.engine_shim.mlx.loader import load_runtime, new_load_record
from tokentrace.engine_shim.mlx.prompts import Prompt, build_text_prompt
from tokentrace.engine_shim.mlx.records import Clock, LookupRecord, RequestRecord, StepWindow
from tokentrace.engine_shim.mlx.scheduler import WINDOW_NS, WINDOW_STEPS
from tokentrace.engine_shim.mlx.telemetry import RecordSink, SpanSink, Telemetry


class Instrumentation:
    """Wraps mlx-lm loading and generation; one per process is enough.

    By default spans are built on a background thread of this process, on ``tracer_provider`` (or
    the global one). ``to_collector`` instead hands records to an exporter process, as the engine
    does, which keeps span building off this process's GIL (~20 µs of CPU per token, see
    docs/benchmarks.md).
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None, capture_content: bool = False,
                 sink: RecordSink | None = None):
        self.telemetry = Telemetry(sink or SpanSink(tracer_provider))
        self.capture_content = capture_content

    @classmethod
    def to_collector(cls, instance_id: str, model: str, endpoint: str = "http://127.0.0.1:4318",
                     spool_dir: str | None = None, token: str | None = None,
                     capture_content: bool = False) -> Instrumentation:
        """Spans built and sent to a collector by a separate exporter process (multiprocessing
        spawn: guard your script's entry point with ``if __name__ == "__main__":``)."""
        resource = engine_resource(instance_id, model)
        exporter = ExporterProcess(ExporterConfig(
            {k: list(v) if isinstance(v, tuple | list) else str(v) for k, v in resource.attributes.items()},
            endpoint, spool_dir, 256 << 20, token,
            Clock().offset_ns)).start()
        return cls(capture_content=capture_content, sink=exporter)

    def load(self, path: str) -> tuple[Any, Any]:
        """``mlx_lm.load`` in timed stages (model.load spans); returns (model, tokenizer)."""
        record = new_load_record(path, lazy=False)
        try:
            runtime = load_runtime(record)
        finally:
            self._submit(record)
        return runtime.model, runtime.tokenizer

    def stream_generate(self, model: Any, tokenizer: Any, prompt: str | Sequence[int] | Prompt | Any,
                        request_id: str | None = None, session_id: str | None = None,
                        **kwargs: Any) -> Iterator[Any]:
        """``mlx_lm.stream_generate`` with spans; yields its ``GenerationResponse`` objects.

        ``prompt`` may also be a ``Prompt`` from ``build_chat_prompt`` (then the segments are per
        message). With ``prompt_cache=`` holding earlier tokens, those count as cached tokens.
        """
        from mlx_lm import stream_generate

        record = RequestRecord(request_id or f"req-{uuid.uuid4().hex}", "stream_generate", time.perf_counter_ns(),
                               session_id=session_id, max_tokens=kwargs.get("max_tokens"), streamed=True)
        tokens, prompt_record = self._prompt(tokenizer, prompt)
        cached = _cached_tokens(kwargs.get("prompt_cache"))
        # With a caller's prompt cache, ``prompt`` is only the uncached suffix (stream_generate's
        # contract): the cached ids are unknown here, so no fingerprint can be computed.
        prompt_record.unknown_prefix = cached
        record.prompt = prompt_record
        record.admit_ns = record.arrival_ns
        record.lookup = LookupRecord(cached, MATCH_PREFIX if cached else MATCH_NONE, 0, 0)
        record.lookup_end_ns = record.arrival_ns
        chunk_marks: list[tuple[int, int]] = []  # (perf_counter_ns, processed), one per callback
        user_callback = kwargs.pop("prompt_progress_callback", None)

        def on_progress(processed: int, total: int) -> None:
            chunk_marks.append((time.perf_counter_ns(), processed))
            if user_callback is not None:
                user_callback(processed, total)

        token_ns = record.token_ns
        reason = "cancelled"  # unless the generator runs to its end
        try:
            for response in stream_generate(model, tokenizer, tokens, prompt_progress_callback=on_progress,
                                            **kwargs):
                token_ns.append(time.perf_counter_ns())
                if response.finish_reason is not None:
                    reason = response.finish_reason
                yield response
        except Exception as exc:
            reason, record.error_type, record.http_status = "error", type(exc).__name__, 500
            raise
        finally:
            record.finish_ns = record.end_ns = time.perf_counter_ns()
            record.finish_reason = reason
            self._finish(record, chunk_marks, cached)

    def flush(self, timeout: float = 10.0) -> bool:
        """Build every pending span and flush the provider; False on timeout."""
        return self.telemetry.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Build every pending span and flush the provider."""
        self.telemetry.close(timeout)

    def _prompt(self, tokenizer: Any, prompt: Any) -> tuple[Any, Prompt]:
        if isinstance(prompt, Prompt):
            return prompt.tokens, prompt
        if hasattr(prompt, "tolist"):  # an mx.array of token ids
            prompt = prompt.tolist()
        record = build_text_prompt(tokenizer, prompt, self.capture_content)
        return record.tokens, record

    def _finish(self, record: RequestRecord, marks: list[tuple[int, int]], cached: int) -> None:
        # stream_generate calls back with (0, total) first, after each chunk, and with
        # (total, total) once the first token is ready (generate.py generate_step).
        for (start, before), (end, after) in itertools.pairwise(marks):
            if after > before:
                record.chunk_start_ns.append(start)
                record.chunk_end_ns.append(end)
                record.chunk_offset.append(cached + before)
                record.chunk_tokens.append(after - before)
                record.chunk_batch.append(1)
        self._submit(record)
        for window in _steps_of(record):
            self._submit(window)

    def _submit(self, record: Any) -> None:
        self.telemetry.start().submit(record)


def _cached_tokens(prompt_cache: Any) -> int:
    if not prompt_cache:
        return 0
    try:
        return int(prompt_cache[0].offset)
    except (AttributeError, TypeError, ValueError):
        return 0


def _steps_of(record: RequestRecord) -> list[StepWindow]:
    """The request's engine steps (its prefill chunks, then one decode step per later token) in
    windows of at most WINDOW_STEPS steps or WINDOW_NS."""
    steps = [(start, end, 1, 0, tokens, 0) for start, end, tokens in
             zip(record.chunk_start_ns, record.chunk_end_ns, record.chunk_tokens, strict=True)]
    steps += [(start, end, 0, 1, 0, 1) for start, end in itertools.pairwise(record.token_ns)]
    windows = [StepWindow()]
    for step in steps:
        window = windows[-1]
        if len(window) >= WINDOW_STEPS or (window.start_ns and step[1] - window.start_ns[0] > WINDOW_NS):
            window = StepWindow()
            windows.append(window)
        _step(window, *step, record.request_id)
    return [window for window in windows if len(window)]


def _step(window: StepWindow, start: int, end: int, prefill_seqs: int, decode_seqs: int, prefill_tokens: int,
          decode_tokens: int, request_id: str) -> None:
    window.start_ns.append(start)
    window.duration_ns.append(end - start)
    window.prefill_seqs.append(prefill_seqs)
    window.decode_seqs.append(decode_seqs)
    window.prefill_tokens.append(prefill_tokens)
    window.decode_tokens.append(decode_tokens)
    window.members.append(request_id)

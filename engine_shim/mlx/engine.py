"""The engine service: the scheduler thread, the telemetry thread, and what the HTTP layer asks of
them (wait for the model, tokenize, submit, cancel). Lives on the asyncio loop of the server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokentrace.contract import EVENT_STARTED, EVENT_STOPPED
from tokentrace.engine_shim.mlx.jobs import Job
from tokentrace.engine_shim.mlx.params import (
    ChatRequest,
    CompletionRequest,
    SamplingDefaults,
    chat_messages,
    check_for_model,
    max_tokens_of,
    sampling_of,
)
from tokentrace.engine_shim.mlx.prompts import Prompt, build_chat_prompt, build_text_prompt
from tokentrace.engine_shim.mlx.protocol import BadRequest
from tokentrace.engine_shim.mlx.records import LifecycleRecord, LoadRecord, RequestRecord
from tokentrace.engine_shim.mlx.scheduler import LOAD_FAILED, LOAD_READY, Scheduler
from tokentrace.engine_shim.mlx.settings import EngineSettings
from tokentrace.engine_shim.mlx.telemetry import Telemetry
from tokentrace.threads import name_os_thread, os_named

log = logging.getLogger(__name__)


class Engine:
    """One served model: ``start()`` and ``stop()`` on the server's event loop."""

    def __init__(self, settings: EngineSettings, telemetry: Telemetry):
        self.settings = settings
        self.telemetry = telemetry
        self.scheduler = Scheduler(settings, deliver=self._deliver, submit=telemetry.submit,
                                   on_load_done=self._load_done, prefill_gate=telemetry.prefilling)
        telemetry.heartbeat = self.scheduler.heartbeat
        self.answered = 0  #: requests answered successfully
        self.on_load_failed: Any = None  #: called on the event loop when the model cannot be loaded
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        # Chat templates are rendered and prompts tokenized here, off the event loop, two at a time:
        # a 2,000-message chat takes a while, and /health must still answer (issue 12).
        self._prompt_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokentrace-prompt",
                                                initializer=name_os_thread)
        self._defaults = SamplingDefaults(settings.temp, settings.top_p, settings.top_k, settings.min_p)
        self._template_kwargs = settings.template_kwargs
        # mlx_lm.server's names for its model: "default_model", --model as given, its resolved path.
        self._model_names = {settings.served_name, settings.model, "default_model",
                             str(Path(settings.model).expanduser().resolve())}

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start telemetry and the generation thread (which loads the model unless --lazy-load)."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self.telemetry.start()
        self.telemetry.submit(LifecycleRecord(EVENT_STARTED, time.perf_counter_ns()))
        self._thread = threading.Thread(target=os_named(self.scheduler.run), name="tokentrace-generation", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop generating, report instance.stopped and flush telemetry."""
        self.scheduler.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.telemetry.submit(LifecycleRecord(EVENT_STOPPED, time.perf_counter_ns()))
        await asyncio.to_thread(self.telemetry.close)
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def state(self) -> str:
        """not_loaded, loading, ready or failed."""
        return self.scheduler.load_state

    # --- per request ---------------------------------------------------------------------------
    async def wait_ready(self, record: RequestRecord) -> None:
        """Return once the model is ready, recording a load wait when there was one.

        The wait is clamped to the load's window: it starts no earlier than the load (a request
        that triggers a lazy load arrives a moment before it) and ends when the model was ready,
        not when this coroutine got to run again.
        """
        scheduler = self.scheduler
        if scheduler.unavailable is not None:
            raise BadRequest(f"this instance cannot serve: {scheduler.unavailable}", status=503,
                             error_type="server_error",
                             code="instance_degraded" if scheduler.degraded else "instance_stalled")
        if self.scheduler.load_state == LOAD_READY:
            return
        load = self.scheduler.request_load(lazy=True)
        await self._ready.wait()
        record.load_id = load.load_id
        record.load_wait_start_ns = max(record.arrival_ns, load.start_ns)
        record.load_wait_end_ns = max(load.end_ns, record.load_wait_start_ns)
        if self.scheduler.load_state == LOAD_FAILED:
            raise BadRequest(f"the model failed to load: {load.error}", status=503, error_type="server_error",
                             code="model_load_failed")

    def check_model(self, name: str | None) -> None:
        """Refuse requests naming another model (404, as OpenAI does)."""
        accepted = self._model_names
        if name is not None and name not in accepted:
            raise BadRequest(f"The model '{name}' does not exist; this engine serves '{self.settings.served_name}'",
                             param="model", status=404, code="model_not_found")

    async def new_job(self, kind: str, request: ChatRequest | CompletionRequest, record: RequestRecord) -> Job:
        """The request as a job, its prompt rendered and tokenized on the prompt threads."""
        return await self.off_loop(self._new_job, kind, request, record)

    async def off_loop(self, function: Any, *args: Any) -> Any:
        """``function(*args)`` on the prompt threads (request work too heavy for the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, function, *args)

    def _new_job(self, kind: str, request: ChatRequest | CompletionRequest, record: RequestRecord) -> Job:
        """Tokenize the request into a job; refuses prompts over the context limit."""
        runtime = self.scheduler.runtime
        prompt = self._prompt(kind, request, runtime.tokenizer)
        record.prompt = prompt
        context = runtime.context_length
        if not prompt.tokens:
            raise BadRequest("the prompt is empty", param="prompt" if kind != "chat" else "messages")
        vocab = int(runtime.config["vocab_size"])
        if kind != "chat" and any(not 0 <= t < vocab for t in prompt.tokens):
            raise BadRequest(f"'prompt': token ids must be in [0, {vocab})", param="prompt")
        requested = max_tokens_of(request)
        if len(prompt.tokens) >= context:
            raise BadRequest(
                f"This model's maximum context length is {context} tokens. However, your prompt has "
                f"{len(prompt.tokens)} tokens. Please reduce the length of the prompt.",
                param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        if requested is not None and len(prompt.tokens) + requested > context:
            raise BadRequest(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{len(prompt.tokens) + requested} tokens ({len(prompt.tokens)} in the prompt, {requested} "
                f"for the completion). Please reduce the length of the prompt or the completion.",
                param="max_tokens", code="context_length_exceeded")
        max_tokens = requested or min(self.settings.default_max_tokens, context - len(prompt.tokens))
        sampling = sampling_of(request, self._defaults)
        check_for_model(sampling, vocab)
        return Job(record=record, tokens=prompt.tokens, max_tokens=max_tokens, sampling=sampling)

    def _prompt(self, kind: str, request: Any, tokenizer: Any) -> Prompt:
        capture = self.settings.capture_content
        try:
            if kind == "chat":
                kwargs = {**self._template_kwargs, **(request.chat_template_kwargs or {})}
                return build_chat_prompt(tokenizer, chat_messages(request), request.tools, capture, kwargs)
            prompt = request.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            return build_text_prompt(tokenizer, prompt, capture)
        except BadRequest:
            raise
        except RecursionError:
            raise BadRequest("cannot render the prompt: nested too deeply", param="messages") from None
        except Exception as exc:  # a chat template's own complaint, e.g. roles out of order
            raise BadRequest(f"cannot render the prompt: {exc}", param="messages") from None

    def submit(self, job: Job) -> None:
        """Queue a job for generation."""
        self.scheduler.submit(job)

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop a job (client gone, or a stop string matched)."""
        self.scheduler.cancel(job, reason)

    def finished(self, record: RequestRecord) -> None:
        """A request is over on the HTTP side and its generation has ended: emit its spans."""
        if record.http_status == 200 and not record.client_disconnected and record.finish_reason in ("stop", "length"):
            self.answered += 1
            record.first_response = self.answered == 1
        self.telemetry.submit(record)

    # --- called from the generation thread -----------------------------------------------------
    def _deliver(self, items: list[tuple[Job, int, str | None]]) -> None:
        # One wake-up of the event loop per engine step, not one per token.
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone, nobody listens
            self._loop.call_soon_threadsafe(_dispatch, items)

    def _load_done(self, record: LoadRecord) -> None:
        self._loop.call_soon_threadsafe(self._ready.set)
        if record.error is not None and self.on_load_failed is not None:
            self._loop.call_soon_threadsafe(self.on_load_failed)


def _dispatch(items: list[tuple[Job, int, str | None]]) -> None:
    for job, token, reason in items:
        try:
            job.sink.push(token, reason)
        except Exception:  # one consumer's error must not keep this step's tokens from the others
            log.exception("delivering a token to request %s failed", job.record.request_id)

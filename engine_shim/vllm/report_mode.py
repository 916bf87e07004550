"""Ask vLLM for full KV-event reports on every request, where the installed vLLM offers them.

vLLM 0.32 reads ``kv_cache_report_mode`` per request from ``SamplingParams.extra_args``
(``vllm/v1/request.py``; default ``"incremental"``). With ``"full"`` its ``KVCacheManager`` also
reports the prefix-cache blocks a request *reuses*, as a ``BlockStored`` of blocks already cached
(``get_computed_blocks`` -> ``BlockPool.emit_cached_block_events``), and every ``BlockStored`` names the
``session_id`` of the request that caused it. vLLM has no server-wide setting for either, so the
plugin sets them on each request in the API server, where ``AsyncLLM.add_request`` hands every
``EngineCoreRequest`` to ``InputProcessor.assign_request_id`` before sending it to the engine: a
request that names no session gets its own (external) request id as ``session_id`` — the id vLLM's
``FinishedRequestStats`` carries — and a mode the client chose itself (``vllm_xargs``) is kept.

Nothing here raises into vLLM: on a vLLM without these pieces the plugin stays incremental.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("vllm.tokentrace")

FULL = "full"
INCREMENTAL = "incremental"
#: The ``extra_args`` key vLLM reads (vllm/v1/request.py).
MODE_KEY = "kv_cache_report_mode"

_INSTALLED = False


def full_reports_supported() -> bool:
    """Whether the installed vLLM reports reused blocks in full mode and tags events by session."""
    try:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return False
    return (hasattr(BlockPool, "emit_cached_block_events")
            and "session_id" in getattr(BlockStored, "__struct_fields__", ())
            and "session_id" in getattr(EngineCoreRequest, "__struct_fields__", ())
            and callable(getattr(InputProcessor, "assign_request_id", None)))


def ask_for_full(request: Any) -> None:
    """Mark one ``EngineCoreRequest`` (after ``assign_request_id``): full reports, a session id."""
    params = getattr(request, "sampling_params", None)
    if params is None:  # pooling requests have no sampling params and no KV reuse to report
        return
    extra = params.extra_args if params.extra_args is not None else {}
    extra.setdefault(MODE_KEY, FULL)
    params.extra_args = extra
    if request.session_id is None:
        request.session_id = request.external_req_id or request.request_id


def install() -> str:
    """Ask for full reports on every request from now on; return the mode the plugin runs in."""
    global _INSTALLED
    if not full_reports_supported():
        log.info("tokentrace: this vLLM has no full KV-event reports (%s); the KV-event subscriber runs "
                 "incremental: stored and removed blocks only", MODE_KEY)
        return INCREMENTAL
    if not _INSTALLED:
        from vllm.v1.engine.input_processor import InputProcessor

        original = InputProcessor.assign_request_id

        @functools.wraps(original)
        def assign_request_id(request: Any) -> None:
            original(request)
            try:
                ask_for_full(request)
            except Exception:  # never fail a request for tokentrace's sake
                log.debug("tokentrace: could not ask for full KV-event reports", exc_info=True)

        InputProcessor.assign_request_id = staticmethod(assign_request_id)  # type: ignore[method-assign]
        _INSTALLED = True
    log.info("tokentrace: the KV-event subscriber runs with %s=%s: vLLM reports the blocks each request "
             "reuses too, tagged with its request id", MODE_KEY, FULL)
    return FULL

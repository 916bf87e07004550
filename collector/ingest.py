"""The receive path shared by HTTP and the spool: decompress -> decode -> normalize, with reject
counters by named reason. Validation and normalization happen here, before anything is queued for
the writer, so a bad payload never reaches the store."""

from __future__ import annotations

import threading
from collections import Counter

from tokentrace.collector.normalize import Batch, normalize
from tokentrace.collector.otlp import Encoding, decode, decompress
from tokentrace.errors import PayloadError, PayloadTooLarge, UnsupportedMediaType


class Counters:
    """Thread-safe ingest counters: accepted spans, and rejects by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accepted_spans = 0
        self.rejected: Counter[str] = Counter()

    def reject(self, reason: str, count: int = 1) -> None:
        """Count ``count`` rejects for ``reason`` (a snake_case name, e.g. ``malformed``)."""
        with self._lock:
            self.rejected[reason] += count

    def accept(self, spans: int) -> None:
        """Count spans stored."""
        with self._lock:
            self.accepted_spans += spans

    def snapshot(self) -> dict:
        """A JSON-ready copy."""
        with self._lock:
            return {"accepted_spans": self.accepted_spans, "rejected": dict(self.rejected)}


class Pipeline:
    """Turns one payload into a Batch, counting what it refuses."""

    def __init__(self, counters: Counters, max_body_bytes: int, max_value_length: int):
        self.counters = counters
        self.max_body_bytes = max_body_bytes
        self.max_value_length = max_value_length

    def batch(self, body: bytes, encoding: Encoding, content_encoding: str | None = None) -> Batch:
        """Decode and normalize; PayloadError (counted) when nothing in it can be used."""
        try:
            payload = decompress(body, content_encoding, self.max_body_bytes)
            request = decode(payload, encoding)
        except PayloadTooLarge:
            self.counters.reject("too_large")
            raise
        except UnsupportedMediaType:
            self.counters.reject("unsupported_media_type")
            raise
        except PayloadError:
            self.counters.reject("malformed")
            raise
        batch = normalize(request, self.max_value_length)
        if batch.rejected:
            self.counters.reject("invalid_span", batch.rejected)
        if batch.truncated:
            self.counters.reject("truncated_value", batch.truncated)
        if batch.rejected and not batch.spans:
            raise PayloadError(f"no valid span in the request: {batch.message()}")
        return batch

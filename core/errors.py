"""The exception tree of tokentrace.

    TokentraceError
    ├── ConfigError      a setting or CLI argument is invalid (exit 2)
    ├── PayloadError     an OTLP payload cannot be decoded (HTTP 400)
    │   └── PayloadTooLarge   over the body limit (HTTP 413)
    ├── UnsupportedMediaType  a content type or encoding we do not speak (HTTP 415)
    ├── Overloaded       the write queue is full (HTTP 503 + Retry-After)
    ├── StoreError       the store failed to read or write (DuckDB, ClickHouse)
    ├── NotFound         an unknown request id or other missing object (exit 2, HTTP 404)
    └── EngineError      the engine cannot serve (model load failure, bad request to the engine)

Library errors are mapped at the boundary (``raise StoreError(...) from exc``); messages say what
was expected and what arrived. Only ``main()`` turns them into exit codes.
"""


class TokentraceError(Exception):
    """Base of every error tokentrace raises on purpose."""


class ConfigError(TokentraceError):
    """A setting or CLI argument is invalid."""


class PayloadError(TokentraceError):
    """An OTLP payload cannot be decoded; the message says what was wrong."""


class PayloadTooLarge(PayloadError):
    """The request body is over the size limit."""


class UnsupportedMediaType(TokentraceError):
    """A content type or content encoding the receiver does not speak."""


class Overloaded(TokentraceError):
    """The write queue is full; the sender should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class StoreError(TokentraceError):
    """The store failed to read or write."""


class NotFound(TokentraceError):
    """An object (request id, instance) that the store does not hold."""


class EngineError(TokentraceError):
    """The engine cannot serve."""

"""The exception tree of tokentrace, and the one map from an error to what each boundary answers.

    TokentraceError                 HTTP  exit  retry  code
    ├── ConfigError                  400    2    no    bad_parameter      a setting, argument or query parameter
    ├── PayloadError                 400    2    no    malformed          an OTLP payload cannot be decoded
    │   ├── PayloadTooLarge          413    2    no    too_large          over the body limit
    │   └── RejectedBatch            400    2    no    rejected           the store cannot hold a value of it
    ├── UnsupportedMediaType         415    2    no    unsupported_media_type
    ├── Overloaded                   503    1    yes   overloaded         the write queue is full
    ├── StoreError                   503    1    yes   store_unavailable  the store failed to read or write
    ├── NotFound                     404    2    no    not_found          an unknown request id or other object
    │   └── StillOpen                404    2    no    still_open         a request open in a stalled engine
    ├── Unauthorized                 401    2    no    unauthorized       a missing or wrong bearer token
    └── EngineError                  500    1    no    engine_error       the engine cannot serve
        └── RequestRefused           (own)  2    no    (own)              the engine refuses one request
                                                                          (engine_shim.mlx BadRequest)

The status, exit code, retryability and code live on the classes (``http_status``, ``exit_code``,
``retryable``, ``code``); every boundary reads them there: the CLI's ``main()`` (exit code), the
collector's receiver and API handlers (status, Retry-After), the dashboard's HTML pages, and
``error_for_status`` for the way back (an HTTP answer of the collector becoming our exception in
``analyze --url``). Retryable means the condition passes (a queue drains, a disk is freed, a store
comes back); input that can never succeed is never retryable (issue 11).

Library errors are mapped at the boundary (``raise StoreError(...) from exc``); messages say what
was expected and what arrived. Only ``main()`` turns them into exit codes.
"""

from __future__ import annotations


class TokentraceError(Exception):
    """Base of every error tokentrace raises on purpose."""

    http_status: int = 500  #: what an HTTP boundary answers
    exit_code: int = 1  #: what ``main()`` returns (2: bad input, 1: failure)
    retryable: bool = False  #: whether the same request may succeed later (503 + Retry-After)
    retry_after: int = 0  #: seconds a sender should wait, when retryable
    code: str = "internal_error"  #: the ``code`` of the JSON error envelope, and the reject counter's name
    title: str = "Error"  #: heading of the dashboard's error page


class ConfigError(TokentraceError):
    """A setting, CLI argument or query parameter is invalid."""

    http_status, exit_code, code, title = 400, 2, "bad_parameter", "Bad parameter"


class PayloadError(TokentraceError):
    """An OTLP payload cannot be decoded; the message says what was wrong."""

    http_status, exit_code, code, title = 400, 2, "malformed", "Bad payload"


class PayloadTooLarge(PayloadError):
    """The request body is over the size limit."""

    http_status, code = 413, "too_large"


class RejectedBatch(PayloadError):
    """The store refused a value of a batch (a conversion error): sending it again cannot succeed."""

    code = "rejected"


class UnsupportedMediaType(TokentraceError):
    """A content type or content encoding the receiver does not speak."""

    http_status, exit_code, code = 415, 2, "unsupported_media_type"


class Overloaded(TokentraceError):
    """The write queue is full; the sender should retry after ``retry_after`` seconds."""

    http_status, retryable, code, title = 503, True, "overloaded", "Overloaded"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class StoreError(TokentraceError):
    """The store failed to read or write (a full disk, a busy or unreachable store)."""

    http_status, retryable, retry_after, code, title = 503, True, 5, "store_unavailable", "Store unavailable"


class NotFound(TokentraceError):
    """An object (request id, instance) that the store does not hold."""

    http_status, exit_code, code, title = 404, 2, "not_found", "Not found"


class StillOpen(NotFound):
    """A request the store holds no row of yet because it has not ended, and whose engine reports it
    open in a stall: the message is the live answer; the verdicts come when it ends."""

    code, title = "still_open", "Still open"


class Unauthorized(TokentraceError):
    """A request without the bearer token the collector requires."""

    http_status, exit_code, code, title = 401, 2, "unauthorized", "Unauthorized"


class EngineError(TokentraceError):
    """The engine cannot serve."""

    code = "engine_error"


class RequestRefused(EngineError):
    """A request the engine refuses; ``http_status`` is per instance (400, 404, 413, ...). The MLX
    engine's ``BadRequest`` (engine_shim/mlx/protocol.py) is one, whose ``code`` is the OpenAI
    error code of its envelope."""

    exit_code = 2

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.http_status = status


def error_for_status(status: int, message: str) -> TokentraceError:
    """The exception an HTTP status of a tokentrace server stands for (the map read backwards).

    A status no class claims is a failure of the server: StoreError when it is 5xx, else
    ConfigError (the request was refused for a reason we did not name).
    """
    for cls in (NotFound, Unauthorized, ConfigError, PayloadTooLarge, UnsupportedMediaType, StoreError):
        if cls.http_status == status:
            return cls(message)
    return StoreError(message) if status >= 500 else ConfigError(message)


def retry_headers(exc: TokentraceError) -> dict[str, str] | None:
    """``Retry-After`` for a retryable error, nothing otherwise."""
    return {"Retry-After": str(exc.retry_after or 1)} if exc.retryable else None

"""OTLP/HTTP trace payloads: content types, compression, decoding and responses.

Follows the OTLP/HTTP specification (opentelemetry-proto docs/specification.md): protobuf
(``application/x-protobuf``) and JSON (``application/json``, hex-encoded trace and span ids, enums
as integers, 64-bit integers as strings or numbers), optional ``gzip``/``deflate`` bodies, and an
``ExportTraceServiceResponse`` in the request's own encoding.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from dataclasses import dataclass

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tokentrace.errors import PayloadError, PayloadTooLarge, UnsupportedMediaType

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_PROTOBUF_TYPES = {PROTOBUF, "application/protobuf"}
_DECOMPRESSORS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_ID_FIELDS = (("traceId", 16), ("spanId", 8), ("parentSpanId", 8))
#: Deepest message nesting a JSON body may have: protobuf's own limit for binary payloads.
_MAX_DEPTH = 100


def _first_line(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:297] + "..."


@dataclass(frozen=True)
class Encoding:
    """How a payload is encoded: ``"protobuf"`` or ``"json"``, and the media type to answer with."""

    name: str
    media_type: str


def encoding_for(content_type: str | None) -> Encoding:
    """The encoding named by a Content-Type header, or UnsupportedMediaType."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media in _PROTOBUF_TYPES:
        return Encoding("protobuf", PROTOBUF)
    if media == JSON:
        return Encoding("json", JSON)
    raise UnsupportedMediaType(
        f"Content-Type must be {PROTOBUF} or {JSON}, received {content_type or 'none'!r}"
    )


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body with its Content-Encoding removed, never inflating past ``max_bytes``."""
    coding = (content_encoding or "identity").strip().lower()
    if coding in ("", "identity"):
        return body
    wbits = _DECOMPRESSORS.get(coding)
    if wbits is None:
        raise UnsupportedMediaType(
            f"Content-Encoding must be gzip, deflate or identity, received {content_encoding!r}"
        )
    inflater = zlib.decompressobj(wbits)
    try:
        # max_length + 1 bytes tell "exactly at the limit" from "over it" without inflating a bomb.
        data = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise PayloadError(f"body declared Content-Encoding {coding} but is not {coding} data: {exc}") from exc
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"decompressed body is over the limit of {max_bytes} bytes")
    if not inflater.eof:
        raise PayloadError(f"{coding} body is truncated: the compressed stream does not end")
    return data


def decode(payload: bytes, encoding: Encoding) -> ExportTraceServiceRequest:
    """Parse an uncompressed payload; PayloadError says what was wrong and where."""
    if encoding.name == "protobuf":
        return _decode_protobuf(payload)
    return _decode_json(payload)


def _decode_protobuf(payload: bytes) -> ExportTraceServiceRequest:
    try:
        return ExportTraceServiceRequest.FromString(payload)
    except DecodeError as exc:
        raise PayloadError(f"body is not a valid OTLP ExportTraceServiceRequest protobuf: {exc}") from exc


def _decode_json(payload: bytes) -> ExportTraceServiceRequest:
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PayloadError(f"JSON body is not valid UTF-8 at byte {exc.start}") from exc
    try:
        document = _JSON.decode(text)
    except _BareConstant:
        raise PayloadError(f"JSON is not an OTLP ExportTraceServiceRequest: {_unrepresentable(text)}") from None
    except json.JSONDecodeError as exc:
        raise PayloadError(f"body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except RecursionError:
        raise PayloadError("JSON body is nested too deeply to decode") from None
    if not isinstance(document, dict):
        raise PayloadError(f"OTLP JSON must be an object, received {type(document).__name__}")
    _hex_ids_to_base64(document)
    try:
        return json_format.ParseDict(document, ExportTraceServiceRequest(), ignore_unknown_fields=True,
                                     max_recursion_depth=_MAX_DEPTH)
    except json_format.ParseError as exc:
        raise PayloadError(f"JSON is not an OTLP ExportTraceServiceRequest: {_first_line(exc)}") from exc
    except RecursionError:
        raise PayloadError(f"JSON body is nested deeper than {_MAX_DEPTH} messages") from None
    except (SystemError, OverflowError, ValueError) as exc:
        # json_format's own failures on what no protobuf field holds: a lone surrogate as an object key
        # (SystemError) and a number beyond a double's range in an integer field (OverflowError).
        found = _unrepresentable(text)
        if found is None:
            raise
        raise PayloadError(f"JSON is not an OTLP ExportTraceServiceRequest: {found}") from exc


class _BareConstant(ValueError):
    """A bare NaN, Infinity or -Infinity: JSON has no such numbers (RFC 8259 section 6), and
    protobuf's JSON mapping writes non-finite doubles as the strings "NaN", "Infinity", "-Infinity"."""


def _refuse_constant(name: str):
    raise _BareConstant(name)


#: The JSON reader of bodies: Python's, less the bare constants (which json_format refuses as doubles,
#: stores as 0 in an enum, or fails on with an OverflowError).
_JSON = json.JSONDecoder(parse_constant=_refuse_constant)


class _NonFinite:
    """A number literal that is not a finite double, as the body wrote it."""

    def __init__(self, literal: str):
        self.literal = literal


def _number(literal: str) -> float | _NonFinite:
    value = float(literal)
    return value if math.isfinite(value) else _NonFinite(literal)


def _unrepresentable(text: str) -> str | None:
    """Where a body that parses as JSON holds what no protobuf field can (the first, in document
    order), and what: a number that is not a finite double, or a lone surrogate escape (a string
    must be Unicode text to be UTF-8 on the wire). None when there is none. Only on the error path."""
    stack: list[tuple[object, str]] = [(json.loads(text, parse_float=_number, parse_constant=_NonFinite), "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, _NonFinite):
            return (f"{where} is {value.literal}, not a finite number (protobuf's JSON writes a double's NaN or "
                    f"infinity as the string \"NaN\", \"Infinity\" or \"-Infinity\")")
        if isinstance(value, str) and _lone_surrogate(value):
            return f"{where} holds a lone surrogate escape ({_shown(value)}): strings must be Unicode text"
        if isinstance(value, list):
            stack.extend((item, f"{where}[{i}]") for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            for key in value:
                if _lone_surrogate(key):
                    return (f"{where or 'the body'} has a key with a lone surrogate escape ({_shown(key)}): "
                            "strings must be Unicode text")
            stack.extend((item, f"{where}.{key}" if where else key) for key, item in reversed(value.items()))
    return None


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _shown(text: str) -> str:
    """A string as ASCII, escapes written out, cut to 40 characters: safe in any answer."""
    return text[:40].encode("ascii", "backslashreplace").decode("ascii")


def _hex_ids_to_base64(document: dict) -> None:
    """OTLP JSON carries ids as hex; protobuf's JSON mapping expects base64 for bytes fields."""
    for r, resource_spans in enumerate(_items(document, "resourceSpans", "resource_spans")):
        for s, scope_spans in enumerate(_items(resource_spans, "scopeSpans", "scope_spans")):
            for n, span in enumerate(_items(scope_spans, "spans")):
                where = f"resourceSpans[{r}].scopeSpans[{s}].spans[{n}]"
                _convert_ids(span, where)
                for k, link in enumerate(_items(span, "links")):
                    _convert_ids(link, f"{where}.links[{k}]")


def _items(parent: object, *keys: str) -> list:
    if not isinstance(parent, dict):
        return []
    for key in keys:
        value = parent.get(key)
        if isinstance(value, list):
            return value
    return []


def _convert_ids(holder: object, where: str) -> None:
    if not isinstance(holder, dict):
        return
    for camel, _size in _ID_FIELDS:
        snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
        for key in (camel, snake):
            value = holder.get(key)
            if isinstance(value, str) and value:
                try:
                    raw = binascii.unhexlify(value)
                except (binascii.Error, ValueError) as exc:
                    raise PayloadError(f"{where}.{key} must be hex, received {value[:40]!r}") from exc
                holder[key] = base64.b64encode(raw).decode("ascii")


def encode_response(encoding: Encoding, rejected_spans: int = 0, message: str = "") -> bytes:
    """An ExportTraceServiceResponse; partial_success is set only when there is something to say."""
    response = ExportTraceServiceResponse()
    if rejected_spans or message:
        response.partial_success.rejected_spans = rejected_spans
        response.partial_success.error_message = message
    if encoding.name == "protobuf":
        return response.SerializeToString()
    return json_format.MessageToJson(response, indent=None).encode("utf-8")

"""Who may call the engine: CORS headers as mlx_lm.server sends them, and the optional API key.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which would buffer nothing but
adds a task per request, and not ``CORSMiddleware``, which answers a bare OPTIONS with 405 where
mlx_lm.server answers 204).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

#: Paths that answer without the API key (load balancers probe them).
OPEN_PATHS = ("/health",)


class AccessMiddleware:
    """CORS on every response, 204 to every OPTIONS, 401 without the API key when one is set."""

    def __init__(self, app: Any, origins: list[str], api_key: str | None = None):
        self.app = app
        self.origins = origins
        self.api_key = api_key

    def cors_headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """mlx_lm.server's: ``*`` when allowed, else the request's origin when listed (with Vary)."""
        headers = []
        if "*" in self.origins:
            headers.append((b"access-control-allow-origin", b"*"))
        elif origin is not None and origin.decode("latin-1") in self.origins:
            headers += [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        return [*headers, (b"access-control-allow-methods", b"*"), (b"access-control-allow-headers", b"*")]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        cors = self.cors_headers(headers.get(b"origin"))
        if scope["method"] == "OPTIONS":
            await _answer(send, 204, cors, b"")
            return
        if self.api_key and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            body = json.dumps({"error": {"message": "Invalid or missing API key: send 'Authorization: Bearer KEY' "
                                                    "with the engine's --api-key", "type": "invalid_request_error",
                                         "param": None, "code": "invalid_api_key"}}).encode()
            await _answer(send, 401, [*cors, (b"content-type", b"application/json"),
                                      (b"www-authenticate", b"Bearer")], body)
            return

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, key = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())


async def _answer(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

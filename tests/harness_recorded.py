"""A real local HTTP server that answers with recorded engine documents (tests/fixtures/engines/*.json),
for the engines that cannot be installed here (Ollama, Exo, SGLang, LM Studio): the adapters' own HTTP
code runs against it over loopback. Each fixture file is ``{"source": where the shapes come from,
"documents": {"METHOD /path[ variant]": document}}``; a test picks which variant a path answers with,
and may switch it between polls (a model unloading, a runner finishing its load).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "engines"


def load(engine: str) -> dict[str, Any]:
    """A fixture file by engine name; its ``source`` names the documentation or source it follows."""
    fixture = json.loads((FIXTURES / f"{engine}.json").read_text(encoding="utf-8"))
    assert fixture["source"], f"{engine}.json must cite where its shapes come from"
    return fixture


class RecordedEngine:
    """Serves ``routes``: {"METHOD /path": (status, document)}; ``/metrics`` and empty bodies as text,
    a list of Ollama documents as NDJSON (one a line), anything else as JSON. Unknown routes: 404."""

    def __init__(self, routes: dict[str, tuple[int, Any]] | None = None):
        self.routes: dict[str, tuple[int, Any]] = dict(routes or {})
        self.requests: list[tuple[str, str, bytes]] = []  #: (method, path, body) received
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                owner.requests.append((self.command, self.path, body))
                status, document = owner.routes.get(f"{self.command} {self.path.split('?')[0]}", (404, None))
                if document is None:
                    payload, kind = json.dumps({"error": "not found"}).encode(), "application/json"
                elif isinstance(document, str) and (self.path.endswith("/metrics") or not document):
                    payload, kind = document.encode(), "text/plain; version=0.0.4"
                elif isinstance(document, list) and document and isinstance(document[0], dict) \
                        and "done" in document[0]:
                    payload = b"".join(json.dumps(d).encode() + b"\n" for d in document)
                    kind = "application/x-ndjson"
                else:
                    payload, kind = json.dumps(document).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def serve(self, key: str, document: Any, status: int = 200) -> None:
        """Answer ``key`` ("METHOD /path") with ``document`` from now on."""
        self.routes[key] = (status, document)

    def __enter__(self) -> RecordedEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

"""The dashboard's router: every page (importing a page module registers it and its JSON twin),
static files, and the Perfetto export API used by ``tokentrace export perfetto --url``."""

from __future__ import annotations

from fastapi import Request, Response

from tokentrace.dashboards import (  # noqa: F401 (pages)
    advice_page,
    cache_page,
    instances,
    overview,
    request_page,
    session_page,
    timeline,
)
from tokentrace.dashboards.perfetto import perfetto_trace
from tokentrace.dashboards.web import json_response, router
from tokentrace.window import since_ns

__all__ = ["router"]


@router.get("/api/export/perfetto", include_in_schema=False)
def export_perfetto(request: Request, request_id: str | None = None, since: str = "15m") -> Response:
    """Chrome trace-event JSON of one request, or of the requests that started in the window."""
    window = None if request_id else since_ns(since, what="since")
    return json_response(perfetto_trace(request.app.state.reader, request_id=request_id, since_ns=window))

"""``/sessions/{id}``: one session's turns. Per turn its gap since the previous turn, TTFT, prompt and
cached tokens, both verdicts and whether the cache survived the gap (and if not, what took it); per
instance, the gap beyond which follow-up turns come back to a cold cache (analyzers/session.py).

An unknown session id is a 404 page, and a 404 JSON envelope on the twin.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from tokentrace.analyzers.session import analyze_session
from tokentrace.dashboards.web import page


@page("/sessions/{session_id:path}", "session.html", "Session")
def session_page(request: Request, session_id: str) -> dict[str, Any]:
    """One session's page and its twin ``/sessions/{id}.json``."""
    verdict = analyze_session(request.app.state.reader, session_id).as_dict()
    turns = verdict["turns"]
    verdict["charts"] = {"turns": {
        "kind": "line", "x_type": "index", "unit": "ms", "x": [t["turn"] for t in turns],
        "series": [{"name": "TTFT", "y": [t["ttft_ms"] for t in turns]},
                   {"name": "gap before the turn", "y": [t["gap_ms"] for t in turns]}],
        "empty": "no turns"}}
    return verdict

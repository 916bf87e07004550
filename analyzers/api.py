"""The verdicts over HTTP, served by the collector:

    GET /api/requests/{id}/slow     slowness verdict
    GET /api/requests/{id}/cache    cache verdict
    GET /api/requests/{id}/verdict  both: {"slow": ..., "cache": ...}
    GET /api/sessions/{id}          the session verdict: turns, gaps, whether the cache survived
    GET /api/report?since=15m       the window report (or ?from=&until= absolute times; &instance=,
                                    &model=, &session=, &request_prefix= for a slice)
    GET /api/advice?since=1h        the changes that would save the most (analyzers/advise.py; the
                                    report's window and slice parameters, &verdicts=)
    GET /api/workload?since=1h      the window's traffic as whatif replays it (analyzers/workload.py;
                                    the report's window and slice parameters)

``?slo=ttft=2s,...`` on slow, verdict and report judges against those objectives instead of the
collector's ``--slo`` (docs/metrics.md).

Errors use the collector's JSON envelope: 404 for an unknown request id, 400 for a bad parameter.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from tokentrace.analyzers.advise import MAX_VERDICTS, advise
from tokentrace.analyzers.cache import analyze_cache
from tokentrace.analyzers.report import summarize
from tokentrace.analyzers.session import analyze_session
from tokentrace.analyzers.slo import SloSpec, parse_slo
from tokentrace.analyzers.slowness import analyze_slowness
from tokentrace.analyzers.workload import load_workload
from tokentrace.window import Slice, window_ns

router = APIRouter(prefix="/api")
#: Most cache misses one report explains (each costs a cache verdict).
MAX_CAUSE_SAMPLE = 100_000


def objectives(request: Request, slo: str | None) -> SloSpec | None:
    """``?slo=`` when given, else the collector's ``--slo``."""
    if slo is not None:
        return parse_slo(slo)
    collector = getattr(request.app.state, "collector", None)
    return getattr(collector.config, "slo", None) if collector is not None else None


@router.get("/requests/{request_id:path}/slow")
def slow_verdict(request_id: str, request: Request, slo: str | None = None) -> dict:
    """The slowness verdict of one request."""
    return analyze_slowness(request.app.state.reader, request_id, objectives(request, slo)).as_dict()


@router.get("/requests/{request_id:path}/cache")
def cache_verdict(request_id: str, request: Request) -> dict:
    """The cache verdict of one request."""
    return analyze_cache(request.app.state.reader, request_id).as_dict()


@router.get("/requests/{request_id:path}/verdict")
def both_verdicts(request_id: str, request: Request, slo: str | None = None) -> dict:
    """Both verdicts of one request."""
    reader = request.app.state.reader
    slow, cache = analyze_slowness(reader, request_id, objectives(request, slo)), analyze_cache(reader, request_id)
    return {"slow": slow.as_dict(), "cache": cache.as_dict()}


@router.get("/sessions/{session_id:path}")
def session_verdict(session_id: str, request: Request) -> dict:
    """The session verdict of one session id."""
    return analyze_session(request.app.state.reader, session_id).as_dict()


@router.get("/report")
def window_report(request: Request, since: str | None = None, start: str | None = Query(None, alias="from"),
                  until: str | None = None, instance: str | None = None, model: str | None = None,
                  session: str | None = None, request_prefix: str | None = None,
                  causes: int = Query(25, ge=0, le=MAX_CAUSE_SAMPLE), slo: str | None = None) -> dict:
    """The report over requests that started in the last ``since`` (or 'all'; default 15m), or from
    ``from`` until ``until`` (absolute times), of one instance, model, session or request-id prefix,
    explaining the cache misses of at most ``causes`` of them."""
    first, last = window_ns(since, start, until, default_since="15m", names=("since", "from", "until"))
    where = Slice(instance, model, session, request_prefix)
    return summarize(request.app.state.reader, first, last, cause_sample=causes, slo=objectives(request, slo),
                     where=where).as_dict()


@router.get("/advice")
def window_advice(request: Request, since: str | None = None, start: str | None = Query(None, alias="from"),
                  until: str | None = None, instance: str | None = None, model: str | None = None,
                  session: str | None = None, request_prefix: str | None = None,
                  verdicts: int = Query(MAX_VERDICTS, ge=0, le=MAX_CAUSE_SAMPLE), slo: str | None = None) -> dict:
    """The advice over requests that started in the last ``since`` (default 1h), or from ``from``
    until ``until``, of one instance, model, session or request-id prefix, explaining at most
    ``verdicts`` cache misses."""
    first, last = window_ns(since, start, until, default_since="1h", names=("since", "from", "until"))
    return advise(request.app.state.reader, first, last, Slice(instance, model, session, request_prefix),
                  objectives(request, slo), verdicts)


@router.get("/workload")
def window_workload(request: Request, since: str | None = None, start: str | None = Query(None, alias="from"),
                    until: str | None = None, instance: str | None = None, model: str | None = None,
                    session: str | None = None, request_prefix: str | None = None) -> dict:
    """The requests that started in the last ``since`` (default 1h), or from ``from`` until ``until``,
    of one instance, model, session or request-id prefix, with their prompt block ids, for whatif."""
    first, last = window_ns(since, start, until, default_since="1h", names=("since", "from", "until"))
    return load_workload(request.app.state.reader, first, last,
                         where=Slice(instance, model, session, request_prefix)).as_dict()

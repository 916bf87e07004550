"""``/advice``: the changes that would save the most over the window, best first (``analyze advise``;
analyzers/advise.py), each with what it would have saved, the evidence, the other changes of its kind
and the requests it rests on (links). The window and slice parameters are the overview's.

Advice replays the window's traffic and explains up to ``MAX_VERDICTS`` misses: seconds on a busy
store, too much to redo on every refresh of a live page. The pages therefore share the cache
verdicts the overview already remembers (``causes.remembered_verdict``), and remember each window's
advice for ``TTL_S`` seconds (the page says when it was computed); ``/api/advice`` and the command
line compute it afresh.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from fastapi import Query, Request

from tokentrace.analyzers.advise import MAX_VERDICTS, advise
from tokentrace.analyzers.render import ADVICE_KINDS
from tokentrace.analyzers.slo import SloSpec
from tokentrace.collector.stores.store import TraceReader
from tokentrace.dashboards.causes import remembered_verdict
from tokentrace.dashboards.web import page
from tokentrace.window import Slice, window_ns

#: How long a window's advice is reused by the pages.
TTL_S = 30.0
_REMEMBERED = 64
_memo: OrderedDict[tuple, tuple[float, dict[str, Any]]] = OrderedDict()
_lock = threading.Lock()


def remembered_advice(reader: TraceReader, since: str | None, start: str | None, until: str | None, where: Slice,
                      slo: SloSpec | None, max_verdicts: int = MAX_VERDICTS) -> dict[str, Any]:
    """The advice over the window (the pages' parameters: ``since`` or ``start``/``until``, default
    the last 15 minutes), computed at most every ``TTL_S`` seconds per window, slice, objectives and
    verdict count."""
    since_ns, until_ns = window_ns(since, start, until, default_since="15m", names=("since", "from", "until"))
    key = (id(reader), since, start, until, where, getattr(slo, "text", None), max_verdicts)
    now = time.monotonic()
    with _lock:
        hit = _memo.get(key)
        if hit and now - hit[0] < TTL_S:
            return hit[1]
    result = advise(reader, since_ns, until_ns, where, slo, max_verdicts, verdict_of=remembered_verdict)
    result["computed_at_ns"] = time.time_ns()
    with _lock:
        _memo[key] = (now, result)
        while len(_memo) > _REMEMBERED:
            _memo.popitem(last=False)
    return result


@page("/advice", "advice.html", "Advice")
def advice_page(request: Request, since: str | None = None, start: str | None = Query(None, alias="from"),
                until: str | None = None, instance: str | None = None, model: str | None = None,
                session: str | None = None, request_prefix: str | None = None) -> dict[str, Any]:
    """The advice page and its twin ``/advice.json``: {"advice": analyze advise's JSON, "kinds": names}."""
    collector = getattr(request.app.state, "collector", None)
    slo = getattr(collector.config, "slo", None) if collector is not None else None
    where = Slice(instance, model, session, request_prefix)
    return {"advice": remembered_advice(request.app.state.reader, since, start, until, where, slo),
            "kinds": ADVICE_KINDS}

"""How dashboard pages are served: a view function returns a JSON-ready dict; the page at ``PATH``
renders it with a Jinja template and its twin at ``PATH.json`` returns the same dict as JSON.

Templates are autoescaped (session ids and prompt snippets are user text) and do no arithmetic:
views compute every number and the template filters below only format them. Static files (CSS and
the canvas renderers) are served from the package: nothing is fetched from a CDN.
"""

from __future__ import annotations

import functools
import re
import time
import urllib.parse
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup, escape

from tokentrace import __version__, wire
from tokentrace.analyzers.evidence import baseline_text, fmt_bytes, fmt_ms, plural
from tokentrace.errors import ConfigError, NotFound, TokentraceError

router = APIRouter()
_STATIC = resources.files("tokentrace.dashboards") / "static"
_MAX_NAME_BYTES = 255
_MEDIA = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
#: Pages in the navigation bar: (path, label).
NAV = (("/", "Overview"), ("/advice", "Advice"), ("/timeline", "Timeline"), ("/cache", "Cache"),
       ("/instances", "Instances"))
#: Window lengths offered by the window picker.
WINDOWS = ("5m", "15m", "1h", "6h", "1d", "all")


def fmt_pct(value: float | None) -> str:
    """0.4567 -> '45.7 %'; None -> 'n/a'."""
    return "n/a" if value is None else f"{value * 100:.1f} %"


def fmt_num(value: float | None, digits: int = 0) -> str:
    """Thousands separators; None -> 'n/a'."""
    return "n/a" if value is None else f"{value:,.{digits}f}"


def fmt_clock(ns: int | None) -> str:
    """Epoch nanoseconds -> 'HH:MM:SS.mmm UTC' (the store's clock is UTC)."""
    if ns is None:
        return "n/a"
    seconds = ns / 1e9
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(ns // 1_000_000 % 1000):03d}"


def fmt_age(seconds: float | None) -> str:
    """12.3 -> '12 s ago'; 4000 -> '1.1 h ago'."""
    if seconds is None:
        return "never"
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def unit_plural(unit: str | None) -> str:
    """A cache unit (tokentrace.cache.unit) as a column label: 'block' -> 'blocks'; None -> 'entries
    (unit unknown)', for engines that predate the unit."""
    if unit is None:
        return "entries (unit unknown)"
    return "entries" if unit == "entry" else f"{unit}s"


def share_pct(share: float | None) -> str:
    """A 0..1 share as a CSS width, clamped: '45.60%'."""
    return f"{min(1.0, max(0.0, share or 0.0)) * 100:.2f}%"


def quote_path(value: Any) -> str:
    """One URL path segment (a request id may hold '/', '?' or '#')."""
    return urllib.parse.quote(str(value), safe="")


def _named_requests(item: dict) -> set[str]:
    """The request ids an evidence item's data names (request_id, entry_request_id, evicted_by, ...)."""
    ids: set[str] = set()
    for key, value in item.items():
        if key.endswith("request_id") or key == "evicted_by":
            values = [value]
        elif key.endswith("request_ids") and isinstance(value, list):
            values = value
        else:
            continue
        ids.update(v for v in values if isinstance(v, str) and v)
    return ids


def evidence_text(item: dict) -> Markup:
    """An evidence item's sentence, escaped, with every request id its data names made a link to that
    request's page (one pass, longest id first, whole ids only: "req-1" is not linked inside "req-10")."""
    text = str(escape(item["text"]))
    ids = sorted((str(escape(rid)) for rid in _named_requests(item)), key=len, reverse=True)
    if not ids:
        return Markup(text)
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, ids)) + r")(?![\w-])")
    by_escaped = {str(escape(rid)): rid for rid in _named_requests(item)}
    return Markup(pattern.sub(lambda m: f'<a class="request-link" href="/requests/{quote_path(by_escaped[m[1]])}">'
                                        f"{m[1]}</a>", text))


def dumps(data: Any) -> str:
    """Compact JSON for twins and embedded page data; NaN becomes null rather than invalid JSON."""
    return wire.dumps(data, default=str)


_ENV = Environment(
    loader=PackageLoader("tokentrace.dashboards", "templates"),
    autoescape=True,  # every template is HTML and renders user text
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_ENV.filters.update(ms=fmt_ms, bytes=fmt_bytes, pct=fmt_pct, num=fmt_num, clock=fmt_clock, age=fmt_age,
                    q=quote_path, unit_plural=unit_plural, baseline=baseline_text,
                    plural=plural, evidence_text=evidence_text)
_ENV.globals.update(nav=NAV, windows=WINDOWS, version=__version__, share_pct=share_pct)
# tojson escapes <, >, & and ' for HTML on top of this function's output (jinja2.utils.htmlsafe_json_dumps).
_ENV.policies["json.dumps_function"] = dumps
_ENV.policies["json.dumps_kwargs"] = {}


def json_response(data: dict, status: int = 200) -> Response:
    """A JSON response of ``dumps``."""
    return Response(dumps(data), status, media_type="application/json")


#: Query parameters of a slice (``window.Slice``), and of a window: links between pages carry both,
#: the window picker the slice (it chooses the window).
SLICE_PARAMS = ("instance", "model", "session", "request_prefix")
WINDOW_PARAMS = ("since", "from", "until")


def render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """A template rendered with the page context (query string kept for links and the window picker)."""
    query = dict(request.query_params)
    since = query.get("since", "15m")
    slice_kept = {key: query[key] for key in SLICE_PARAMS if query.get(key)}
    window = {key: query[key] for key in WINDOW_PARAMS if query.get(key)} or {"since": since}
    html = _ENV.get_template(template).render(
        path=request.url.path, query=query, since=since, slice_kept=slice_kept,
        carried=urllib.parse.urlencode({**window, **slice_kept}), **context)
    return HTMLResponse(html, status_code)


def page(path: str, template: str, title: str):
    """Register ``view`` at ``path`` (HTML) and ``path + '.json'`` (its JSON twin).

    ``view`` takes FastAPI parameters (``request: Request`` first) and returns a JSON-ready dict.
    Errors: the page shows a TokentraceError with the status and heading its class carries
    (core/errors.py: NotFound 404, ConfigError 400, StoreError 503); the twin answers them with the
    collector's JSON error envelope.
    """

    def register(view):
        @functools.wraps(view)
        def twin(*args, **kwargs) -> Response:
            return json_response(view(*args, **kwargs))

        @functools.wraps(view)
        def html(*args, **kwargs) -> HTMLResponse:
            request = kwargs["request"]
            try:
                data = view(*args, **kwargs)
            except TokentraceError as exc:
                status = exc.http_status
                return render(request, "error.html", status, title=exc.title, status=status, message=str(exc),
                              twin=None)
            return render(request, template, title=title, data=data, twin=request.url.path + ".json")

        # The twin first: "/requests/{id}" would otherwise also match "/requests/abc.json".
        router.add_api_route(path + ".json", twin, methods=["GET"], name=f"{view.__name__}_json",
                             include_in_schema=False)
        router.add_api_route(path, html, methods=["GET"], name=view.__name__, response_class=HTMLResponse,
                             include_in_schema=False)
        return view

    return register


@router.get("/static/{name}", include_in_schema=False)
def static(name: str) -> Response:
    """A file of the package's static folder (CSS, JS); 404 for anything else."""
    if len(name.encode()) > _MAX_NAME_BYTES:  # the file system would refuse it (ENAMETOOLONG)
        raise ConfigError(f"a static file name has at most {_MAX_NAME_BYTES} bytes, received {len(name.encode())}")
    entry = _STATIC / name
    suffix = name[name.rfind("."):] if "." in name else ""
    if "/" in name or "\0" in name or suffix not in _MEDIA or not entry.is_file():
        raise NotFound(f"no static file named {name!r}")
    return Response(entry.read_bytes(), media_type=_MEDIA[suffix], headers={"Cache-Control": "max-age=300"})

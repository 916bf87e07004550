"""Verdicts from the command line: ``tokentrace analyze slow|cache|session|report``.

Asks a running collector (``--url``, default http://127.0.0.1:4318) or reads a DuckDB file directly
(``--db``) when no collector holds it. Both paths produce the same JSON, rendered the same way;
``--json`` prints it as one object. Exit 0 with a verdict, 2 on bad input (unknown request id).
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.parse

from tokentrace.errors import ConfigError, TokentraceError, error_for_status

DEFAULT_URL = "http://127.0.0.1:4318"
#: The window of a report and of advice when none is given.
_DEFAULT_SINCE = {"report": "15m", "advise": "1h"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands slow, cache, report with their options."""
    sub = parser.add_subparsers(dest="analysis", metavar="ANALYSIS")
    sub.required = True
    for name, help_text in (("slow", "why was this request slow: cold_start, queueing, prefill or decode"),
                            ("cache", "why did this request's prefix-cache lookup miss")):
        one = sub.add_parser(name, help=help_text, description=help_text)
        one.add_argument("--request-id", required=True, help="the request's id (X-Request-Id)")
        _analysis_options(one)
        if name == "slow":
            _slo_option(one)
    session = sub.add_parser("session", help="an agent session's turns: gaps, verdicts, whether the cache survived",
                             description="Each turn of a session with its gap, both verdicts and whether the cache "
                                         "survived the gap; per instance, the gap beyond which turns come back cold.")
    session.add_argument("--session-id", required=True, help="the session's id (X-Session-Id or the OpenAI user field)")
    _analysis_options(session)
    report = sub.add_parser("report", help="counts per category and cause, slowest requests, percentiles",
                            description="A summary of the requests that started in the window.")
    report.add_argument("--since", default=None, help="window length, ending now: 30s, 15m, 1h, 2d or 'all' "
                                                      "(default 15m, unless --from or --until is given)")
    add_slice_options(report)
    report.add_argument("--causes", type=int, default=25, help="latest misses to compute causes for (default 25)")
    _analysis_options(report)
    _slo_option(report)
    advise = sub.add_parser("advise", help="the changes that would save the most: context, routing, capacity, "
                                           "concurrency, cold starts; what each would have saved",
                            description="Over the window, the few changes that would matter most (the prompt's "
                                        "context, routing, cache capacity, concurrency, cold starts and restarts), "
                                        "ranked by the waiting before the first token each would have saved, with "
                                        "evidence and the requests it rests on (docs/analyzers.md).")
    advise.add_argument("--since", default=None, help="window length, ending now: 30s, 15m, 1h, 2d or 'all' "
                                                      "(default 1h, unless --from or --until is given)")
    add_slice_options(advise)
    advise.add_argument("--verdicts", type=int, default=None,
                        help="latest cache misses to explain (default 400; each costs a cache verdict)")
    _analysis_options(advise)
    _slo_option(advise)


def add_slice_options(parser: argparse.ArgumentParser) -> None:
    """--from/--until (an absolute window: a benchmark run's) and the slice filters."""
    parser.add_argument("--from", dest="start", default=None, metavar="TIME",
                        help="window start: ISO 8601 (2026-12-05T20:00:00Z; UTC without an offset) or epoch seconds")
    parser.add_argument("--until", default=None, metavar="TIME", help="window end (exclusive), as --from")
    parser.add_argument("--instance", default=None, help="only this instance's requests")
    parser.add_argument("--model", default=None, help="only this model's requests")
    parser.add_argument("--session", default=None, help="only this session's requests")
    parser.add_argument("--request-prefix", default=None, metavar="PREFIX",
                        help="only requests whose id starts with PREFIX (a benchmark's run)")


def window_and_slice(args: argparse.Namespace, default_since: str) -> tuple[tuple[int | None, int | None], dict]:
    """The window of --since or --from/--until (bad input fails here, before any store is opened or
    request sent), and those options with the slice's as the API's query parameters (those given)."""
    from tokentrace.window import window_ns

    window = window_ns(args.since, args.start, args.until, default_since=default_since)
    given = {"since": args.since, "from": args.start, "until": args.until, "instance": args.instance,
             "model": args.model, "session": args.session, "request_prefix": args.request_prefix}
    return window, {key: value for key, value in given.items() if value is not None}


def slice_from(args: argparse.Namespace):
    """The slice options as a ``tokentrace.window.Slice``."""
    from tokentrace.window import Slice

    return Slice(args.instance, args.model, args.session, args.request_prefix)


def _slo_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slo", default=None,
                        help="objectives to judge against, e.g. ttft=2s,tpot=50ms; ttft is the client's time to first "
                             "content, first_token the engine's time to first token (default: the collector's --slo; "
                             "docs/metrics.md)")


def add_source_options(parser: argparse.ArgumentParser) -> None:
    """--url | --db and --token: where the data comes from (shared with ``tokentrace export``)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--url", default=None, help=f"collector to ask (default {DEFAULT_URL})")
    source.add_argument("--db", default=None, help="DuckDB store file to read directly (collector stopped)")
    parser.add_argument("--token", default=None, help="bearer token of the collector (env TOKENTRACE_TOKEN)")


def _analysis_options(parser: argparse.ArgumentParser) -> None:
    add_source_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    """Compute or fetch the verdict, then print it."""
    if args.analysis == "report" and args.causes < 0:
        raise ConfigError(f"--causes must be 0 or more, received {args.causes}")
    if args.analysis == "advise" and args.verdicts is not None and args.verdicts < 0:
        raise ConfigError(f"--verdicts must be 0 or more, received {args.verdicts}")
    if getattr(args, "slo", None) is not None:
        from tokentrace.analyzers.slo import parse_slo

        parse_slo(args.slo)  # a bad spec fails here, in one line, before any request
    result = _from_db(args) if args.db else _from_url(args)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        from tokentrace.analyzers.render import render

        print(render(args.analysis, result))
    args._quick_exit = True  # printed; nothing of ours is left open (the store is closed)
    return 0


def _from_db(args: argparse.Namespace) -> dict:
    # Each analysis imports its own module: slow and cache read rows (no polars, no pyarrow: their
    # start-up is duckdb's); session and report build frames (issue 17).
    from tokentrace.analyzers.slo import parse_slo
    from tokentrace.collector.stores.store_duckdb import DuckDBStore

    slo = parse_slo(getattr(args, "slo", None))
    if args.analysis in ("report", "advise"):
        window, _ = window_and_slice(args, _DEFAULT_SINCE[args.analysis])
    store = DuckDBStore(args.db, read_only=True)
    try:
        if args.analysis == "slow":
            from tokentrace.analyzers.slowness import analyze_slowness

            result = analyze_slowness(store, args.request_id, slo).as_dict()
        elif args.analysis == "cache":
            from tokentrace.analyzers.cache import analyze_cache

            result = analyze_cache(store, args.request_id).as_dict()
        elif args.analysis == "session":
            from tokentrace.analyzers.session import analyze_session

            result = analyze_session(store, args.session_id).as_dict()
        elif args.analysis == "advise":
            from tokentrace.analyzers.advise import MAX_VERDICTS, advise

            result = advise(store, *window, where=slice_from(args), slo=slo,
                            max_verdicts=MAX_VERDICTS if args.verdicts is None else args.verdicts)
        else:
            from tokentrace.analyzers.report import summarize

            result = summarize(store, *window, cause_sample=args.causes, slo=slo, where=slice_from(args)).as_dict()
    finally:
        store.close()
    return json.loads(json.dumps(result))  # the same types the HTTP path yields


def _from_url(args: argparse.Namespace) -> dict:
    slo = {"slo": args.slo} if getattr(args, "slo", None) is not None else {}
    if args.analysis == "report":
        _, given = window_and_slice(args, "15m")
        path = "/api/report?" + urllib.parse.urlencode({**given, "causes": args.causes, **slo})
    elif args.analysis == "advise":
        _, given = window_and_slice(args, _DEFAULT_SINCE["advise"])
        verdicts = {} if args.verdicts is None else {"verdicts": args.verdicts}
        path = "/api/advice?" + urllib.parse.urlencode({**given, **verdicts, **slo})
    elif args.analysis == "session":
        path = f"/api/sessions/{urllib.parse.quote(args.session_id, safe='')}"
    else:
        path = f"/api/requests/{urllib.parse.quote(args.request_id, safe='')}/{args.analysis}"
        path += "?" + urllib.parse.urlencode(slo) if slo else ""
    return fetch_json(args, path)


def collector_url(given: str | None) -> str:
    """``--url`` (or TOKENTRACE_URL) as a base URL; ``host:port`` without a scheme means http://."""
    base = (given or os.environ.get("TOKENTRACE_URL") or DEFAULT_URL).strip().rstrip("/")
    if "://" not in base:
        base = "http://" + base
    scheme = base.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ConfigError(f"--url must be an http:// or https:// address such as {DEFAULT_URL}, received {given!r}")
    return base


def fetch_json(args: argparse.Namespace, path: str) -> dict:
    """GET ``path`` from the collector of ``--url`` (with ``--token``); envelope errors become ours."""
    import urllib.error  # here, not at the top: ``--db`` needs no HTTP client
    import urllib.request

    base = collector_url(args.url)
    request = urllib.request.Request(base + path, headers={"Accept": "application/json"})
    token = args.token or os.environ.get("TOKENTRACE_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        message = _envelope_message(exc)
        if exc.code >= 500:
            message = f"the collector at {base} answered {exc.code}: {message}"
        raise error_for_status(exc.code, message) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TokentraceError(f"cannot reach the collector at {base} ({reason}); start it, or read a stopped "
                              "collector's file with --db FILE") from None


def _envelope_message(exc) -> str:  # urllib.error.HTTPError
    try:
        return json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {exc.code}"

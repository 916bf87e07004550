"""Compact human text for verdict and report dicts (the JSON the API and ``--json`` return)."""

from __future__ import annotations

from tokentrace.analyzers.evidence import NO_CAUSE, baseline_text, fmt_ms, plural

_BAR = 24


def render(kind: str, result: dict) -> str:
    """Text for ``slow``, ``cache``, ``session``, ``report`` or ``advise``."""
    return {"slow": render_slow, "cache": render_cache, "session": render_session,
            "report": render_report, "advise": render_advice}[kind](result)


def _abnormal(verdict: dict) -> str:
    base = verdict["baseline"]
    if not base:
        return "abnormal: not judged"
    if verdict["abnormal"] is None:
        return f"abnormal: unknown ({baseline_text(base).rstrip('.')})"
    judged = "yes" if verdict["abnormal"] else "no"
    return f"abnormal: {judged} ({baseline_text(base).rstrip('.')})"


def render_slow(verdict: dict) -> str:
    """The slowness verdict as a few lines and a bar per phase."""
    parts = verdict["breakdown_ms"]
    lines = [f"request {verdict['request_id']} on {verdict['instance_id']} ({verdict['engine'] or 'unknown engine'})"]
    if verdict["outcome"] != "completed":
        lines.append(f"outcome: {verdict['outcome']} · no category")
    else:
        lines.append(f"category: {verdict['category']} · ttft category: {verdict['ttft_category']} · "
                     f"{_abnormal(verdict)}")
    total = max(parts["e2e"] or 0.0, 1e-9)
    # The most an unknown phase can be (docs/analyzers.md: a part that cannot be the largest ...).
    bounds = next((item["at_most_ms"] for item in verdict["evidence"] if item.get("at_most_ms")), {})
    for name in ("load_wait", "queue", "prefill", "decode", "other"):
        value = parts[name]
        bar = "█" * round(_BAR * value / total) if value is not None else (
            f"unknown, at most {fmt_ms(bounds[name])}" if bounds.get(name) is not None else "unknown")
        lines.append(f"  {name:<10}{fmt_ms(value):>11}  {bar}")
    lines.append(f"  time to first token (engine) {fmt_ms(parts['ttft'])} · time to first content (client) "
                 f"{fmt_ms(parts.get('first_content'))} · tpot {fmt_ms(parts['tpot'])} · e2e {fmt_ms(parts['e2e'])}")
    for missed in verdict.get("slo_missed") or []:
        lines.append(f"  missed SLO {missed['slo']}{_measured(missed)}: {fmt_ms(missed['observed_ms'])} over the "
                     f"objective of {fmt_ms(missed['objective_ms'])}")
    lines.append("evidence:")
    lines.extend(f"  - {item['text']}" for item in verdict["evidence"])
    return "\n".join(lines)


#: What an objective's measure is, in words (analyzers/slo.py OBJECTIVES; issue 44: two TTFTs, named).
_MEASURES = {"first_content_ms": "time to first content", "ttft_ms": "time to first token",
             "tpot_ms": "time per output token", "e2e_ms": "end to end"}


def _measured(missed: dict) -> str:
    """' (time to first content)': which figure an SLO miss was judged on."""
    measure = missed.get("measure")
    if missed["slo"] == "ttft" and measure == "ttft_ms":
        return " (time to first content unknown; time to first token, which precedes it)"
    return f" ({_MEASURES[measure]})" if measure in _MEASURES else ""


def render_cache(verdict: dict) -> str:
    """The cache verdict in a few lines."""
    if verdict["result"] is None:
        lines = [f"request {verdict['request_id']} on {verdict['instance_id']}: {verdict['outcome']}, no cache lookup",
                 "evidence:"]
        return "\n".join(lines + [f"  - {item['text']}" for item in verdict["evidence"]])
    cause = verdict["cause"] or f"{NO_CAUSE} (everything reusable was reused)"
    where = ""
    if verdict.get("cached_on"):
        where = f" (cached on {verdict['cached_on']})"
    elif verdict.get("evicted_by"):
        where = f" (evicted by request {verdict['evicted_by']})"
    elif verdict.get("divergence"):
        d = verdict["divergence"]
        at = ("between messages (template)" if d["segment_role"] == "template"
              else f"{d['segment_role']} segment {d['segment_index']}")
        where = f" (diverges at token {d['token_index']}, {at})"
    lines = [f"request {verdict['request_id']} on {verdict['instance_id']}: {verdict['result']} · cause {cause}{where}",
             f"  prompt {_known(verdict['prompt_tokens'])} · cached {_known(verdict['cached_tokens'])} · seen "
             f"{_known(verdict['seen_tokens'])} "
             f"tokens (block {verdict['block_size']})", "evidence:"]
    lines.extend(f"  - {item['text']}" for item in verdict["evidence"])
    return "\n".join(lines)


def render_report(report: dict) -> str:
    """The window report as small tables."""
    where = _slice_text(report)
    if not report["requests"]:
        return "no requests in the window" + (f" ({where})" if where else "")
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items()))
    lines = [f"{plural(report['requests'], 'request')}: {outcomes}"]
    if where:
        lines.append(f"slice: {where}")
    lines.append("categories (completed requests): "
                 + (", ".join(f"{k} {v}" for k, v in sorted(report["categories"].items())) or "-"))
    causes = ", ".join(f"{k} {v}" for k, v in sorted(report["causes"].items())) or "-"
    lines.append(f"cache causes (latest {plural(report['cause_sample'], 'request')} that did not reuse their whole "
                 "prompt): "
                 f"{causes}")
    rate = report["cache"]["token_hit_rate"]
    lines.append(f"cache: {'n/a' if rate is None else f'{rate:.1%}'} of prompt tokens reused; "
                 f"{plural(report['cache']['requests_with_reuse'], 'request')} reused something, "
                 f"{report['cache']['requests_without_reuse']} nothing")
    lines.append("latency: time to first token (the engine's first generated token) and time to first content "
                 "(the first chunk with answer text: the TTFT a client measures)")
    lines.append(f"{'instance':<16}{'requests':>9}{'1st token p50':>14}{'p95':>10}{'p99':>10}"
                 f"{'1st content p50':>16}{'p95':>10}{'p99':>10}{'tpot p50':>11}{'p95':>10}{'p99':>10}{'tok/s':>9}")
    for row in report["instances"]:
        t, c, p = row["ttft_ms"], row.get("first_content_ms") or {}, row["tpot_ms"]
        lines.append(f"{row['instance_id']!s:<16}{row['requests']:>9}{fmt_ms(t['p50']):>14}{fmt_ms(t['p95']):>10}"
                     f"{fmt_ms(t['p99']):>10}{fmt_ms(c.get('p50')):>16}{fmt_ms(c.get('p95')):>10}"
                     f"{fmt_ms(c.get('p99')):>10}{fmt_ms(p['p50']):>11}{fmt_ms(p['p95']):>10}{fmt_ms(p['p99']):>10}"
                     f"{row['output_tokens_per_s']:>9.1f}")
    lines.extend(render_slo(report.get("slo")))
    lines.append("slowest:")
    for row in report["slowest"]:
        lines.append(f"  {row['request_id']:<28} {row['instance_id']!s:<14} {row['category']:<11} "
                     f"e2e {fmt_ms(row['e2e_ms'])} · first token {fmt_ms(row['ttft_ms'])} · first content "
                     f"{fmt_ms(row.get('first_content_ms'))}")
    for row in report.get("routing") or ():
        lines.append(f"routing {row['policy']}: {plural(row['decisions'], 'decision')}, avoidable prefill "
                     f"{plural(row['avoidable_prefill_tokens'], 'token')} "
                     f"({plural(row['decisions_with_avoidable'], 'decision')}), "
                     f"mean gateway wait {fmt_ms(row['mean_gateway_wait_ms'])}")
    lines.append("(latency, categories and cache figures count completed requests only)")
    return "\n".join(lines)


def _slice_text(report: dict) -> str:
    """'from 20:00:00.000 UTC until 20:10:00.000 UTC; instance mini-1, request ids demo-*' (empty for a
    plain window ending now)."""
    import time

    def clock(ns: int) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns // 1_000_000 % 1000:03d} UTC"

    parts = []
    if report.get("until_ns") is not None:
        start = "the first request" if report.get("since_ns") is None else clock(report["since_ns"])
        parts.append(f"from {start} until {clock(report['until_ns'])}")
    names = {"instance_id": "instance", "model": "model", "session_id": "session"}
    given = report.get("slice") or {}
    parts += [f"{names[key]} {given[key]}" for key in names if given.get(key) is not None]
    if given.get("request_prefix") is not None:
        parts.append(f"request ids {given['request_prefix']}*")
    return "; ".join(parts)


def render_slo(slo: dict | None) -> list[str]:
    """SLO attainment lines of a report (none when no objectives are set)."""
    if not slo:
        return []
    parts = []
    for name, row in slo["objectives"].items():
        share = "n/a" if row["attainment"] is None else f"{row['attainment']:.1%}"
        what = f" [{row['what']}]" if row.get("what") else ""
        parts.append(f"{name}{what} {share} ({row['met']} met, {row['missed']} missed, {row['unknown']} unknown)")
    whole = slo["all"]
    share = "n/a" if whole["attainment"] is None else f"{whole['attainment']:.1%}"
    goodput = "n/a" if whole["goodput_rps"] is None else f"{whole['goodput_rps']:.3g} requests/s"
    return [f"SLO {slo['spec']}: " + "; ".join(parts),
            f"  met every objective: {whole['good']} of {whole['requests']} ({share}) · goodput {goodput}"]


def _known(value, unknown: str = "unknown") -> str:
    """A count for humans: an unmeasured one is named, never printed as ``None``."""
    return unknown if value is None else str(value)


def _gap(value: float | None) -> str:
    return "—" if value is None else fmt_ms(value)


def render_session(verdict: dict) -> str:
    """The session verdict: a line per turn, the cold turns' evidence, the thresholds per instance."""
    lines = [f"session {verdict['session_id']}: {len(verdict['turns'])} turns, "
             f"{len(verdict['cold_turns'])} came back to a cold cache"
             + (" (only the latest shown)" if verdict["truncated"] else "")]
    lines.append(f"  {'turn':>4} {'request':<24} {'instance':<14}{'gap':>11}{'ttft':>11}{'prompt':>8}{'cached':>8}"
                 f"  {'slow':<11}{'cache':<28}survived")
    for t in verdict["turns"]:
        cache = (t["cache"]["result"] or "no lookup") + (f" ({t['cache']['cause']})" if t["cache"]["cause"] else "")
        survived = {None: "—", True: "yes", False: "no"}[t["survived"]]
        lines.append(f"  {t['turn']:>4} {t['request_id']:<24} {t['instance_id']!s:<14}{_gap(t['gap_ms']):>11}"
                     f"{fmt_ms(t['ttft_ms']):>11}{_known(t['prompt_tokens'], '—'):>8}"
                     f"{_known(t['cached_tokens'], '—'):>8}  "
                     f"{t['slow']['category']:<11}{cache:<28}{survived}")
    if verdict["evidence"]:
        lines.append("evidence:")
        lines.extend(f"  - {item['text']}" for item in verdict["evidence"])
    for row in verdict["instances"]:
        after = "unknown" if row["cold_after_ms"] is None else f"{fmt_ms(row['cold_after_ms'])} or more"
        lines.append(f"{row['instance_id']}: follow-ups come back cold after gaps of {after} "
                     f"({row['warm']} warm, {row['cold']} cold (evicted or restarted), {row['changed']} with a "
                     f"changed prompt, {row['unknown']} unknown, of {row['follow_ups']}; longest warm gap "
                     f"{_gap(row['longest_warm_gap_ms'])})")
    return "\n".join(lines)


#: Request ids listed per piece of advice (the JSON has them all).
SHOWN = 20
#: What each kind of advice is called.
ADVICE_KINDS = {"context": "context", "routing": "routing", "capacity": "cache capacity",
                "concurrency": "concurrency", "cold_start": "cold starts and restarts", "objectives": "objectives"}


def _saving(item: dict) -> str:
    if item["saved_ms"] is None:
        return f"saving not computed: {item['why_not']}" if item.get("why_not") else "saving not computed"
    per_hour = "" if item.get("saved_ms_per_hour") is None else \
        f" ({fmt_ms(abs(item['saved_ms_per_hour']))} per hour)"
    tokens = "" if not item.get("prefill_tokens") else f", {abs(item['prefill_tokens']):,} prefill tokens" + (
        "" if item.get("prefill_tokens_per_hour") is None else f" ({abs(item['prefill_tokens_per_hour']):,} per hour)")
    verb = "saves" if item["saved_ms"] >= 0 else "costs"
    return f"{verb} {fmt_ms(abs(item['saved_ms']))} of waiting before the first token{per_hour}{tokens}, " \
           f"{plural(item['requests'], 'request')}"


def render_advice(result: dict) -> str:
    """The advice, best first: each kind's finding, its best change and what it saves, the others
    after it, evidence, and the requests it rests on."""
    where = _slice_text({**result["window"], "slice": result["slice"]})
    if not result["advice"]:
        lines = [f"No advice over {plural(result['requests'], 'request')}" + (f" ({where})" if where else "") + "."]
    else:
        lines = [f"Advice over {plural(result['requests'], 'request')}" + (f" ({where})" if where else "")
                 + f", {result['span_s']:,.1f} s of traffic; cache causes over {result['sample']}:"]
    for rank, item in enumerate(result["advice"], 1):
        best, *others = item["changes"]
        lines.append(f"{rank}. {ADVICE_KINDS[item['kind']]}: {best['change']}.")
        lines.append(f"   {_saving(best)}.")
        lines.append(f"   why: {item['finding']}")
        for evidence in item["evidence"]:
            lines.append(f"   - {evidence['text']}")
        for other in others:
            lines.append(f"   or: {other['change']}: {_saving(other)}.")
        if item["request_ids"]:
            shown = item["request_ids"][:SHOWN]
            more = item["requests"] - len(shown)
            lines.append("   requests: " + ", ".join(shown) + (f" and {more} more" if more > 0 else ""))
    for kind, why in result["nothing"].items():
        lines.append(f"nothing to change in {ADVICE_KINDS[kind]}: {why}")
    return "\n".join(lines)

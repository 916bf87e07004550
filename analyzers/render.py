"""Compact human text for verdict and report dicts (the JSON the API and ``--json`` return)."""

from __future__ import annotations

from tokentrace.analyzers.evidence import fmt_ms

_BAR = 24


def render(kind: str, result: dict) -> str:
    """Text for ``slow``, ``cache`` or ``report``."""
    return {"slow": render_slow, "cache": render_cache, "report": render_report}[kind](result)


def _abnormal(verdict: dict) -> str:
    base = verdict["baseline"]
    if verdict["abnormal"] is None:
        return f"abnormal: unknown (only {base['samples']} comparable requests)"
    judged = "yes" if verdict["abnormal"] else "no"
    return (f"abnormal: {judged} ({base['metric']} {base['observed']:.4g} {base['unit']} vs baseline "
            f"{base['value']:.4g} over {base['samples']} requests)")


def render_slow(verdict: dict) -> str:
    """The slowness verdict as a few lines and a bar per phase."""
    parts = verdict["breakdown_ms"]
    lines = [f"request {verdict['request_id']} on {verdict['instance_id']} ({verdict['engine'] or 'unknown engine'})",
             f"category: {verdict['category']} · ttft category: {verdict['ttft_category']} · {_abnormal(verdict)}"]
    total = max(parts["e2e"] or 0.0, 1e-9)
    for name in ("load_wait", "queue", "prefill", "decode", "other"):
        value = parts[name] or 0.0
        lines.append(f"  {name:<10}{fmt_ms(value):>11}  {'█' * round(_BAR * value / total)}")
    lines.append(f"  ttft {fmt_ms(parts['ttft'])} · tpot {fmt_ms(parts['tpot'])} · e2e {fmt_ms(parts['e2e'])}")
    lines.append("evidence:")
    lines.extend(f"  - {item['text']}" for item in verdict["evidence"])
    return "\n".join(lines)


def render_cache(verdict: dict) -> str:
    """The cache verdict in a few lines."""
    cause = verdict["cause"] or "none (everything reusable was reused)"
    where = ""
    if verdict.get("cached_on"):
        where = f" (cached on {verdict['cached_on']})"
    elif verdict.get("evicted_by"):
        where = f" (evicted by request {verdict['evicted_by']})"
    elif verdict.get("divergence"):
        d = verdict["divergence"]
        where = f" (diverges at token {d['token_index']}, {d['segment_role']} segment {d['segment_index']})"
    lines = [f"request {verdict['request_id']} on {verdict['instance_id']}: {verdict['result']} · cause {cause}{where}",
             f"  prompt {verdict['prompt_tokens']} · cached {verdict['cached_tokens']} · seen {verdict['seen_tokens']} "
             f"tokens (block {verdict['block_size']})", "evidence:"]
    lines.extend(f"  - {item['text']}" for item in verdict["evidence"])
    return "\n".join(lines)


def render_report(report: dict) -> str:
    """The window report as small tables."""
    if not report["requests"]:
        return "no requests in the window"
    lines = [f"{report['requests']} requests"]
    lines.append("categories: " + ", ".join(f"{k} {v}" for k, v in sorted(report["categories"].items())))
    causes = ", ".join(f"{k} {v}" for k, v in sorted(report["causes"].items())) or "none"
    lines.append(f"cache causes (latest {report['cause_sample']} requests that did not reuse their whole prompt): "
                 f"{causes}")
    rate = report["cache"]["token_hit_rate"]
    lines.append(f"cache: {'n/a' if rate is None else f'{rate:.1%}'} of prompt tokens reused; "
                 f"{report['cache']['requests_with_reuse']} requests reused something, "
                 f"{report['cache']['requests_without_reuse']} nothing")
    lines.append(f"{'instance':<16}{'requests':>9}{'ttft p50':>11}{'p95':>10}{'p99':>10}{'tpot p50':>11}"
                 f"{'p95':>10}{'p99':>10}{'tok/s':>9}")
    for row in report["instances"]:
        t, p = row["ttft_ms"], row["tpot_ms"]
        lines.append(f"{row['instance_id']!s:<16}{row['requests']:>9}{fmt_ms(t['p50']):>11}{fmt_ms(t['p95']):>10}"
                     f"{fmt_ms(t['p99']):>10}{fmt_ms(p['p50']):>11}{fmt_ms(p['p95']):>10}{fmt_ms(p['p99']):>10}"
                     f"{row['output_tokens_per_s']:>9.1f}")
    lines.append("slowest:")
    for row in report["slowest"]:
        lines.append(f"  {row['request_id']:<28} {row['instance_id']!s:<14} {row['category']:<11} "
                     f"e2e {fmt_ms(row['e2e_ms'])} · ttft {fmt_ms(row['ttft_ms'])}")
    for row in report.get("routing") or ():
        lines.append(f"routing {row['policy']}: {row['decisions']} decisions, avoidable prefill "
                     f"{row['avoidable_prefill_tokens']} tokens ({row['decisions_with_avoidable']} decisions), "
                     f"mean gateway wait {fmt_ms(row['mean_gateway_wait_ms'])}")
    return "\n".join(lines)

"""Issue 15 acceptance: a real Prometheus scrapes /metrics of a real collector fed by two real
engines; PromQL over its API must agree with ``analyze report`` on the same requests, promtool
must accept the exposition, and every panel of the Grafana dashboard must return data."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess
from harness_prometheus import PROMTOOL, PrometheusProcess, now, require_prometheus

pytestmark = pytest.mark.slow

TOKEN = "metrics-test-token"
SLO = "ttft=10s,tpot=0.001ms,e2e=60s;instance=engine-b:tpot=10s"
ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "grafana" / "tokentrace.json"
SYSTEM = {"role": "system", "content": "You answer questions about observability of inference servers. " * 3}


def _ask(engine: EngineProcess, rid: str, text: str, tokens: int = 6) -> None:
    response = engine.chat([SYSTEM, {"role": "user", "content": text}], headers={"X-Request-Id": rid},
                           max_tokens=tokens, ignore_eos=True)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def scraped(tmp_path_factory, tiny_model):
    """Traffic on two engines, then a Prometheus scrape taken after every verdict was counted."""
    require_prometheus()
    workdir = tmp_path_factory.mktemp("metrics")
    collector = CollectorProcess(workdir, "--slo", SLO, token=TOKEN).start()
    engines = [EngineProcess(workdir, tiny_model, "--heartbeat-interval", "0.5", collector=collector,
                             instance_id=name).start() for name in ("engine-a", "engine-b")]
    prometheus = PrometheusProcess(workdir, f"127.0.0.1:{collector.port}", TOKEN)
    try:
        a, b = engines
        _ask(a, "a-1", "What is time to first token?")
        _ask(a, "a-2", "What is time to first token?")  # the same prompt again: a prefix-cache hit
        _ask(a, "a-3", "How is the KV cache evicted?", tokens=12)
        _ask(b, "b-1", "What is time to first token?")  # cached on engine-a, not here
        _ask(b, "b-2", "Why does prefill take long?", tokens=3)
        refused = b.chat([{"role": "user", "content": "no"}], headers={"X-Request-Id": "b-refused"}, max_tokens=0)
        assert refused.status_code == 400  # the engine rejects it: outcome rejected, no category
        for engine in engines:
            assert engine.stop() == 0, engine.log_path.read_text()  # flushes every span
        assert collector.post(b"not a protobuf payload", "application/x-protobuf").status_code == 400
        prometheus.start()
        metrics = wait_for(lambda: _settled(collector), 120, "every per-request verdict counted")
        prometheus.scraped_after(now())
        report = httpx.get(collector.url + "/api/report", params={"since": "all", "causes": 100},
                           headers=collector.headers, timeout=60).json()
        yield {"collector": collector, "prometheus": prometheus, "report": report, "metrics": metrics,
               "workdir": workdir}
    finally:
        prometheus.stop()
        for engine in engines:
            engine.stop()
        collector.stop()


def _settled(collector: CollectorProcess) -> str | None:
    text = httpx.get(collector.url + "/metrics", headers=collector.headers, timeout=30).text
    return text if re.search(r"^tokentrace_verdicts_pending 0$", text, re.M) else None


def _by(result: list[dict], label: str) -> dict[str, float]:
    return {row["metric"].get(label, ""): float(row["value"][1]) for row in result}


def test_request_counts_and_categories_equal_the_report(scraped):
    prom, report = scraped["prometheus"], scraped["report"]
    completed = 'tokentrace_requests_total{outcome="completed"}'
    per_instance = _by(prom.query(f"sum by (instance_id) ({completed})"), "instance_id")
    assert per_instance == {row["instance_id"]: row["requests"] for row in report["instances"]}
    assert per_instance == {"engine-a": 3, "engine-b": 2}
    categories = _by(prom.query(f"sum by (category) ({completed})"), "category")
    assert categories == {k: float(v) for k, v in report["categories"].items()}
    outcomes = _by(prom.query("sum by (outcome) (tokentrace_requests_total)"), "outcome")
    assert outcomes == {k: float(v) for k, v in report["outcomes"].items()}
    assert outcomes["rejected"] == 1 and report["requests"] == 6
    # A refused request's category is its outcome, so the verdict mix includes it.
    assert _by(prom.query('tokentrace_requests_total{outcome="rejected"}'), "category") == {"rejected": 1}
    success = prom.query("sum(vllm:request_success_total)")
    assert float(success[0]["value"][1]) == 5


def test_cache_tokens_equal_the_report(scraped):
    prom, report = scraped["prometheus"], scraped["report"]
    hits = float(prom.query("sum(vllm:prefix_cache_hits_total)")[0]["value"][1])
    queries = float(prom.query("sum(vllm:prefix_cache_queries_total)")[0]["value"][1])
    assert (hits, queries) == (report["cache"]["cached_tokens"], report["cache"]["prompt_tokens"])
    assert hits > 0, "a-2 repeats a-1's prompt on the same engine"
    prompt = float(prom.query("sum(vllm:prompt_tokens_total)")[0]["value"][1])
    assert prompt == report["cache"]["prompt_tokens"]
    lookups = prom.query("sum by (result, cause) (tokentrace_cache_lookups_total)")
    assert sum(float(row["value"][1]) for row in lookups) == 5
    # b-1 asked engine-b for what engine-a held: the cache analyzer's instance_change.
    causes = {(row["metric"]["result"], row["metric"]["cause"]) for row in lookups}
    assert any(cause == "instance_change" for _, cause in causes), causes


def test_ttft_buckets_bound_the_report_percentiles(scraped):
    """The report's exact p50/p95/p99 (nearest rank) lie in a bucket that Prometheus's cumulative
    counts allow for that quantile: non-empty, with at most q*n observations below it (one rank of
    slack for the nearest-rank rounding) and at least that many up to its bound."""
    prom, report = scraped["prometheus"], scraped["report"]
    for row in report["instances"]:
        instance = row["instance_id"]
        buckets = prom.query(f'vllm:time_to_first_token_seconds_bucket{{instance_id="{instance}"}}')
        assert {"model_name", "engine", "instance_id", "le"} <= set(buckets[0]["metric"])
        cumulative = sorted((float(b["metric"]["le"]), float(b["value"][1])) for b in buckets)
        n = cumulative[-1][1]
        assert n == row["requests"]
        for q in (50, 95, 99):
            exact = row["ttft_ms"][f"p{q}"] / 1000
            at = next(i for i, (bound, _) in enumerate(cumulative) if exact <= bound)
            below = cumulative[at - 1][1] if at else 0.0
            upto = cumulative[at][1]
            assert upto - below >= 1, (instance, q, exact, cumulative)
            assert below <= q / 100 * n + 1 and upto >= q / 100 * n - 1, (instance, q, exact, cumulative)


def test_gauges_series_and_labels(scraped):
    prom = scraped["prometheus"]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "tokentrace_ingest_spans_accepted_total", "tokentrace_instance_info"):
        assert prom.query(name), name
    instances = _by(prom.query("vllm:kv_cache_usage_perc"), "instance_id")
    assert set(instances) == {"engine-a", "engine-b"} and all(0 <= v <= 1 for v in instances.values())
    info = prom.query("tokentrace_instance_info")
    assert {row["metric"]["engine_kind"] for row in info} == {"mlx-lm"}
    # How long the engines' acknowledged exports took in the receiver, and in which stage (two
    # engines exported): histograms whose counts agree and whose quantiles Prometheus computes.
    # Engines keep exporting heartbeats, so each comparison is one expression: one scrape's values.
    assert float(prom.query("tokentrace_receiver_request_seconds_count")[0]["value"][1]) >= 2
    stages = _by(prom.query("tokentrace_receiver_stage_seconds_sum"), "stage")
    assert set(stages) == {"read", "decode", "store"} and all(v > 0 for v in stages.values()), stages
    every_stage_counted = prom.query("tokentrace_receiver_stage_seconds_count - ignoring(stage) group_left "
                                     "tokentrace_receiver_request_seconds_count")
    assert _by(every_stage_counted, "stage") == dict.fromkeys(stages, 0.0)
    [[_, gap]] = [row["value"] for row in prom.query(  # a request's stages follow one another
        "tokentrace_receiver_request_seconds_sum - scalar(sum(tokentrace_receiver_stage_seconds_sum))")]
    assert abs(float(gap)) < 1e-4, gap
    [[_, beyond]] = [row["value"] for row in prom.query('tokentrace_receiver_request_seconds_bucket{le="+Inf"} '
                                                        "- ignoring(le) tokentrace_receiver_request_seconds_count")]
    assert float(beyond) == 0
    p99 = float(prom.query("histogram_quantile(0.99, tokentrace_receiver_request_seconds_bucket)")[0]["value"][1])
    assert 0 < p99 <= 10, p99  # within the buckets: no acknowledged export here took 10 s


def test_slo_attainment_equals_the_report(scraped):
    prom, report = scraped["prometheus"], scraped["report"]
    slo = report["slo"]
    assert slo["spec"] == SLO
    for name, counts in slo["objectives"].items():
        met = _by(prom.query(f'sum by (met) (tokentrace_slo_requests_total{{slo="{name}"}})'), "met")
        assert met.get("true", 0) == counts["met"] and met.get("false", 0) == counts["missed"], name
    # tpot=1us (no real decode step is that fast) is missed by every engine-a request with a TPOT;
    # engine-b's own objective is 10 s.
    assert slo["objectives"]["tpot"]["missed"] >= 2
    good = _by(prom.query('sum by (met) (tokentrace_slo_requests_total{slo="all"})'), "met")
    assert good.get("true", 0) == slo["all"]["good"]
    verdict = httpx.get(scraped["collector"].url + "/api/requests/a-3/slow",
                        headers=scraped["collector"].headers, timeout=30).json()
    assert [m["slo"] for m in verdict["slo_missed"]] == ["tpot"]


def test_promtool_accepts_the_exposition(scraped):
    """promtool parses it (exit 1 would be a format error) and finds nothing to lint but the colon
    in vLLM's own names, kept on purpose so that vLLM's dashboards and schedulers read them
    (promtool says the same of vLLM's own /metrics; docs/metrics.md)."""
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=scraped["metrics"].encode(),
                            capture_output=True, timeout=60)
    findings = (result.stdout + result.stderr).decode().splitlines()
    assert result.returncode in (0, 3), findings  # 3: lint findings only
    others = [line for line in findings if not re.fullmatch(r"vllm:\w+ metric names should not contain ':'", line)]
    assert not others, others
    tokentrace_only = "\n".join(line for line in scraped["metrics"].splitlines() if "vllm:" not in line) + "\n"
    clean = subprocess.run([PROMTOOL, "check", "metrics"], input=tokentrace_only.encode(), capture_output=True,
                           timeout=60)
    assert clean.returncode == 0, (clean.stdout + clean.stderr).decode()


def test_metrics_needs_the_token(scraped):
    collector = scraped["collector"]
    assert httpx.get(collector.url + "/metrics", timeout=10).status_code == 401


def _panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    panels = []
    for panel in dashboard["panels"]:
        panels += [(panel["title"], target["expr"]) for target in panel.get("targets", [])]
    return panels


def _expand(expr: str) -> str:
    return (expr.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "5m")
            .replace('"$model_name"', '".*"').replace('"$instance_id"', '".*"'))


def test_every_grafana_panel_returns_data(scraped):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _panel_queries(dashboard)
    assert len(queries) >= 8
    # rate() needs two scrapes inside its range.
    scraped["prometheus"].scraped_after(now() + 1)
    empty = [(title, expr) for title, expr in queries if not scraped["prometheus"].query(_expand(expr))]
    assert not empty, empty


def test_report_cli_prints_slo_and_goodput(scraped):
    collector = scraped["collector"]
    out = subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "report", "--since", "all",
                          "--url", collector.url, "--token", TOKEN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SLO" in out.stdout and "goodput" in out.stdout


def test_overview_page_shows_attainment_and_goodput(scraped):
    collector, report = scraped["collector"], scraped["report"]
    twin = httpx.get(collector.url + "/.json", params={"since": "all"}, headers=collector.headers, timeout=60).json()
    assert twin["slo"]["objectives"] == report["slo"]["objectives"]
    assert twin["slo"]["all"]["good"] == report["slo"]["all"]["good"]
    page = httpx.get(collector.url + "/", params={"since": "all"}, headers=collector.headers, timeout=60).text
    assert 'id="slo"' in page and "Goodput" in page and 'data-metric="slo.tpot"' in page


def test_both_ttfts_are_named_and_served(scraped):
    """Issue 44 item 4: the TTFT histogram says it is the engine's first token, and the client's time to
    first content has its own histogram, observed for each request whose verdict knows it."""
    text, collector = scraped["metrics"], scraped["collector"]
    helps = {line.split()[2]: line for line in text.splitlines() if line.startswith("# HELP ")}
    assert "engine's first generated token" in helps["vllm:time_to_first_token_seconds"]
    assert "client" in helps["tokentrace_time_to_first_content_seconds"]
    known: dict[str, int] = {}
    for rid in ("a-1", "a-2", "a-3", "b-1", "b-2"):
        slow = httpx.get(f"{collector.url}/api/requests/{rid}/slow", headers=collector.headers, timeout=30).json()
        if slow["breakdown_ms"].get("first_content") is not None:
            known[slow["instance_id"]] = known.get(slow["instance_id"], 0) + 1
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(
        r'^tokentrace_time_to_first_content_seconds_count\{.*instance_id="([^"]+)"\} (\d+)$', text, re.M)}
    assert counts == known and sum(counts.values()) == 5, (counts, known)


def test_request_page_shows_the_objectives_a_request_missed(scraped):
    """Issue 47 item 2: a request that missed an objective says so on its page (and its JSON twin), as
    analyze slow does; one that met them all says that."""
    collector = scraped["collector"]

    def page(rid: str) -> tuple[dict, str]:
        twin = httpx.get(f"{collector.url}/requests/{rid}.json", headers=collector.headers, timeout=60).json()
        html = httpx.get(f"{collector.url}/requests/{rid}", headers=collector.headers, timeout=60).text
        return twin, html

    api = httpx.get(collector.url + "/api/requests/a-3/slow", headers=collector.headers, timeout=30).json()
    twin, html = page("a-3")
    assert twin["slow"]["slo_missed"] == api["slo_missed"] and [m["slo"] for m in api["slo_missed"]] == ["tpot"]
    assert twin["slo"]["spec"] == SLO
    assert 'data-missed="1"' in html and "missed 1 of 3 objectives" in html and '<li data-slo="tpot">tpot: ' in html
    # engine-b's own tpot objective is 10 s: b-2 met every one.
    twin, html = page("b-2")
    assert twin["slow"]["slo_missed"] == [] and 'data-missed="0"' in html and "met every objective" in html

"""Issue 5 acceptance: Debian's headless Chromium on the dashboard of a real collector fed by real
engine traffic (two ``tokentrace engine`` processes on the tiny generated model).

The module's traffic runs once: a lazy-loading engine with a small prompt cache (cold start,
queueing behind a batch of 2, evictions) and a second engine; a session id and a prompt that carry
``<script>``. The engines then stop (flushing their spans), the collector stops so that the facts
below come from SQL on its file, and it starts again on the same file for the browser: the store
no longer changes while pages, twins and the store are compared. Screenshots of every page go to
artifacts/screenshots/.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import polars as pl
import pytest
import trace_event_format
from harness_collector import CollectorProcess
from harness_engine import EngineProcess, streamed_text

from tokentrace.dashboards.web import fmt_ms, fmt_num

pytestmark = [pytest.mark.browser, pytest.mark.slow]

EVIL_SESSION = '<script>alert("session")</script>'
EVIL_PROMPT = '<script>document.title="pwned"</script> Why?'
SYSTEM = {"role": "system", "content": "You are a terse assistant for an inference cluster. " * 2}
QUESTIONS = ["What is prefill?", "What is decode?", "What is a KV cache?", "Why queue?", "What is TTFT?"]


def _chat(engine: EngineProcess, rid: str, content: str, max_tokens: int, **headers) -> None:
    response = engine.chat([SYSTEM, {"role": "user", "content": content}],
                           headers={"X-Request-Id": rid, **headers}, max_tokens=max_tokens, ignore_eos=True)
    assert response.status_code == 200, response.text


def _long_stream(engine: EngineProcess, rid: str, content: str, admitted: threading.Event) -> None:
    body = {"messages": [SYSTEM, {"role": "user", "content": content}], "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and streamed_text([json.loads(line[6:])]):
                admitted.set()  # a generated token arrived: it holds a batch slot until its 1000th
    admitted.set()


def _burst(a: EngineProcess) -> None:
    """Two long streams fill --max-batch 2; three short requests sent meanwhile must queue behind them."""
    admitted = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_long_stream, args=(a, f"burst-{i}", QUESTIONS[i], admitted[i]))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for event in admitted:
        assert event.wait(60), "a long stream never produced a token"
    shorts = [threading.Thread(target=_chat, args=(a, f"burst-{i}", QUESTIONS[i], 4)) for i in range(2, 5)]
    for thread in shorts:
        thread.start()
    for thread in threads + shorts:
        thread.join()


def _traffic(a: EngineProcess, b: EngineProcess) -> None:
    _chat(a, "xss-1", EVIL_PROMPT, 8, **{"X-Session-Id": EVIL_SESSION})  # cold start: a loads lazily
    _burst(a)
    _chat(a, "xss-2", EVIL_PROMPT, 4, **{"X-Session-Id": EVIL_SESSION})
    for i, q in enumerate(QUESTIONS[:3]):
        _chat(b, f"b-{i}", q, 6 + 4 * i)


def _store_facts(collector: CollectorProcess) -> dict:
    """What the dashboard must show, computed with SQL on the stopped collector's file."""
    requests = pl.DataFrame(collector.sql(
        "SELECT request_id, instance_id, start_ns, end_ns, load_wait_ms, queue_ms, prefill_ms, decode_ms, "
        "ttft_ms, prompt_tokens, cached_tokens, completion_tokens, session_id FROM requests ORDER BY start_ns"),
        schema=["request_id", "instance_id", "start_ns", "end_ns", "load_wait", "queue", "prefill", "decode",
                "ttft_ms", "prompt", "cached", "completion", "session_id"], orient="row")
    # The slowness rule, restated: the largest phase names the category, ties to the earlier one.
    labels = {"load_wait": "cold_start", "queue": "queueing", "prefill": "prefill", "decode": "decode"}
    requests = requests.with_columns(pl.Series("category", [
        labels[max(labels, key=lambda p, r=row: (r[p] or 0.0, -list(labels).index(p)))]
        for row in requests.iter_rows(named=True)]))
    heartbeats = collector.sql("SELECT instance_id, arg_max(cache_bytes, t_ns), arg_max(cache_entries, t_ns) "
                               "FROM heartbeats GROUP BY instance_id")
    events = collector.sql("SELECT instance_id, event, min(t_ns) FROM instance_events GROUP BY ALL")
    return {
        "requests": requests,
        "evictions": dict(collector.sql("SELECT reason, count(*) FROM cache_evictions GROUP BY reason")),
        "cache": {row[0]: (row[1], row[2]) for row in heartbeats},
        "events": {(row[0], row[1]): row[2] for row in events},
        "spans_of_xss_1": collector.sql("SELECT count(*) FROM spans WHERE trace_id = "
                                        "(SELECT trace_id FROM requests WHERE request_id = 'xss-1')")[0][0],
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    """Real traffic through two engines into one collector; yields (collector, store facts)."""
    workdir = tmp_path_factory.mktemp("dashboard")
    collector = CollectorProcess(workdir).start()
    flags = ("--capture-content", "--heartbeat-interval", "0.5", "--prefill-step-size", "32")
    a = EngineProcess(workdir, tiny_model, "--lazy-load", "--max-batch", "2", "--cache-max-entries", "2", *flags,
                      collector=collector, instance_id="engine-a").start(ready=False)
    b = EngineProcess(workdir, tiny_model, *flags, collector=collector, instance_id="engine-b").start()
    try:
        _traffic(a, b)
    finally:
        assert a.stop() == 0 and b.stop() == 0
        assert collector.stop() == 0
    facts = _store_facts(collector)
    collector.start()
    yield collector, facts
    collector.stop()


def metrics(page) -> list[dict]:
    """Every number the page marks: metric name, raw value, shown text, and its instance row."""
    return page.evaluate("""() => Array.from(document.querySelectorAll('[data-metric]')).map(e => ({
        metric: e.dataset.metric, value: e.dataset.value, text: e.textContent.trim(),
        instance: e.closest('[data-instance]') ? e.closest('[data-instance]').dataset.instance : null}))""")


def twin(page, path: str) -> dict:
    """The JSON twin fetched with the page's own cookies."""
    response = page.request.get(path)
    assert response.status == 200, path
    return response.json()


def visit(browser_page, url: str, shot: str) -> None:
    browser_page.open(url)
    browser_page.page.wait_for_load_state("networkidle")
    browser_page.screenshot(shot)
    browser_page.assert_clean()


def test_overview_numbers_equal_twin_and_store(cluster, browser_page):
    collector, facts = cluster
    visit(browser_page, collector.url + "/?since=1h", "overview")
    data = twin(browser_page.page, collector.url + "/.json?since=1h")
    shown = {(m["instance"], m["metric"]): m for m in metrics(browser_page.page)}
    requests = facts["requests"]
    assert data["requests"] == requests.height == int(shown[(None, "requests")]["value"])
    assert shown[(None, "requests")]["text"] == fmt_num(requests.height)
    assert data["throughput"]["output_tokens"] == requests["completion"].sum()
    assert shown[(None, "output_tokens")]["value"] == str(requests["completion"].sum())
    ttft = requests["ttft_ms"].quantile(0.95, "nearest")
    assert data["latency"]["ttft_ms"]["p95"] == round(ttft, 3)
    assert shown[(None, "ttft_ms.p95")]["text"] == fmt_ms(data["latency"]["ttft_ms"]["p95"])
    assert data["cache"]["token_hit_rate"] == round(requests["cached"].sum() / requests["prompt"].sum(), 4)
    for name, count in data["categories"].items():
        assert shown[(None, f"category.{name}")]["value"] == str(count)
        assert count == requests.filter(pl.col("category") == name).height, name
    assert data["categories"]["queueing"] >= 3  # the three requests sent behind two long streams
    for instance in ("engine-a", "engine-b"):
        served = requests.filter(pl.col("instance_id") == instance).height
        assert shown[(instance, "requests")]["value"] == str(served)


def test_timeline_bar_hover_and_click_open_the_request(cluster, browser_page):
    collector, facts = cluster
    page = browser_page.page
    visit(browser_page, collector.url + "/timeline?since=1h", "timeline")
    data = twin(page, collector.url + "/timeline.json?since=1h")
    requests = facts["requests"]
    assert data["requests"]["id"] == requests["request_id"].to_list()
    assert data["lanes"] == ["engine-a", "engine-b"]
    for phase in ("load_wait", "queue", "prefill", "decode"):
        # The twin keeps microseconds: equal to the stored value within rounding.
        assert data["requests"][phase] == pytest.approx([v or 0.0 for v in requests[phase].to_list()], abs=6e-4)
    assert page.locator("#timeline").get_attribute("data-drawn") == str(requests.height)
    assert sorted(data["evictions"]["reason"]) == sorted(r for r, n in facts["evictions"].items() for _ in range(n))

    i = data["requests"]["id"].index("burst-3")
    spot = page.evaluate("window.tokentraceTimeline.locate('burst-3')")
    page.mouse.move(spot["x"], spot["y"])
    tooltip = page.locator("#tooltip")
    tooltip.wait_for(state="visible")
    assert tooltip.locator("b").inner_text() == "burst-3"
    shown = dict(zip(tooltip.locator(".row span:first-child").all_inner_texts(),
                     tooltip.locator(".row span:last-child").all_inner_texts(), strict=True))
    assert shown["queue"] == fmt_ms(data["requests"]["queue"][i])
    assert shown["decode"] == fmt_ms(data["requests"]["decode"][i])
    assert shown["output tokens"] == f"{data['requests']['completion'][i]:,}"
    browser_page.screenshot("timeline-hover")
    with page.expect_navigation():
        page.mouse.click(spot["x"], spot["y"])
    assert page.url == collector.url + "/requests/burst-3"
    assert page.locator("#request-id").inner_text() == "burst-3"

    page.goto(collector.url + "/timeline?since=1h")
    before = page.evaluate("window.tokentraceTimeline.timeline.view")
    page.mouse.move(spot["x"], spot["y"])
    page.mouse.wheel(0, -600)  # zoom in around the cursor
    page.wait_for_function("([a, b]) => { const v = window.tokentraceTimeline.timeline.view;"
                           " return v[1] - v[0] < (b - a) / 2; }", arg=before)
    browser_page.assert_clean()


def test_timeline_marks_and_labels_bars_and_lists_them_in_a_sortable_filterable_table(cluster, browser_page):
    """Issue 47 item 2: bars carry their id where it fits, their category, a gap at their start and a
    mark when they missed an objective (the collector's --slo); the requests drawn are listed under the
    canvas, newest first, sortable and filterable, each id a link to its page."""
    collector, facts = cluster
    requests = facts["requests"]
    # The same store, served by a collector with an objective no engine-a request meets (tpot 1 us).
    collector.stop()
    judged = CollectorProcess(collector.workdir, "--slo", "tpot=0.001ms;instance=engine-b:tpot=10s",
                              db=collector.db).start()
    try:
        page = browser_page.page
        visit(browser_page, judged.url + "/timeline?since=1h", "timeline-table")
        data = twin(page, judged.url + "/timeline.json?since=1h")
        r = data["requests"]
        table = page.locator("#tl-table")

        def shown() -> list[str]:
            return table.locator("tbody tr").evaluate_all("rows => rows.map(row => row.dataset.request)")

        assert table.get_attribute("data-rows") == str(requests.height)
        newest = sorted(range(len(r["id"])), key=lambda i: -r["start"][i])
        assert shown() == [r["id"][i] for i in newest]
        # Starts read as the store's clock (UTC), to the millisecond (float rounding: within 1 ms).
        first = table.locator("tbody tr").first.locator("td").nth(3).inner_text()
        start_ns = data["t0_ns"] + round(r["start"][newest[0]] * 1e6)
        assert first in {time.strftime("%H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns // 10**6 % 1000:03d} UTC"
                         for ns in (start_ns - 10**6, start_ns, start_ns + 10**6)}, first
        page.locator('#tl-table th[data-column="e2e"]').click()  # longest first
        e2e = [r["e2e"][r["id"].index(rid)] for rid in shown()]
        assert e2e == sorted(e2e, reverse=True)
        page.locator('#tl-table th[data-column="e2e"]').click()  # again: shortest first
        e2e = [r["e2e"][r["id"].index(rid)] for rid in shown()]
        assert e2e == sorted(e2e)
        page.fill("#tl-filter", "burst-3")
        page.wait_for_function("document.getElementById('tl-table').dataset.rows === '1'")
        assert shown() == ["burst-3"]
        assert table.locator("tbody a").get_attribute("href") == "/requests/burst-3"
        # Objectives: engine-a's requests with a TPOT missed tpot; engine-b's met their own.
        missed = {rid for rid, m in zip(r["id"], r["slo_missed"], strict=True) if m}
        lanes = data["lanes"]
        expected = {rid for rid, lane, tpot in zip(r["id"], r["lane"], r["tpot"], strict=True)
                    if lanes[lane] == "engine-a" and tpot is not None}
        assert missed == expected and missed, (missed, expected)
        canvas = page.locator("#timeline")
        assert canvas.get_attribute("data-slo-missed") == str(len(missed))
        page.fill("#tl-filter", "tpot")
        page.wait_for_function(f"document.getElementById('tl-table').dataset.rows === '{len(missed)}'")
        # Zoomed in on one request, its bar holds its id.
        spot = page.evaluate("window.tokentraceTimeline.locate('burst-3')")
        page.mouse.move(spot["x"], spot["y"])
        for _ in range(3):
            page.mouse.wheel(0, -300)
        page.wait_for_function("Number(document.getElementById('timeline').dataset.labelled) > 0")
        browser_page.screenshot("timeline-labelled")
        browser_page.assert_clean()
    finally:
        judged.stop()
        collector.start()


def test_timeline_marks_abnormal_requests_on_the_canvas_and_in_the_table(collector_factory, browser_page):
    """Issue 47 item 2: a request abnormal for its instance (a-queued: 600 ms in the queue where
    steady-a's others waited 2 ms; busy-b's 600 ms waits are its usual) is drawn with its own mark,
    says so in the table's abnormal column, and the filter finds it."""
    from test_dashboard_pages import ABNORMAL_SITUATION, replay_situation

    collector = collector_factory().start()
    replay_situation(collector, ABNORMAL_SITUATION, time.time_ns() - 60_000_000_000)
    page = browser_page.page
    visit(browser_page, collector.url + "/timeline?since=1h", "timeline-abnormal")
    data = twin(page, collector.url + "/timeline.json?since=1h")
    r = data["requests"]
    assert [rid for rid, a in zip(r["id"], r["abnormal"], strict=True) if a] == ["a-queued"]
    canvas, table = page.locator("#timeline"), page.locator("#tl-table")
    assert canvas.get_attribute("data-abnormal") == "1"
    assert canvas.get_attribute("data-slo-missed") == "0"  # no objectives: the other mark stays off
    assert "abnormal for its instance" in page.locator(".tl-legend").inner_text()
    rows = dict(table.locator("tbody tr").evaluate_all(
        "rows => rows.map(row => [row.dataset.request, [row.dataset.abnormal, row.lastElementChild.textContent]])"))
    said = f"abnormal: queue {fmt_ms(600.0)} vs {fmt_ms(2.0)} baseline"  # the twin's observed and baseline
    assert rows["a-queued"] == ["true", said]
    assert rows["b-4"] == ["false", "normal"] and rows["a-after"] == ["false", "normal"]
    assert rows["a-1"] == ["null", "no baseline (1 comparable request)"]
    assert rows["a-failed"] == ["null", "not judged"]
    page.fill("#tl-filter", "abnormal")
    page.wait_for_function("document.getElementById('tl-table').dataset.rows === '1'")
    assert table.locator("tbody tr").evaluate_all("rows => rows.map(row => row.dataset.request)") == ["a-queued"]
    spot = page.evaluate("window.tokentraceTimeline.locate('a-queued')")
    page.mouse.move(spot["x"], spot["y"])
    tooltip = page.locator("#tooltip")
    tooltip.wait_for(state="visible")
    assert tooltip.locator('[data-field="abnormal?"]').inner_text() == said
    browser_page.screenshot("timeline-abnormal-hover")
    browser_page.assert_clean()


def test_script_in_session_id_and_prompt_is_shown_as_text(cluster, browser_page):
    collector, facts = cluster
    page = browser_page.page
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    visit(browser_page, collector.url + "/requests/xss-1", "request-xss-1")
    assert page.locator("#session-id").inner_text() == EVIL_SESSION
    assert facts["requests"].filter(pl.col("request_id") == "xss-1")["session_id"][0] == EVIL_SESSION
    snippets = page.locator("#segments td.snippet").all_inner_texts()
    assert any(EVIL_PROMPT in text for text in snippets), snippets
    assert page.title() == "Request · tokentrace" and dialogs == []
    assert page.locator("script", has_text="pwned").count() == 0  # never became an element

    data = twin(page, collector.url + "/requests/xss-1.json")
    assert data["request"]["session_id"] == EVIL_SESSION
    assert len(data["spans"]) == facts["spans_of_xss_1"]
    assert data["slow"]["category"] == facts["requests"].filter(pl.col("request_id") == "xss-1")["category"][0]
    assert data["slow"]["breakdown_ms"]["load_wait"] > 0  # the lazy engine loaded for it
    shown = {m["metric"]: m for m in metrics(page)}
    row = facts["requests"].filter(pl.col("request_id") == "xss-1").row(0, named=True)
    assert shown["prompt_tokens"]["value"] == str(row["prompt"]) == str(data["request"]["prompt_tokens"])
    assert shown["e2e_ms"]["value"] == str(data["e2e_ms"])
    assert data["e2e_ms"] == round((row["end_ns"] - row["start_ns"]) / 1e6, 3)
    assert shown["category"]["value"] == data["slow"]["category"]


def test_cache_and_instances_pages_equal_twin_and_store(cluster, browser_page):
    collector, facts = cluster
    page = browser_page.page
    visit(browser_page, collector.url + "/cache?since=1h", "cache")
    data = twin(page, collector.url + "/cache.json?since=1h")
    shown = {(m["instance"], m["metric"]): m["value"] for m in metrics(page)}
    for row in data["instances"]:
        assert (row["bytes"], row["entries"]) == facts["cache"][row["instance_id"]]
        assert shown[(row["instance_id"], "bytes")] == str(row["bytes"])
        assert shown[(row["instance_id"], "more_sessions")] == str(row["more_sessions"])
    assert data["evictions"]["by_reason"] == facts["evictions"] and facts["evictions"]
    assert shown[(None, "evictions")] == str(sum(facts["evictions"].values()))

    visit(browser_page, collector.url + "/instances", "instances")
    data = twin(page, collector.url + "/instances.json")
    assert [row["instance_id"] for row in data["instances"]] == ["engine-a", "engine-b"]
    for row in data["instances"]:
        steps = {step["state"]: step["t_ns"] for step in row["readiness"]}
        for state, event in (("started", "instance.started"), ("ready", "instance.ready"),
                             ("first_response", "instance.first_response")):
            assert steps[state] == facts["events"][(row["instance_id"], event)]
        cell = page.locator(f'[data-instance="{row["instance_id"]}"] [data-state="ready"]')
        assert cell.get_attribute("data-value") == str(steps["ready"])
        assert row["status"] == "stopped" and row["load"]["stages"]
    lazy = data["instances"][0]["load"]
    assert lazy["lazy"] is True


def test_perfetto_export_of_engine_traffic_follows_the_format(cluster, tmp_path):
    collector, facts = cluster
    from test_export_perfetto import export, tracks

    result = export("--since", "1h", "--url", collector.url, "-o", str(tmp_path / "trace.json"))
    assert result.returncode == 0, result.stderr
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace_event_format.problems(trace) == []
    by_track = tracks(trace)
    assert {name.removeprefix("request ") for name in by_track if name.startswith("request ")} == set(
        facts["requests"]["request_id"].to_list())
    assert by_track["engine steps"] and sum(1 for e in trace["traceEvents"] if e["ph"] == "i") == sum(
        facts["evictions"].values())


def test_with_a_token_pages_demand_it(cluster, collector_factory, browser_page, tmp_path):
    collector, _ = cluster
    guarded = collector_factory(token="page-token", db=tmp_path / "copy.duckdb")
    guarded.db.write_bytes(collector.db.read_bytes())  # the running collector checkpointed at its last stop
    guarded.start()
    page = browser_page.page
    refused = page.goto(guarded.url + "/timeline?since=1h")
    assert refused.status == 401 and "?token=" in page.inner_text("body")
    assert page.request.get(guarded.url + "/cache.json").status == 401
    browser_page.errors.clear()  # the browser logs the 401 it was just shown
    entered = page.goto(guarded.url + "/timeline?since=1h&token=page-token")
    assert entered.status == 200 and page.url == guarded.url + "/timeline?since=1h"
    page.wait_for_function("document.getElementById('timeline').dataset.drawn !== undefined")
    assert page.request.get(guarded.url + "/cache.json").status == 200  # the cookie now opens every page
    browser_page.open(guarded.url + "/instances")
    browser_page.assert_clean()


def test_live_pages_show_new_requests_without_a_reload(collector_factory, engine_factory, browser_page):
    collector = collector_factory().start()
    engine = engine_factory("--heartbeat-interval", "0.5", collector=collector, instance_id="live").start()
    page = browser_page.page
    browser_page.open(collector.url + "/timeline?since=5m")
    page.wait_for_function("document.getElementById('timeline').dataset.requests === '0'")
    _chat(engine, "live-1", QUESTIONS[0], 4)
    # The engine exports within seconds and the page refetches its twin every 5 s: no reload.
    page.wait_for_function("document.getElementById('timeline').dataset.requests === '1'", timeout=45_000)
    browser_page.open(collector.url + "/?since=5m")
    assert page.locator('[data-metric="requests"]').first.get_attribute("data-value") == "1"
    _chat(engine, "live-2", QUESTIONS[1], 4)
    page.wait_for_function("document.querySelector('[data-metric=\"requests\"]').dataset.value === '2'",
                           timeout=45_000)
    browser_page.assert_clean()

"""Issue 4 acceptance: every slowness category and cache cause, produced for real by two real engines
and a real collector (the demo's scripted workload), with the verdicts' key evidence asserted.

The engines are stopped before anything is read (an engine exits only after exporting its
telemetry); verdicts are read through the collector's API and, after it stopped, through
``tokentrace analyze --db``, and the two must be identical.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
from collections import Counter

import httpx
import pytest
from harness_collector import CollectorProcess
from harness_engine import EngineProcess

from tokentrace.analyzers.evidence import baseline_text
from tokentrace.analyzers.render import render_slow
from tokentrace.demo_workload import INSTANCE_FLAGS, Cluster, run_workload

pytestmark = pytest.mark.slow
INSTANCE_IDS = {"A": "scen-a", "B": "scen-b"}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, tiny_model):
    """Run the workload once; returns the collector (running) and the requests shown."""
    workdir = tmp_path_factory.mktemp("scenarios")
    collector = CollectorProcess(workdir).start()
    engines = {key: EngineProcess(workdir, tiny_model, *INSTANCE_FLAGS[key], collector=collector,
                                  instance_id=INSTANCE_IDS[key]) for key in ("A", "B")}
    try:
        engines["A"].start()
        engines["B"].start(ready=False)  # --lazy-load: it loads on its first request
        shown = run_workload(Cluster({key: engine.url for key, engine in engines.items()}))
    finally:
        for engine in engines.values():
            assert engine.stop() == 0, engine.log_path.read_text()
    yield {"collector": collector, "shown": shown, "verdicts": {}}
    collector.stop()


def verdict(scenario, request_id: str, kind: str) -> dict:
    """One verdict through the collector's API (cached per test module)."""
    key = (request_id, kind)
    if key not in scenario["verdicts"]:
        collector = scenario["collector"]
        response = httpx.get(f"{collector.url}/api/requests/{request_id}/{kind}", timeout=60)
        assert response.status_code == 200, response.text
        scenario["verdicts"][key] = response.json()
    return scenario["verdicts"][key]


def evidence(result: dict, kind: str) -> list[dict]:
    return [item for item in result["evidence"] if item["kind"] == kind]


def test_cold_start_cites_the_load_it_waited_on(scenario):
    slow = verdict(scenario, "demo-cold-start", "slow")
    assert (slow["category"], slow["ttft_category"], slow["instance_id"]) == ("cold_start", "cold_start", "scen-b")
    [load] = evidence(slow, "load")
    assert load["lazy"] is True and load["load_wait_ms"] > 0
    assert {stage["name"] for stage in load["stages"]} == {"model.load.resolve", "model.load.weights",
                                                          "model.load.tokenizer", "model.load.warmup"}
    [dominant] = evidence(slow, "dominant_stage")
    assert dominant["ms"] == max(stage["ms"] for stage in load["stages"])
    assert slow["breakdown_ms"]["load_wait"] > max(slow["breakdown_ms"][k] for k in ("queue", "prefill", "decode"))


def test_queueing_names_the_requests_holding_the_slots(scenario):
    slow = verdict(scenario, "demo-queued", "slow")
    assert (slow["category"], slow["ttft_category"]) == ("queueing", "queueing")
    [depth] = evidence(slow, "queue_depth")
    assert (depth["running"], depth["max_batch"]) == (2, 2)
    blockers = {item["request_id"]: item for item in evidence(slow, "blocker")}
    assert set(blockers) == {"demo-long-gen-1", "demo-long-gen-2"}
    for item in blockers.values():
        assert item["completion_tokens"] == 300
        assert 0 < item["held_ms"] <= slow["breakdown_ms"]["queue"] + 1
    assert slow["abnormal"] is True  # nothing else on A queued like this
    # Issue 47: on the request page, a request id in the evidence is a link to that request's page;
    # the queue's sentence counts in words that agree ("2 requests").
    page = httpx.get(f"{scenario['collector'].url}/requests/demo-queued", timeout=60).text
    for rid in blockers:
        assert f'Request <a class="request-link" href="/requests/{rid}">{rid}</a> held a batch slot' in page
    assert re.match(r"Arrived with (1 request|\d+ requests) waiting and 2 running \(it admits 2 at once\)",
                    depth["text"]), depth["text"]


def test_long_uncached_prompt_is_prefill_with_its_cache_verdict(scenario):
    slow = verdict(scenario, "demo-long-prompt", "slow")
    assert slow["category"] == "prefill"
    [tokens] = evidence(slow, "prefill_tokens")
    assert tokens["uncached_tokens"] == slow["tokens"]["prompt"] > 1000 and tokens["cached_tokens"] == 0
    [rate] = evidence(slow, "prefill_rate")
    assert rate["tokens_per_s"] > 0
    [cache] = evidence(slow, "cache")
    assert (cache["result"], cache["cause"]) == ("miss", "new_prefix")


def test_contended_decode_names_the_interleaved_prefill(scenario):
    slow = verdict(scenario, "demo-contended-1", "slow")
    assert slow["category"] == "decode"
    [batch] = evidence(slow, "batch")
    assert batch["max_batch"] >= 3  # the three long generations decoded together
    [interference] = evidence(slow, "prefill_interference")
    assert "demo-interloper" in interference["prefill_request_ids"]
    assert interference["steps"] >= 2 and interference["prefill_tokens"] > 0
    assert evidence(slow, "tpot")[0]["tpot_ms"] == slow["breakdown_ms"]["tpot"]


def test_capacity_cites_the_eviction_and_the_insert_that_caused_it(scenario):
    cache = verdict(scenario, "demo-evicted-2", "cache")
    assert (cache["cause"], cache["result"]) == ("capacity", "miss")
    [eviction] = evidence(cache, "eviction")
    assert eviction["entry_request_id"] == "demo-evicted-1"
    assert eviction["reason"] == "max_entries"
    assert cache["evicted_by"] == eviction["evicted_by"]
    assert cache["evicted_by"].startswith("demo-filler-")
    assert cache["seen_tokens"] > cache["cached_tokens"]


def test_instance_change_names_the_instance_that_holds_the_prefix(scenario):
    cache = verdict(scenario, "demo-move-2", "cache")
    assert (cache["cause"], cache["instance_id"], cache["cached_on"]) == ("instance_change", "scen-b", "scen-a")
    [elsewhere] = evidence(cache, "cached_elsewhere")
    assert elsewhere["entry_request_id"] == "demo-move-1" and elsewhere["alive"] is True
    assert cache["seen_tokens"] >= elsewhere["covered_tokens"] > cache["cached_tokens"]


def test_prefix_change_reports_the_divergent_segment(scenario):
    cache = verdict(scenario, "demo-sys-changed", "cache")
    assert cache["cause"] == "prefix_change"
    assert cache["divergence"] == {"token_index": 0, "segment_role": "system", "segment_index": 0}
    [divergence] = evidence(cache, "divergence")
    assert divergence["earlier_request_id"] == "demo-sys-before"
    assert divergence["shared_segment_role"] == "user"


def _page(scenario, path: str) -> dict:
    response = httpx.get(f"{scenario['collector'].url}{path}", timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _segments(scenario, request_id: str) -> list[dict]:
    return _page(scenario, f"/requests/{request_id}.json")["segments"]


def test_edited_assistant_turn_names_the_assistant_message(scenario):
    """Issue 11 item 8: the first differing 16-token block starts inside the previous user message,
    but the change is in the assistant answer, and the divergence must say so."""
    cache = verdict(scenario, "demo-edit-3", "cache")
    assert cache["cause"] == "prefix_change"
    assert (cache["divergence"]["segment_role"], cache["divergence"]["segment_index"]) == ("assistant", 2)
    [divergence] = evidence(cache, "divergence")
    assert divergence["earlier_request_id"] == "demo-edit-2"
    edited = _segments(scenario, "demo-edit-3")[2]
    assert edited["role"] == "assistant"
    # The situation of the report: block granularity alone lands in the user message before it.
    assert divergence["block_token_index"] < edited["token_start"]
    assert edited["token_start"] <= cache["divergence"]["token_index"] < edited["token_end"]


def test_tools_block_added_is_a_template_divergence(scenario):
    cache = verdict(scenario, "demo-tools-after", "cache")
    assert cache["cause"] == "prefix_change"
    assert cache["divergence"] == {"token_index": 0, "segment_role": "template", "segment_index": None}
    [divergence] = evidence(cache, "divergence")
    assert divergence["earlier_request_id"] == "demo-tools-before"
    assert [s["role"] for s in _segments(scenario, "demo-tools-after")][:3] == ["tools", "system", "user"]


def test_shared_part_under_one_block_is_too_short(scenario):
    cache = verdict(scenario, "demo-short-2", "cache")
    assert (cache["result"], cache["cause"]) == ("miss", "too_short")
    [short] = evidence(cache, "too_short")
    assert short["earlier_request_id"] == "demo-short-1" and short["segments"] == 1
    assert 0 < short["shared_tokens"] < cache["block_size"]
    assert short["shared_tokens"] == _segments(scenario, "demo-short-2")[0]["token_end"]


@pytest.mark.parametrize(("request_id", "status", "error"), [("demo-too-long", 400, "context_length_exceeded"),
                                                              ("demo-unknown-model", 404, "model_not_found")])
def test_refused_request_is_rejected_not_cold_start(scenario, request_id, status, error):
    """Issue 11 item 8: a refused request was called cold_start ('waited 0.0 ms for the model to load')."""
    slow = verdict(scenario, request_id, "slow")
    assert (slow["outcome"], slow["category"], slow["ttft_category"]) == ("rejected", None, None)
    [outcome] = evidence(slow, "outcome")
    assert (outcome["http_status"], outcome["error_type"]) == (status, error)
    assert not evidence(slow, "load")
    assert all(value is None for key, value in slow["breakdown_ms"].items() if key != "e2e")
    cache = verdict(scenario, request_id, "cache")
    assert (cache["outcome"], cache["result"], cache["cause"]) == ("rejected", None, None)


def test_report_counts_refused_requests_apart(scenario):
    """Issue 11 item 8: the refused prompt's tokens dragged the token hit rate down."""
    report = _page(scenario, "/api/report?since=all&causes=0")
    assert _page(scenario, "/requests/demo-too-long.json")["request"]["prompt_tokens"] > 2048  # it would count
    rows = _page(scenario, "/timeline.json?since=all")["requests"]
    served = [(p or 0, c or 0) for p, c, status in zip(rows["prompt"], rows["cached"], rows["status"], strict=True)
              if status is None or status < 400]
    assert report["outcomes"]["rejected"] == 2
    assert report["outcomes"]["completed"] == len(served) == sum(report["categories"].values())
    assert report["cache"]["token_hit_rate"] == round(sum(c for _, c in served) / sum(p for p, _ in served), 4)
    assert sum(row["requests"] for row in report["instances"]) == len(served)
    assert "undecomposed" not in report["categories"]  # the MLX engine measures every part
    overview = _page(scenario, "/.json?since=all")
    assert overview["outcomes"]["rejected"] == 2 and overview["categories"]["cold_start"] == 1
    # Issue 47 item 2: the overview lists the requests that did not complete, not only their count.
    others = {rid: _outcome(row) for rid, row in _rows(scenario).items() if _outcome(row) != "completed"}
    assert {row["request_id"]: row["outcome"] for row in overview["not_completed"]} == others and len(others) == 2
    page = httpx.get(f"{scenario['collector'].url}/?since=all", timeout=60).text
    listed = page[page.index('id="not-completed"'):]
    for rid in others:
        assert f'<a href="/requests/{rid}">{rid}</a>' in listed, rid


def test_follow_up_turn_is_a_clean_hit(scenario):
    cache = verdict(scenario, "demo-hit-2", "cache")
    assert (cache["result"], cache["cause"]) == ("hit", None)
    assert cache["cached_tokens"] > 0 and cache["seen_tokens"] - cache["cached_tokens"] < cache["block_size"]


def test_first_time_prompt_is_a_new_prefix_miss(scenario):
    cache = verdict(scenario, "demo-long-prompt", "cache")
    assert (cache["result"], cache["cause"], cache["cached_tokens"], cache["seen_tokens"]) == ("miss", "new_prefix",
                                                                                               0, 0)


def test_a_request_fast_everywhere_is_not_abnormal(scenario):
    slow = verdict(scenario, "demo-fast", "slow")
    assert slow["abnormal"] is False
    assert slow["baseline"]["samples"] >= 3
    # Issue 11 item 8: units on every baseline figure, on the page as in the JSON. Issue 47: in words
    # and at a sensible precision, never a field name ("queue_ms 5627.7901 ms against a median of
    # 0.2422 ms").
    base = slow["baseline"]
    page = httpx.get(f"{scenario['collector'].url}/requests/demo-fast", timeout=60).text
    text = baseline_text(base)
    assert text in page and f"{base['metric']} {base['observed']}" not in page, text
    assert re.fullmatch(r"(queue|load wait|time per output token|prefill per uncached token) [0-9.]+ "
                        r"(ms|s|ms/token) against a median of [0-9.]+ (ms|s|ms/token) over \d+ comparable "
                        r"requests\.", text), text
    assert all(len(number.replace(".", "").lstrip("0")) <= 4 for number in re.findall(r"[0-9.]+(?= m?s)", text))
    line = render_slow(slow).splitlines()[1]
    assert f"abnormal: no ({text[:-1]})" in line, line


def test_every_shown_request_gets_the_verdict_its_scenario_shows(scenario):
    from tokentrace.demo import verdict_holds

    for item in scenario["shown"]:
        both = {kind: verdict(scenario, item.request_id, kind) for kind in ("slow", "cache")}
        assert verdict_holds(item, both), (item, both[item.verdict])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokentrace", "analyze", *args], capture_output=True, text=True,
                          timeout=120)


#: What ``analyze --url`` must never import: its whole start-up cost (issue 17, CLI verdicts under 300 ms).
HEAVY = ("duckdb", "polars", "pyarrow", "numpy", "mlx", "fastapi", "opentelemetry")
_IMPORTS = """
import contextlib, io, json, sys
from tokentrace.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "out": out.getvalue(), "engine": "_duckdb" in sys.modules,
                  "heavy": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}))
""".replace("HEAVY", repr(HEAVY))


@pytest.mark.parametrize("args", [("slow", "--request-id", "demo-queued"),
                                  ("slow", "--request-id", "demo-queued", "--slo", "ttft=2s", "--json"),
                                  ("cache", "--request-id", "demo-evicted-2"),
                                  ("report", "--since", "all")])
def test_url_verdicts_import_no_store_or_frame_library(scenario, args):
    """The --url path prints a real verdict without importing duckdb, polars, pyarrow (or the engine's libraries)."""
    url = scenario["collector"].url
    ran = subprocess.run([sys.executable, "-c", _IMPORTS, "analyze", *args, "--url", url], capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout.splitlines()[-1])
    assert result["code"] == 0 and result["out"].strip()
    if args[0] == "slow":
        assert "queueing" in result["out"]
    assert result["heavy"] == [] and not result["engine"]


def _rows(scenario) -> dict[str, dict]:
    """Every stored request's merged row (the request page's JSON twin), by id."""
    ids = _page(scenario, "/timeline.json?since=all")["requests"]["id"]
    return {rid: _page(scenario, f"/requests/{rid}.json")["request"] for rid in ids}


def _iso(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_a_report_of_an_absolute_window_and_a_slice_counts_those_requests_alone(scenario):
    """Issue 47 item 3: --from/--until (absolute times) and --instance/--model/--session/--request-prefix
    on analyze report, through the CLI and the API: each gives the counts made from the requests'
    own rows, and a slice's output tokens/s is its completion tokens over its own span (a benchmark's
    figure for its own requests)."""
    rows = _rows(scenario)
    url = scenario["collector"].url

    def report(*args: str) -> dict:
        out = _cli("report", "--url", url, "--json", *args)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    # A window between request starts (midpoints: no boundary falls on a request).
    starts = sorted(row["start_ns"] for row in rows.values())
    first, last = (starts[9] + starts[10]) // 2, (starts[29] + starts[30]) // 2
    inside = [row for row in rows.values() if first <= row["start_ns"] < last]
    windowed = report("--from", _iso(first), "--until", _iso(last))
    assert windowed["requests"] == len(inside) == 20
    assert windowed["outcomes"] == dict(Counter(_outcome(row) for row in inside))
    assert windowed["since_ns"] == pytest.approx(first, abs=2000) and windowed["until_ns"] == pytest.approx(
        last, abs=2000)  # ISO 8601 carries microseconds

    prefix = "demo-long-gen"
    mine = [row for rid, row in rows.items() if rid.startswith(prefix)]
    sliced = report("--since", "all", "--request-prefix", prefix)
    assert sliced["requests"] == len(mine) == 2 and sliced["slice"]["request_prefix"] == prefix
    text = _cli("report", "--url", url, "--since", "all", "--request-prefix", prefix).stdout.splitlines()
    assert text[:2] == ["2 requests: completed 2", f"slice: request ids {prefix}*"], text
    span_s = (max(r["end_ns"] for r in mine) - min(r["start_ns"] for r in mine)) / 1e9
    [instance] = sliced["instances"]
    assert instance["output_tokens_per_s"] == pytest.approx(sum(r["completion_tokens"] for r in mine) / span_s,
                                                            abs=0.01)

    for option, column, value in (("--instance", "instance_id", "scen-b"),
                                  ("--model", "model", rows["demo-queued"]["model"])):
        expected = [row for row in rows.values() if row[column] == value]
        assert report("--since", "all", option, value)["requests"] == len(expected) > 0, option
    session = next(row["session_id"] for row in rows.values() if row["session_id"])
    assert report("--since", "all", "--session", session)["requests"] == sum(
        1 for row in rows.values() if row["session_id"] == session)
    assert report("--since", "all", "--model", "a-model-nobody-sent")["requests"] == 0

    # One way to give a window, and times that read as times.
    both = _cli("report", "--url", url, "--since", "1h", "--from", _iso(first))
    assert both.returncode == 2 and "give --since (a window ending now) or --from/--until" in both.stderr
    assert both.stderr.count("\n") == 1, both.stderr
    bad = _cli("report", "--url", url, "--from", "yesterday")
    assert bad.returncode == 2 and "--from must be a time such as 2026-12-05T20:00:00Z" in bad.stderr
    api = httpx.get(f"{url}/api/report", params={"since": "1h", "from": _iso(first)}, timeout=60)
    assert api.status_code == 400 and "give since (a window ending now) or from/until" in api.text, api.text

    # The overview page takes the same window and slice, and gives the same counts.
    page = _page(scenario, f"/.json?request_prefix={prefix}&since=all")
    assert page["requests"] == 2 and page["slice"]["request_prefix"] == prefix
    assert page["throughput"]["output_tokens_per_s"] == pytest.approx(instance["output_tokens_per_s"], abs=0.01)
    window = httpx.get(f"{url}/.json", params={"from": _iso(first), "until": _iso(last)}, timeout=60).json()
    assert window["requests"] == len(inside) and window["outcomes"] == {**dict.fromkeys(window["outcomes"], 0),
                                                                         **windowed["outcomes"]}
    html = httpx.get(f"{url}/", params={"instance": "scen-b", "since": "all"}, timeout=60).text
    assert 'id="slice"' in html and "instance <b>scen-b</b>" in html
    assert _page(scenario, "/.json?instance=scen-b&since=all")["requests"] == report(
        "--since", "all", "--instance", "scen-b")["requests"]
    # ... and so does the timeline, whose live refresh keeps the slice.
    drawn = _page(scenario, f"/timeline.json?request_prefix={prefix}&since=all")
    assert sorted(drawn["requests"]["id"]) == sorted(rid for rid in rows if rid.startswith(prefix))
    assert f'data-src="/timeline.json?request_prefix={prefix}&amp;since=all"' in httpx.get(
        f"{url}/timeline", params={"request_prefix": prefix, "since": "all"}, timeout=60).text


def test_the_cache_page_takes_the_reports_window_and_slice(scenario):
    """Issue 47 item 3 on the cache page: its twin with an instance gives that instance's capacity and
    evictions alone (the two instances' add up to the whole), with a request-id prefix the hit rate
    and the causes of those requests alone, and with from/until the window's; the page says what the
    slice narrows."""
    rows = _rows(scenario)
    url = scenario["collector"].url
    whole = _page(scenario, "/cache.json?since=all")
    apart = {instance: _page(scenario, f"/cache.json?since=all&instance={instance}")
             for instance in INSTANCE_IDS.values()}
    for instance, page in apart.items():
        assert {row["instance_id"] for row in page["instances"]} <= {instance}, instance
        assert page["slice"]["instance_id"] == instance
    assert sum(page["evictions"]["total"] for page in apart.values()) == whole["evictions"]["total"] > 0

    prefix = "demo-evicted"
    mine = [row for rid, row in rows.items() if rid.startswith(prefix) and _outcome(row) == "completed"
            and row["cached_tokens"] is not None and row["prompt_tokens"]]
    sliced = _page(scenario, f"/cache.json?since=all&request_prefix={prefix}")
    assert sliced["hit_rate"]["token_hit_rate"] == pytest.approx(
        sum(r["cached_tokens"] for r in mine) / sum(r["prompt_tokens"] for r in mine), abs=1e-4)
    verdicts = Counter(_page(scenario, f"/requests/{row['request_id']}.json")["cache"]["cause"] or "none"
                       for row in mine if row["cached_tokens"] < row["prompt_tokens"])
    assert sliced["causes"] == dict(sorted(verdicts.items())) and "capacity" in sliced["causes"], sliced["causes"]
    html = httpx.get(f"{url}/cache", params={"request_prefix": prefix, "since": "all"}, timeout=60).text
    assert "requests whose id starts with <b>demo-evicted</b>" in html and 'id="slice-scope"' in html
    assert [row["instance_id"] for row in _page(scenario, "/instances.json?instance=scen-b")["instances"]] == [
        "scen-b"]
    # The window picker keeps the slice, and the links to the other pages carry window and slice.
    assert f'<input type="hidden" name="request_prefix" value="{prefix}">' in html
    assert f'href="/timeline?since=all&amp;request_prefix={prefix}"' in html

    starts = sorted(row["start_ns"] for row in rows.values())
    first, last = (starts[9] + starts[10]) // 2, (starts[29] + starts[30]) // 2
    window = httpx.get(f"{url}/cache.json", params={"from": _iso(first), "until": _iso(last)}, timeout=60).json()
    inside = [row for row in rows.values() if first <= row["start_ns"] < last and _outcome(row) == "completed"
              and row["cached_tokens"] is not None and row["prompt_tokens"]]
    assert window["window"]["until_ns"] == pytest.approx(last, abs=2000)
    assert window["hit_rate"]["token_hit_rate"] == pytest.approx(
        sum(r["cached_tokens"] for r in inside) / sum(r["prompt_tokens"] for r in inside), abs=1e-4)


def _outcome(row: dict) -> str:
    from tokentrace.analyzers.outcome import outcome_of

    return outcome_of(row)


# The next test stops the collector: it stays the last of the module.
def test_url_and_db_give_identical_verdicts_and_unknown_ids_exit_2(scenario):
    collector = scenario["collector"]
    ids = ["demo-queued", "demo-evicted-2", "demo-sys-changed", "demo-contended-1"]
    by_url = {(rid, kind): json.loads(_cli(kind, "--request-id", rid, "--url", collector.url, "--json").stdout)
              for rid in ids for kind in ("slow", "cache")}
    missing = _cli("slow", "--request-id", "no-such-request", "--url", collector.url)
    assert missing.returncode == 2 and "no request with id 'no-such-request'" in missing.stderr
    text = _cli("slow", "--request-id", "demo-queued", "--url", collector.url)
    assert text.returncode == 0 and "category: queueing" in text.stdout and "demo-long-gen-1" in text.stdout
    collector.stop()
    for (rid, kind), expected in by_url.items():
        result = _cli(kind, "--request-id", rid, "--db", str(collector.db), "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == expected, (rid, kind)
    missing = _cli("cache", "--request-id", "no-such-request", "--db", str(collector.db))
    assert missing.returncode == 2 and "no request with id 'no-such-request'" in missing.stderr
    # Issue 17 item 3: a --db verdict (slow: queueing and blockers; cache: an eviction) reads rows as
    # Python tuples through DuckDB's engine module alone: not duckdb's Python package (~120 ms of
    # start-up), polars, pyarrow or numpy (0.3-0.4 s between them).
    for kind, rid in (("slow", "demo-queued"), ("cache", "demo-evicted-2")):
        ran = subprocess.run([sys.executable, "-c", _IMPORTS, "analyze", kind, "--request-id", rid, "--db",
                              str(collector.db), "--json"], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
        result = json.loads(ran.stdout.splitlines()[-1])
        assert json.loads(result["out"]) == by_url[(rid, kind)]
        assert result["engine"] and result["heavy"] == [], (kind, result["heavy"])
    report = _cli("report", "--since", "all", "--db", str(collector.db), "--json")
    summary = json.loads(report.stdout)
    assert summary["requests"] == len(collector.sql("SELECT DISTINCT request_id FROM requests"))
    assert set(summary["categories"]) == {"cold_start", "queueing", "prefill", "decode"}
    assert summary["outcomes"]["rejected"] == 2
    text = _cli("report", "--since", "all", "--db", str(collector.db))
    assert "rejected 2" in text.stdout and "null" not in text.stdout
    assert {row["instance_id"] for row in summary["instances"]} == {"scen-a", "scen-b"}


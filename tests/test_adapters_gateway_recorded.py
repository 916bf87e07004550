"""The recorded engines behind the real gateway and a real collector: the adapter's reading of the
engine reaches the verdicts. The engine side is a local HTTP server answering with the recorded
documents of tests/fixtures/engines (Ollama and Exo cannot be installed here); the gateway polls it
as it would the real engine, and the test switches the documents between polls (a model unloading)."""

from __future__ import annotations

import httpx
import pytest
from harness_collector import wait_for
from harness_gateway import GatewayProcess, verdict
from harness_recorded import RecordedEngine, load

pytestmark = pytest.mark.slow


def _polls(engine: RecordedEngine, path: str) -> int:
    return sum(1 for method, seen, _ in engine.requests if method == "GET" and seen == path)


def _next_polls(engine: RecordedEngine, path: str, count: int = 2) -> None:
    """Wait until the gateway polled ``path`` ``count`` more times (the second one started after now)."""
    start = _polls(engine, path)
    wait_for(lambda: _polls(engine, path) >= start + count, 60, f"{count} gateway polls of {path}")


def test_ollama_load_after_keep_alive_expiry_is_a_cold_start_naming_the_expiry(tmp_path, collector_factory):
    docs = load("ollama")["documents"]
    collector = collector_factory().start()
    cold = docs["POST /api/chat cold"]
    routes = {"GET /api/version": (200, docs["GET /api/version"]), "GET /api/ps": (200, docs["GET /api/ps loaded"]),
              "POST /api/chat": (200, cold)}
    with RecordedEngine(routes) as engine:
        gw = GatewayProcess(tmp_path, {"ollama-1": engine.url}, collector=collector).start()
        try:
            _next_polls(engine, "/api/ps")
            engine.serve("GET /api/ps", docs["GET /api/ps unloaded"])
            _next_polls(engine, "/api/ps")
            question = [{"role": "user", "content": "Why is the sky blue?"}]
            answer = httpx.post(gw.url + "/api/chat", headers={"X-Request-Id": "ollama-cold"}, timeout=60,
                                json={"model": "gemma3:1b", "stream": False, "messages": question})
        finally:
            gw.stop()
    assert answer.status_code == 200 and answer.json() == cold  # passed through unchanged
    slow = verdict(collector, "ollama-cold")["slow"]
    assert slow["category"] == "cold_start"
    assert slow["breakdown_ms"]["load_wait"] == pytest.approx(cold["load_duration"] / 1e6, abs=1e-3)
    assert slow["breakdown_ms"]["prefill"] == pytest.approx(cold["prompt_eval_duration"] / 1e6, abs=1e-3)
    (reason,) = [e for e in slow["evidence"] if e["kind"] == "engine_reason"]
    assert reason["basis"] == "inferred" and reason["source"] == "ollama.cold_start"
    assert reason["text"].startswith("Model gemma3:1b was unloaded when its keep-alive expired at "
                                     "2026-03-01T10:05:00.123456+00:00")
    (reported,) = [e for e in slow["evidence"] if e["kind"] == "engine_reported"]
    assert reported["facts"]["ollama.load_duration_ns"] == cold["load_duration"]


def test_exo_request_that_waited_on_a_loading_runner_names_the_node_and_stage(tmp_path, collector_factory):
    fixture = load("exo")
    docs, ids = fixture["documents"], fixture["ids"]
    collector = collector_factory().start()
    routes = {"GET /node_id": (200, docs["GET /node_id"]), "GET /state": (200, docs["GET /state loading"]),
              "POST /v1/chat/completions": (200, docs["POST /v1/chat/completions"])}
    with RecordedEngine(routes) as engine:
        gw = GatewayProcess(tmp_path, {"exo": engine.url}, collector=collector).start()
        try:
            _next_polls(engine, "/state")
            answer = gw.chat([{"role": "user", "content": "Hello"}], "exo-cold", stream=False, model=ids["model"])
        finally:
            gw.stop()
    assert answer["status"] == 200
    slow = verdict(collector, "exo-cold")["slow"]
    (reason,) = [e for e in slow["evidence"] if e["kind"] == "engine_reason"]
    assert reason["source"] == "exo.cold_start" and reason["basis"] == "inferred"
    assert reason["text"] == (f"Waited on instance {ids['instance']}: runner {ids['runners'][1]} on node mini-2 "
                              "was Loading 12/24 layers.")


@pytest.mark.browser
def test_instances_page_shows_the_exo_instance_and_the_cold_start_links_to_it(tmp_path, collector_factory,
                                                                              browser_page):
    fixture = load("exo")
    docs, ids = fixture["documents"], fixture["ids"]
    collector = collector_factory().start()
    routes = {"GET /node_id": (200, docs["GET /node_id"]), "GET /state": (200, docs["GET /state loading"]),
              "POST /v1/chat/completions": (200, docs["POST /v1/chat/completions"])}
    with RecordedEngine(routes) as engine:
        gw = GatewayProcess(tmp_path, {"exo": engine.url}, collector=collector).start()
        try:
            _next_polls(engine, "/state")
            assert gw.chat([{"role": "user", "content": "Hi"}], "exo-page", stream=False,
                           model=ids["model"])["status"] == 200
        finally:
            gw.stop()
    verdict(collector, "exo-page")
    page = browser_page.page
    browser_page.open(collector.url + "/requests/exo-page")
    link = page.locator("li[data-kind=engine_reason] a.evidence-link")
    assert link.get_attribute("href") == f"/instances#exo-{ids['instance']}"
    link.click()
    page.wait_for_url(f"**/instances#exo-{ids['instance']}")
    section = page.locator(f"section#exo-{ids['instance']}")
    assert section.is_visible()
    n1, n2 = ids["nodes"][:2]
    assert section.locator(f"tr[data-node='{n1}'] td[data-stage]").inner_text() == "Ready"
    assert section.locator(f"tr[data-node='{n2}'] td[data-stage]").inner_text() == "Loading 12/24 layers"
    ready = {node: section.locator(f"tr[data-node='{node}'] td[data-state=runner_ready]").inner_text()
             for node in (n1, n2)}
    assert ready == {n1: "yes", n2: "no"}
    files = section.locator("td[data-state=files_present]").all_inner_texts()
    assert files == ["yes", "yes"]
    assert "mini-1" in section.inner_text() and "mini-2" in section.inner_text()
    # The same node table as a tokentrace cluster's: Exo's device ranks in order, what each holds (its
    # end layer is exclusive), the free memory /state reports; what /state does not say is n/a.
    rows = section.locator("table.nodes tr[data-node]")
    assert rows.evaluate_all("rows => rows.map(r => [r.dataset.rank, r.dataset.node])") == [["0", n1], ["1", n2]]
    assert section.locator("td[data-metric=placement]").all_inner_texts() == ["layers 0-23 of 48", "layers 24-47 of 48"]
    free = section.locator("td[data-metric=memory_free_bytes]")
    assert free.evaluate_all("cells => cells.map(c => c.dataset.value)") == ["14000000000", "22000000000"]
    assert section.locator("td[data-metric=weight_bytes]").all_inner_texts() == ["n/a", "n/a"]
    browser_page.screenshot("exo-instances")
    browser_page.assert_clean()

"""Agent sessions (issue 16 item 2), on a real engine: a session of five turns with a long gap during
which other requests evict its cache entry. The session verdict names the gap, the evicting insert and
the turn that came back cold; per instance, the gap beyond which follow-ups come back cold.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess

from tokentrace.demo_workload import chat, reply

pytestmark = pytest.mark.slow
SESSION = "agent-7"
FILLERS = 4  # the engine keeps 3 entries: four other prompts push the session's out


def _text(seed: int, words: int = 80) -> str:
    vocabulary = ("tool", "call", "result", "agent", "plan", "step", "file", "search", "answer", "check")
    state, out = seed * 7907 + 3, []
    for _ in range(words):
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(vocabulary[state % len(vocabulary)])
    return f"({seed}) " + " ".join(out)


@pytest.fixture(scope="module")
def session(tmp_path_factory, tiny_model):
    workdir = tmp_path_factory.mktemp("session")
    # A loaded machine can make an export time out: the engines then spool, and the collector
    # ingests their spool, so every span arrives either way.
    spool = workdir / "spool"
    collector = CollectorProcess(workdir, "--spool-dir", str(spool)).start()
    engine = EngineProcess(workdir, tiny_model, "--cache-max-entries", "3", collector=collector,
                           spool_dir=spool, instance_id="agent-box")
    try:
        engine.start()
        messages = [{"role": "system", "content": _text(0, 120)}]
        for turn in range(5):
            if turn == 3:  # the long tool call: meanwhile, other work fills the cache
                for i in range(FILLERS):
                    chat(engine.url, f"filler-{i}", [{"role": "user", "content": _text(100 + i, 120)}], 4)
            messages.append({"role": "user", "content": _text(10 + turn, 30)})
            answer = chat(engine.url, f"{SESSION}-turn-{turn}", messages, 8, session=SESSION)
            messages.append(reply(answer))
    finally:
        assert engine.stop() == 0, engine.log_path.read_text()
    wait_for(lambda: not list(spool.glob("*.pb*")), 120, "the collector to ingest the engine's spool")
    yield collector
    collector.stop()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokentrace", "analyze", "session", *args], capture_output=True,
                          text=True, timeout=300)


def test_session_verdict_names_the_gap_the_evicting_insert_and_the_cold_turn(session):
    response = httpx.get(f"{session.url}/api/sessions/{SESSION}", timeout=120)
    assert response.status_code == 200, response.text
    verdict = response.json()
    turns = verdict["turns"]
    assert [t["request_id"] for t in turns] == [f"{SESSION}-turn-{i}" for i in range(5)]
    assert turns[0]["gap_ms"] is None and all(t["gap_ms"] > 0 for t in turns[1:])
    assert turns[3]["gap_ms"] > max(turns[i]["gap_ms"] for i in (1, 2, 4))  # the fillers ran in that gap
    assert [t["survived"] for t in turns] == [None, True, True, False, True]
    assert verdict["cold_turns"] == [3]
    cold = turns[3]
    assert cold["cache"]["cause"] == "capacity" and cold["cached_tokens"] < turns[2]["prompt_tokens"]
    taken = cold["taken_by"]
    assert taken["cause"] == "capacity" and taken["evicted_by"].startswith("filler-")
    assert taken["entry_request_id"].startswith(f"{SESSION}-turn-")
    assert turns[2]["end_ns"] < taken["evicted_at_ns"] < cold["start_ns"]  # evicted during the gap
    for t in turns:
        assert t["ttft_ms"] > 0 and t["prompt_tokens"] > 0 and t["slow"]["category"]
    assert turns[4]["cached_tokens"] >= turns[3]["prompt_tokens"] // 16 * 16 - 16  # warm again after a short gap
    [item] = verdict["evidence"]
    assert (item["kind"], item["turn"], item["evicted_by"], item["gap_ms"]) == (
        "cold_turn", 3, taken["evicted_by"], cold["gap_ms"])
    assert taken["evicted_by"] in item["text"] and "Turn 3" in item["text"]
    [instance] = verdict["instances"]
    assert instance["instance_id"] == "agent-box"
    assert (instance["follow_ups"], instance["warm"], instance["cold"]) == (4, 3, 1)
    assert instance["cold_after_ms"] == pytest.approx(cold["gap_ms"], abs=0.01)
    assert instance["longest_warm_gap_ms"] == pytest.approx(max(turns[i]["gap_ms"] for i in (1, 2, 4)), abs=0.01)


def test_cache_page_counts_sessions_of_the_median_length_that_fit_in_the_kv_budget(session):
    turns = httpx.get(f"{session.url}/api/sessions/{SESSION}", timeout=120).json()["turns"]
    lengths = [turns[-1]["prompt_tokens"] + turns[-1]["completion_tokens"]]  # a session: its longest context
    for i in range(FILLERS):  # no session id: each its own session
        row = httpx.get(f"{session.url}/requests/filler-{i}.json", timeout=60).json()["request"]
        lengths.append(row["prompt_tokens"] + row["completion_tokens"])
    median = sorted(lengths)[len(lengths) // 2]
    rows = httpx.get(f"{session.url}/cache.json", params={"since": "all"}, timeout=60).json()["instances"]
    row = next(row for row in rows if row["instance_id"] == "agent-box")
    assert row["median_session_tokens"] == median
    assert row["session_bytes"] == median * row["kv_bytes_per_token"]
    free_bytes, free_entries = row["max_bytes"] - row["bytes"], row["max_entries"] - row["entries"]
    assert row["more_sessions"] == min(free_bytes // row["session_bytes"], free_entries)
    assert row["sessions_in_all"] == min(row["max_bytes"] // row["session_bytes"], row["max_entries"])


@pytest.mark.browser
def test_session_page_in_a_browser_shows_its_twins_numbers_and_is_reached_from_a_request(session, browser_page):
    page = browser_page.page
    browser_page.open(f"{session.url}/requests/{SESSION}-turn-3")
    page.click("#session-id a")
    page.wait_for_url(f"**/sessions/{SESSION}")
    page.wait_for_load_state("networkidle")
    browser_page.screenshot("session")
    browser_page.assert_clean()
    twin = page.request.get(f"{session.url}/sessions/{SESSION}.json").json()
    shown = page.evaluate("""() => Array.from(document.querySelectorAll('[data-turn]')).map(row => ({
        turn: row.dataset.turn,
        gap: row.querySelector('[data-metric="gap_ms"]').dataset.value,
        survived: row.querySelector('[data-metric="survived"]').dataset.value,
        text: row.querySelector('[data-metric="survived"]').textContent.trim()}))""")
    assert [row["turn"] for row in shown] == [str(t["turn"]) for t in twin["turns"]]
    for row, turn in zip(shown, twin["turns"], strict=True):
        assert row["gap"] == str(turn["gap_ms"])
        assert row["survived"] == str(turn["survived"])
    assert shown[3]["text"] == f"no: evicted by {twin['turns'][3]['taken_by']['evicted_by']}"
    assert page.locator('[data-instance="agent-box"] [data-metric="cold_after_ms"]').get_attribute(
        "data-value") == str(twin["instances"][0]["cold_after_ms"])


def test_session_page_and_cli_agree_and_request_pages_link_to_it(session):
    twin = httpx.get(f"{session.url}/sessions/{SESSION}.json", timeout=120).json()
    api = httpx.get(f"{session.url}/api/sessions/{SESSION}", timeout=120).json()
    assert {k: v for k, v in twin.items() if k != "charts"} == api
    html = httpx.get(f"{session.url}/sessions/{SESSION}", timeout=120).text
    assert 'data-turn="4"' in html and 'href="/requests/filler-' in html
    request_page = httpx.get(f"{session.url}/requests/{SESSION}-turn-0", timeout=120).text
    assert f'href="/sessions/{SESSION}"' in request_page
    by_url = _cli("--session-id", SESSION, "--url", session.url, "--json")
    assert by_url.returncode == 0, by_url.stderr
    assert json.loads(by_url.stdout) == api
    text = _cli("--session-id", SESSION, "--url", session.url)
    assert text.returncode == 0 and "came back after a gap" in text.stdout and "agent-box" in text.stdout
    missing = httpx.get(f"{session.url}/api/sessions/no-such-session", timeout=60)
    assert missing.status_code == 404
    assert _cli("--session-id", "no-such-session", "--url", session.url).returncode == 2
    assert session.stop() == 0  # last: the stopped collector's file gives the same verdict
    by_db = _cli("--session-id", SESSION, "--db", str(session.db), "--json")
    assert by_db.returncode == 0, by_db.stderr
    assert json.loads(by_db.stdout) == api


CHANGED = "agent-edits"


@pytest.fixture(scope="module")
def changed_session(tmp_path_factory, tiny_model):
    """A session whose one cold follow-up is a changed prompt (its system prompt rewritten), after the
    longest gap (a filler request runs in it); nothing is evicted (the cache keeps 16 entries)."""
    workdir = tmp_path_factory.mktemp("changed-session")
    spool = workdir / "spool"
    collector = CollectorProcess(workdir, "--spool-dir", str(spool)).start()
    engine = EngineProcess(workdir, tiny_model, "--cache-max-entries", "16", collector=collector,
                           spool_dir=spool, instance_id="edit-box")
    try:
        engine.start()
        messages = [{"role": "system", "content": _text(200, 120)}, {"role": "user", "content": _text(201, 30)}]
        messages.append(reply(chat(engine.url, f"{CHANGED}-turn-0", messages, 8, session=CHANGED)))
        messages.append({"role": "user", "content": _text(202, 30)})
        messages.append(reply(chat(engine.url, f"{CHANGED}-turn-1", messages, 8, session=CHANGED)))
        chat(engine.url, "edit-filler", [{"role": "user", "content": _text(203, 120)}], 24)  # the long gap
        messages[0] = {"role": "system", "content": _text(204, 120)}  # the application rewrote its prompt
        messages.append({"role": "user", "content": _text(205, 30)})
        messages.append(reply(chat(engine.url, f"{CHANGED}-turn-2", messages, 8, session=CHANGED)))
        messages.append({"role": "user", "content": _text(206, 30)})
        chat(engine.url, f"{CHANGED}-turn-3", messages, 8, session=CHANGED)
    finally:
        assert engine.stop() == 0, engine.log_path.read_text()
    wait_for(lambda: not list(spool.glob("*.pb*")), 120, "the collector to ingest the engine's spool")
    yield collector
    collector.stop()


def test_a_changed_prompt_after_the_longest_gap_invents_no_keep_alive_limit(changed_session):
    verdict = httpx.get(f"{changed_session.url}/api/sessions/{CHANGED}", timeout=120).json()
    turns = verdict["turns"]
    assert turns[2]["gap_ms"] > max(turns[1]["gap_ms"], turns[3]["gap_ms"])  # the filler ran in that gap
    assert turns[2]["cache"]["cause"] == "prefix_change", turns[2]["cache"]
    assert verdict["cold_turns"] == [] and [t["survived"] for t in turns] == [None, True, True, True]
    [instance] = verdict["instances"]
    # Turn 2 did not come back warm, but its prompt changed: it says nothing about how long the
    # cache keeps a session (the old verdict: "cold after gaps of <turn 2's gap> or more").
    assert instance["cold_after_ms"] is None, instance
    assert (instance["warm"], instance["cold"], instance["changed"]) == (2, 0, 1), instance
    text = _cli("--session-id", CHANGED, "--url", changed_session.url)
    assert text.returncode == 0, text.stderr
    assert "0 came back to a cold cache" in text.stdout
    assert "come back cold after gaps of unknown" in text.stdout and "1 with a changed prompt" in text.stdout
    assert "None" not in text.stdout
    page = httpx.get(f"{changed_session.url}/sessions/{CHANGED}", timeout=120).text
    assert '<td class="n">1</td><td class="n">0</td>' in page and ">unknown</td>" in page  # changed 1, unknown 0

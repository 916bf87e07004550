"""The query API answers every error with one JSON envelope: {"error": {status, code, message}}."""

from __future__ import annotations

import httpx
import pytest

from tokentrace.collector.receiver.app import MISSING_TOKEN, WRONG_TOKEN


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    from harness_collector import CollectorProcess

    process = CollectorProcess(tmp_path_factory.mktemp("api"), token="tok-123").start()
    yield process
    process.stop()


#: Every path that takes ?since=.
_WINDOWED = ("/", "/.json", "/timeline", "/timeline.json", "/cache.json", "/api/report", "/api/export/perfetto")
CASES = [
    ("unknown request id (slow)", "GET", "/api/requests/no-such-id/slow", 404, "not_found",
     "no request with id 'no-such-id' in the store"),
    ("unknown request id (cache)", "GET", "/api/requests/no-such-id/cache", 404, "not_found", "no-such-id"),
    ("unknown request id (both)", "GET", "/api/requests/no-such-id/verdict", 404, "not_found", "no-such-id"),
    ("bad window", "GET", "/api/report?since=yesterday", 400, "bad_parameter",
     "since must be a duration such as 30s, 15m, 1h or 2d, received 'yesterday'"),
    ("bad number", "GET", "/api/report?causes=many", 400, "bad_parameter", "query.causes"),
    ("unknown path", "GET", "/api/nothing-here", 404, "not_found", "Not Found"),
    # Issue 11 item 5: each of these was a 500 (OverflowError, ENAMETOOLONG).
    *[(f"400-digit window on {path}", "GET", f"{path}?since={'9' * 400}m", 400, "bad_parameter",
       "since must be a duration such as 30s") for path in _WINDOWED],
    *[(f"window past 64 bits on {path}", "GET", f"{path}?since={'9' * 30}d", 400, "bad_parameter",
       "since must be at most 100 years") for path in _WINDOWED],
    ("causes past 64 bits", "GET", "/api/report?causes=99999999999999999999", 400, "bad_parameter", "query.causes"),
    ("negative causes", "GET", "/api/report?causes=-1", 400, "bad_parameter", "query.causes"),
    ("static name of 300 characters", "GET", "/static/" + "a" * 296 + ".css", 400, "bad_parameter",
     "a static file name has at most 255 bytes"),
    ("wrong method", "DELETE", "/api/report", 405, "method_not_allowed", "Method Not Allowed"),
]


@pytest.mark.parametrize(("caption", "method", "path", "status", "code", "fragment"), CASES,
                         ids=[case[0] for case in CASES])
def test_errors_use_the_envelope(collector, caption, method, path, status, code, fragment):
    response = httpx.request(method, collector.url + path, headers=collector.headers)
    assert response.status_code == status, response.text[:300]
    if not response.headers["content-type"].startswith("application/json"):  # a page: the message in HTML
        assert path.split("?")[0] in ("/", "/timeline") and fragment in response.text
        return
    error = response.json()["error"]
    assert (error["status"], error["code"]) == (status, code)
    assert fragment in error["message"]


def test_missing_token_uses_the_envelope(collector):
    response = httpx.get(collector.url + "/api/report")
    assert response.status_code == 401
    assert response.json() == {"error": {"status": 401, "code": "unauthorized", "message": MISSING_TOKEN}}
    wrong = httpx.get(collector.url + "/api/report", headers={"Authorization": "Bearer not-the-token"})
    assert wrong.status_code == 401
    assert wrong.json() == {"error": {"status": 401, "code": "unauthorized", "message": WRONG_TOKEN}}
    assert "?token=" in MISSING_TOKEN and MISSING_TOKEN != WRONG_TOKEN


def test_a_browser_without_the_token_gets_a_page_that_says_how(collector):
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    page = httpx.get(collector.url + "/", headers=browser)
    assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
    assert "?token=" in page.text and "needs a token" in page.text
    wrong = httpx.get(collector.url + "/", headers=browser, cookies={"tokentrace_token": "stale"})
    assert wrong.status_code == 401 and "Wrong token" in wrong.text


def test_empty_store_report_is_a_valid_answer(collector):
    response = httpx.get(collector.url + "/api/report?since=all", headers=collector.headers)
    assert response.status_code == 200
    assert response.json()["requests"] == 0

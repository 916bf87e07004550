"""With --token, every endpoint demands it and nothing unauthenticated is stored."""

from __future__ import annotations

import httpx
from test_collector_errors import make_request


def test_token_is_required_everywhere_and_nothing_unauthenticated_is_stored(collector_factory):
    collector = collector_factory(token="s3cret-token").start()
    body = make_request(3, name="authorized").SerializeToString()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"}):
        response = httpx.post(collector.url + "/v1/traces", content=body,
                              headers={"Content-Type": "application/x-protobuf", **headers})
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.json()["error"]["code"] == "unauthorized"
        assert httpx.get(collector.url + "/healthz", headers=headers).status_code == 401
    assert collector.post(body, "application/x-protobuf").status_code == 200  # the harness sends the token

    # A browser cannot send a header: ?token= sets an HttpOnly cookie and drops the token from the URL.
    response = httpx.get(collector.url + "/healthz?token=s3cret-token&x=1")
    assert response.status_code == 303
    assert response.headers["location"] == "/healthz?x=1"
    assert "HttpOnly" in response.headers["set-cookie"]
    with httpx.Client(base_url=collector.url, cookies=response.cookies) as browser:
        assert browser.get("/healthz").status_code == 200
    assert httpx.get(collector.url + "/healthz?token=wrong").status_code == 401
    assert collector.stop() == 0
    assert collector.sql("SELECT count(*), min(name) FROM spans") == [(3, "authorized")]

"""A distributed engine (issue 46): ``tokentrace engine --ranks 2`` runs two ranks of one instance
over MLX's ring backend on 127.0.0.1, for real, in pipeline and tensor placement.

It must answer as one process does (the same tokens for a seeded request, batching, the prompt
cache), every rank must report for itself (its load with the ring joined and its shard placed,
heartbeats and steps from its own process), and a lost rank must never hang a client: the open
request fails, new ones get 503 with the reason, /health says degraded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tokentrace import contract


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory) -> Path:
    """A small qwen2 model (4 layers): both placements, layers to split."""
    directory = tmp_path_factory.mktemp("models") / "q2"
    subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(directory), "--arch", "qwen2",
                    "--size", "small"], check=True, capture_output=True, timeout=300)
    return directory


SEEDED = {"messages": [{"role": "user", "content": "Tell me a story about the sea and the ships on it"}],
          "max_tokens": 24, "temperature": 0.9, "seed": 7}


def _ranks(pid: int) -> list[int]:
    """The engine's child processes that are ranks (not its span exporter)."""
    children = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [child for child in children if b"\0engine\0" in Path(f"/proc/{child}/cmdline").read_bytes()]


@pytest.mark.parametrize(("placement", "layers"), [
    (["--parallel", "pipeline", "--split", "3,1"], ["layers 1-3 of 4", "layers 0-0 of 4"]),
    (["--parallel", "tensor"], ["tensor shard 1 of 2", "tensor shard 2 of 2"]),
])
def test_two_ranks_answer_as_one_process_and_each_reports_itself(engine_factory, collector_factory, qwen2_model,
                                                                 placement, layers):
    collector = collector_factory().start()
    single = engine_factory(model=qwen2_model, instance_id="single", collector=collector).start()
    expected = single.chat(**SEEDED).json()["choices"][0]["message"]["content"]
    single.stop()

    cluster = engine_factory("--ranks", "2", *placement, model=qwen2_model, instance_id="ring",
                             collector=collector).start()
    assert len(_ranks(cluster.proc.pid)) == 1
    first = cluster.chat(**SEEDED).json()
    assert first["choices"][0]["message"]["content"] == expected  # the same tokens as one process
    again = cluster.chat(**SEEDED).json()
    assert again["choices"][0]["message"]["content"] == expected
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prompt cache, on both ranks
    with ThreadPoolExecutor(4) as pool:  # a batch: sequences join and leave while others run
        answers = list(pool.map(lambda i: cluster.chat(
            [{"role": "user", "content": f"story number {i}"}], max_tokens=8 + 4 * i, temperature=0.8), range(4)))
    assert [answer.status_code for answer in answers] == [200] * 4
    assert [answer.json()["usage"]["completion_tokens"] <= 8 + 4 * i for i, answer in enumerate(answers)]
    assert cluster.stop() == 0
    collector.stop()

    # Every rank's load, from its own process: ring joined, shard placed, its weights read.
    stages = collector.sql("SELECT instance_id, name, bytes FROM load_stages WHERE instance_id LIKE 'ring%' "
                           "ORDER BY instance_id, start_ns")
    by_rank = {rank: [name for instance, name, _ in stages if instance == rank] for rank in ("ring", "ring/rank1")}
    for names in by_rank.values():
        assert names[:2] == [contract.SPAN_LOAD_GROUP, contract.SPAN_LOAD_RESOLVE], names
        assert contract.SPAN_LOAD_SHARD in names and names[-1] == contract.SPAN_LOAD_WARMUP
    single_bytes = collector.sql("SELECT bytes FROM load_stages WHERE instance_id = 'single' AND bytes > 0")[0][0]
    shard_bytes = {instance: b for instance, name, b in stages if name == contract.SPAN_LOAD_WEIGHTS}
    assert all(b < single_bytes for b in shard_bytes.values()), (shard_bytes, single_bytes)
    held = {instance: json.loads(attributes)[contract.NODE_PLACEMENT] for instance, attributes in collector.sql(
        "SELECT instance_id, attributes FROM spans WHERE name = ? AND instance_id LIKE 'ring%'",
        [contract.SPAN_LOAD_SHARD])}
    assert held == {"ring": layers[0], "ring/rank1": layers[1]}
    resources = {instance: json.loads(resource) for instance, resource in collector.sql(
        "SELECT DISTINCT instance_id, resource FROM spans WHERE instance_id LIKE 'ring%'")}
    assert {(r[contract.NODE_RANK], r[contract.NODE_RANKS], r[contract.NODE_OF]) for r in resources.values()} == {
        (0, 2, "ring"), (1, 2, "ring")}
    # Rank 1's own heartbeats and steps: it ran every step rank 0 ran, with its own timings.
    assert collector.sql("SELECT count(*) FROM heartbeats WHERE instance_id = 'ring/rank1'")[0][0] >= 1
    steps = dict(collector.sql("SELECT instance_id, sum(decode_tokens) FROM steps WHERE instance_id LIKE 'ring%' "
                               "GROUP BY instance_id"))
    assert steps["ring"] == steps["ring/rank1"] > 0
    # Rank 0's requests are the instance's, as for one process; rank 1 answers none.
    requests = dict(collector.sql("SELECT instance_id, count(*) FROM requests WHERE instance_id LIKE 'ring%' "
                                  "GROUP BY instance_id"))
    assert requests == {"ring": 6}


def test_a_lost_rank_fails_the_open_request_and_refuses_new_ones_with_the_reason(engine_factory, qwen2_model):
    cluster = engine_factory("--ranks", "2", model=qwen2_model, instance_id="ring").start()
    (rank1,) = _ranks(cluster.proc.pid)
    first_token = threading.Event()

    def long_stream() -> list[dict]:
        events = []
        body = {"messages": [{"role": "user", "content": "a long one"}], "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
                    first_token.set()
        return events

    with ThreadPoolExecutor(1) as pool:
        open_request = pool.submit(long_stream)
        assert first_token.wait(60), "the long generation did not start"
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        events = open_request.result(timeout=30)
    assert time.monotonic() - killed < 10
    assert "error" in events[-1] and "rank" in events[-1]["error"]["message"], events[-1]
    health = httpx.get(cluster.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "degraded", health.text
    assert "rank" in health.json()["reason"], health.text
    refused = cluster.chat([{"role": "user", "content": "hello"}], max_tokens=4)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "instance_degraded"
    assert refused.json()["error"]["message"].startswith("this instance cannot serve:")
    assert cluster.proc.poll() is None  # rank 0 still answers (/health, refusals): it neither hangs nor dies

"""One request's failure stays its own (issue 12 §1), on the real engine and the tiny model.

- Bad sampling values are 400s naming the parameter, while long generations run; every good
  generation completes with the tokens it has when run alone (issue: three unrelated 400-token
  generations failed at token 139 after one ``top_k: 1000000000``).
- Inside the loop, a sequence whose own sampler or logits processor raises (values that bypass the
  API boundary, sent straight to the scheduler) is removed with an error; the batch goes on.
- /health answers quickly while 3,000-message chats hammer the engine (issue: 18-20 s stalls).
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest
from harness_engine import EngineProcess, streamed_text
from test_engine_scheduler import Harness

from tokentrace.engine_shim.mlx.jobs import Job, Sampling
from tokentrace.engine_shim.mlx.prompts import Prompt
from tokentrace.engine_shim.mlx.records import RequestRecord

pytestmark = pytest.mark.slow

LONG = 400
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 300, 12, 12, 90]]

BAD_FIELDS = [
    ({"temperature": 1.0, "top_k": 1_000_000_000}, "top_k"),
    ({"temperature": 1.0, "top_k": 512}, "top_k"),  # the vocabulary size: mlx-lm accepts (0, 512)
    ({"temperature": 1.0, "top_k": -1}, "top_k"),
    ({"temperature": 1.0, "min_p": -1}, "min_p"),
    ({"temperature": 1.0, "min_p": 2}, "min_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"xtc_threshold": 0.7, "xtc_probability": 0.5, "temperature": 1.0}, "xtc_threshold"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"logit_bias": {"99999": 5}}, "logit_bias"),
    ({"logit_bias": {"7": 1000}}, "logit_bias"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"seed": "seven"}, "seed"),
    ({"frequency_penalty": "much"}, "frequency_penalty"),
]
RAW_BAD = [
    (b'{"prompt": [5, 6], "temperature": 1.0, "min_p": NaN}', "NaN"),
    (b'{"prompt": [5, 6], "temperature": Infinity}', "Infinity"),
    (b'{"prompt": [5, 6], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper"),
    (b'{"prompt": [5, 6], "x": ' + b"[" * 200 + b"]" * 200 + b"}", "nested deeper"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model):
    process = EngineProcess(tmp_path_factory.mktemp("isolation"), tiny_model, "--max-batch", "8").start()
    yield process
    assert process.stop() == 0


def _long(engine: EngineProcess, prompt: list[int]) -> httpx.Response:
    return engine.post("/v1/completions", {"prompt": prompt, "max_tokens": LONG, "ignore_eos": True,
                                           "temperature": 0}, timeout=300)


def _tokens(response: httpx.Response) -> tuple[int, str]:
    """(tokens generated, text): greedy decoding on the same prompt gives the same text."""
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    return body["usage"]["completion_tokens"], body["choices"][0]["text"]


def test_bad_requests_are_400s_and_long_generations_finish_as_if_alone(engine):
    alone = [_tokens(_long(engine, prompt)) for prompt in PROMPTS]
    assert all(count == LONG for count, _ in alone)
    streams: dict[int, list[dict]] = {}
    generating = [threading.Event() for _ in PROMPTS]  # a first chunk arrived
    finished = [threading.Event() for _ in PROMPTS]

    def run(i: int) -> None:
        events = []
        with httpx.stream("POST", engine.url + "/v1/completions", timeout=300,
                          json={"prompt": PROMPTS[i], "max_tokens": LONG, "ignore_eos": True, "temperature": 0,
                                "stream": True, "stream_options": {"include_usage": True}}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    generating[i].set()
        streams[i] = events
        finished[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    assert all(event.wait(120) for event in generating)
    mid_generation = 0  # bad requests answered while all three were still generating
    for _ in range(3):  # bad requests keep arriving while the long ones generate
        for fields, param in BAD_FIELDS:
            response = engine.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 30, **fields})
            assert response.status_code == 400, (fields, response.text)
            error = response.json()["error"]
            assert error["param"] == param and f"'{param}'" in error["message"], error
            mid_generation += not any(event.is_set() for event in finished)
        for body, words in RAW_BAD:
            response = engine.post("/v1/completions", body)
            assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    for thread in threads:
        thread.join(300)
    assert mid_generation >= 1, "no bad request arrived while the long generations ran"
    together = [(streams[i][-1]["usage"]["completion_tokens"], streamed_text(streams[i])) for i in range(len(PROMPTS))]
    assert together == alone


class _Tokens(Harness):
    """The scheduler harness, also keeping every delivered token."""

    def __init__(self, model, **settings):
        self.tokens: dict[str, list[int]] = {}
        super().__init__(model, **settings)

    def _deliver(self, items):
        with self.done:
            for job, token, _reason in items:
                if token >= 0:
                    self.tokens.setdefault(job.record.request_id, []).append(token)
        super()._deliver(items)

    def submit_sampling(self, rid: str, tokens: list[int], max_tokens: int, sampling: Sampling) -> Job:
        record = RequestRecord(rid, "/test", time.perf_counter_ns())
        record.prompt = Prompt(tokens, ["prompt"], [0], [len(tokens)])
        job = Job(record=record, tokens=tokens, max_tokens=max_tokens, sampling=sampling)
        self.scheduler.submit(job)
        return job


def _in_loop_failures() -> dict[str, Sampling]:
    """Values the API refuses, sent straight to the scheduler: each makes mlx-lm raise inside the
    batched step (the sampler at sampling time, a logits processor when it is applied)."""
    return {
        "top-k": Sampling(temperature=1.0, top_k=1_000_000_000),
        "min-p": Sampling(temperature=1.0, min_p=2.0),
        "processor": Sampling(frequency_penalty="much"),  # type: ignore[arg-type]
    }


def test_a_sequence_failing_inside_the_batch_is_removed_and_the_batch_goes_on(tiny_model):
    h = _Tokens(tiny_model, max_batch=8, cache_max_entries=0)
    try:
        greedy = Sampling(ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            h.submit_sampling(f"alone-{i}", prompt, LONG, greedy)
            h.wait(f"alone-{i}")
        for i, prompt in enumerate(PROMPTS):
            h.submit_sampling(f"good-{i}", prompt, LONG, greedy)
        with h.done:  # the bad ones arrive mid-generation
            assert h.done.wait_for(lambda: all(len(h.tokens.get(f"good-{i}", [])) >= 50 for i in range(3)), 120)
        bad = {name: h.submit_sampling(f"bad-{name}", [5, 6, 7], 30, sampling)
               for name, sampling in _in_loop_failures().items()}
        finished = h.wait(*[f"good-{i}" for i in range(3)], *[f"bad-{name}" for name in bad])
        assert {rid: reason for rid, reason in finished.items() if rid.startswith("bad-")} == \
            {f"bad-{name}": "error" for name in bad}
        assert all(finished[f"good-{i}"] == "length" for i in range(3))
        for i in range(3):
            assert h.tokens[f"good-{i}"] == h.tokens[f"alone-{i}"]
        assert all(job.record.error_type == "GenerationError" for job in bad.values())
        assert "top_k" in bad["top-k"].sampler.error and "min_p" in bad["min-p"].sampler.error
        assert bad["processor"].fault is not None
    finally:
        h.stop()


def test_an_unattributable_failure_fails_the_batch_and_the_engine_serves_on(tiny_model):
    """A failure of the batched step itself (here: the generator's own next(), which no sequence
    owns; a mock, because no real input produces one once every field is validated) fails the
    running requests; the next request is served by a fresh batch."""
    h = _Tokens(tiny_model, max_batch=2, cache_max_entries=0)
    try:
        generator = h.scheduler._generator
        original = generator.next

        def broken():
            generator.next = original
            raise RuntimeError("the batch broke")

        generator.next = broken
        h.submit_sampling("doomed", [7] * 20, 4, Sampling(ignore_eos=True))
        assert h.wait("doomed") == {"doomed": "error"}
        h.submit_sampling("after", [9] * 20, 4, Sampling(ignore_eos=True))
        assert h.wait("after") == {"after": "length"}
    finally:
        h.stop()


def _chat(messages: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i} says hi"}
            for i in range(messages)]


def test_health_answers_quickly_while_huge_chats_hammer_the_engine(engine):
    huge, long = _chat(3000), _chat(1500)  # ~200 KB over --max-messages; under it but rendered
    stop = threading.Event()
    answers: list[int] = []

    def hammer(messages: list[dict]) -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                answers.append(client.post(engine.url + "/v1/chat/completions",
                                           json={"messages": messages, "max_tokens": 1}).status_code)

    threads = [threading.Thread(target=hammer, args=(m,)) for m in (huge, huge, long)]
    for thread in threads:
        thread.start()
    latencies = []
    try:
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + 60
            while (len(latencies) < 40 or len(answers) < 6) and time.monotonic() < deadline:
                start = time.perf_counter()
                assert client.get(engine.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - start)
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert len(answers) >= 6 and set(answers) == {400}, answers  # over the message or context limit
    # The target is 100 ms; the bounds leave room for a loaded 2-core machine (measured here
    # with eight engineers' tests running: median 40-130 ms) and still fail the old engine by far
    # (every probe behind a chat template rendering took 18-20 s).
    assert statistics.median(latencies) < 0.25, latencies
    assert max(latencies) < 2.0, latencies
    print(f"/health under abuse: median {statistics.median(latencies) * 1e3:.1f} ms, "
          f"max {max(latencies) * 1e3:.1f} ms over {len(latencies)} probes")

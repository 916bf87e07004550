"""Issue 16 item 1 acceptance: cache causes that need an engine restarted between two turns of a
conversation, with the same instance id: ``restart`` (same settings), ``template_change`` (the
second process renders chats with another ``--chat-template``) and ``model_change`` (the second
process serves another generated model, whose tokenizer differs). Real engines on the tiny model, a
real collector; every engine is stopped (its telemetry flushed) before a verdict is read.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from harness_collector import CollectorProcess
from harness_engine import EngineProcess

from tokentrace.demo_workload import chat, reply

pytestmark = pytest.mark.slow

#: ChatML with a colon after the role: the same messages render differently from the first token
#: after the role on, i.e. inside the first message's segment.
OTHER_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}:\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant:\n{% endif %}"
)
SYSTEM = {"role": "system", "content": "You answer in the words of the cluster operators' field notes."}


def _user(text: str) -> dict:
    return {"role": "user", "content": text * 3}


def _two_turns(workdir, model, collector, instance: str, session: str, second_args: tuple[str, ...],
               second_model=None) -> None:
    """Turn 1 on one engine process, turn 2 on a new process with the same instance id."""
    first_engine = EngineProcess(workdir, model, collector=collector, instance_id=instance).start()
    try:
        first = chat(first_engine.url, f"{session}-1", [SYSTEM, _user("how full is the cache? ")], 8, session)
    finally:
        assert first_engine.stop() == 0, first_engine.log_path.read_text()
    second_engine = EngineProcess(workdir, second_model or model, *second_args, collector=collector,
                                  instance_id=instance).start()
    try:
        chat(second_engine.url, f"{session}-2",
             [SYSTEM, _user("how full is the cache? "), reply(first), _user("and after the restart? ")], 4, session)
    finally:
        assert second_engine.stop() == 0, second_engine.log_path.read_text()


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, tiny_model):
    workdir = tmp_path_factory.mktemp("restart")
    collector = CollectorProcess(workdir).start()
    try:
        _two_turns(workdir, tiny_model, collector, "restart-a", "conv-restart", ())
        _two_turns(workdir, tiny_model, collector, "template-a", "conv-template", ("--chat-template", OTHER_TEMPLATE))
        other = workdir / "models" / "small"  # another size: other weights and another tokenizer
        subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(other), "--size", "small"],
                       check=True, capture_output=True, timeout=300)
        _two_turns(workdir, tiny_model, collector, "model-a", "conv-model", (), second_model=other)
        yield collector
    finally:
        collector.stop()


def _cache(collector, request_id: str) -> dict:
    response = httpx.get(f"{collector.url}/api/requests/{request_id}/cache", timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _evidence(verdict: dict, kind: str) -> list[dict]:
    return [item for item in verdict["evidence"] if item["kind"] == kind]


def test_restart_between_turns_is_restart_not_capacity(restarted):
    """Before this cause existed the lost entry read as capacity ('no longer cached')."""
    cache = _cache(restarted, "conv-restart-2")
    assert (cache["result"], cache["cause"], cache["cached_tokens"]) == ("miss", "restart", 0)
    [restart] = _evidence(cache, "restart")
    assert restart["entry_request_id"] == "conv-restart-1"
    assert restart["inserted_at_ns"] < restart["load_start_ns"]
    assert restart["lost_tokens"] >= cache["block_size"]
    loads = httpx.get(f"{restarted.url}/timeline.json?since=all", timeout=60).json()["loads"]
    assert restart["load_id"] in loads["load_id"]


def test_other_chat_template_after_restart_is_template_change(restarted):
    cache = _cache(restarted, "conv-template-2")
    assert (cache["result"], cache["cause"]) == ("miss", "template_change")
    [change] = _evidence(cache, "template_change")
    assert change["earlier_request_id"] == "conv-template-1"
    assert change["before"] != change["after"] and len(change["after"]) == 16
    segments = httpx.get(f"{restarted.url}/requests/conv-template-2.json", timeout=60).json()["segments"]
    assert change["token_index"] < segments[0]["token_end"]  # before the first message's content ends


def test_another_model_after_restart_is_model_change(restarted):
    cache = _cache(restarted, "conv-model-2")
    assert (cache["result"], cache["cause"]) == ("miss", "model_change")
    [change] = _evidence(cache, "model_change")
    assert change["earlier_request_id"] == "conv-model-1"
    assert change["before"] != change["after"] and len(change["after"]) == 16


def test_the_engine_declares_what_it_measures(restarted):
    """docs/telemetry.md: the MLX engine measures every part and names its model and template."""
    slow = httpx.get(f"{restarted.url}/api/requests/conv-restart-2/slow", timeout=60).json()
    assert slow["outcome"] == "completed" and slow["category"] in ("cold_start", "queueing", "prefill", "decode")
    assert None not in [slow["breakdown_ms"][part] for part in ("load_wait", "queue", "prefill", "decode")]

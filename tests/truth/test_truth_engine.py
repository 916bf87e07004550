"""Truth matrix (docs/truth.md) on ``tokentrace engine``: direct (path ``engine``), behind
``tokentrace gateway`` (path ``gateway-engine``), and as a distributed engine of two ranks on the
ring (path ``engine-ring``). Each path runs every situation once on its own
three engines and collector; every cell then reads what each surface said (tests/truth/matrix.py).
"""

from __future__ import annotations

import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess
from harness_gateway import GatewayProcess
from matrix import (
    Topology,
    around_restart,
    cases,
    check_answer,
    check_surfaces,
    gather,
    marked,
    once,
    settled,
    stopping,
)

pytestmark = pytest.mark.slow

#: ChatML with a colon after the role: the same messages render differently inside the first message.
OTHER_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}:\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant:\n{% endif %}"
)
MAIN_FLAGS = ("--max-batch", "2", "--cache-max-entries", "4", "--prefill-step-size", "256")


def run_path(path: str, workdir, model) -> object:
    prefix = {"engine": "te-", "engine-ring": "tr-"}.get(path, "tg-")
    ring = ("--ranks", "2") if path == "engine-ring" else ()
    collector = CollectorProcess(workdir).start()
    engines = {
        "a": EngineProcess(workdir, model, *MAIN_FLAGS, *ring, collector=collector, instance_id=prefix + "a"),
        "b": EngineProcess(workdir, model, "--max-batch", "4", *ring, collector=collector, instance_id=prefix + "b"),
        "c": EngineProcess(workdir, model, "--lazy-load", collector=collector, instance_id=prefix + "c"),
    }
    gateways: dict[str, GatewayProcess] = {}
    with stopping(collector, gateways, engines):
        engines["a"].start()
        engines["b"].start()
        engines["c"].start(ready=False)
        if path in ("engine", "engine-ring"):
            urls = {"main": engines["a"].url, "cold": engines["c"].url, "template": engines["c"].url,
                    "move": (engines["a"].url, engines["b"].url)}
        else:
            a, b, c = (engines[k].url for k in "abc")
            gateways.update({"main": GatewayProcess(workdir, {"a": a}, collector=collector),
                             "narrow": GatewayProcess(workdir, {"a": a}, "--max-concurrency", "1",
                                                      collector=collector),
                             "rr": GatewayProcess(workdir, {"a": a, "b": b}, "--route", "round_robin",
                                                  collector=collector),
                             "c": GatewayProcess(workdir, {"c": c}, collector=collector)})
            for name, gateway in gateways.items():
                if name != "c":
                    gateway.start()
            # In front of an engine that has not loaded its model yet (its /health: 503 until its first
            # request) the gateway may never say "ok": wait only until it answers.
            gateways["c"]._spawn(gateways["c"].cmd)
            wait_for(lambda: gateways["c"]._status("/health") is not None, 120, "the cold engine's gateway")
            urls = {"main": gateways["main"].url, "narrow": gateways["narrow"].url, "cold": gateways["c"].url,
                    "template": gateways["c"].url, "move": (gateways["rr"].url, gateways["rr"].url)}
        topology = Topology(path, collector, urls, prefix=prefix)
        if path == "gateway-engine":
            def warm() -> None:
                """The cold engine loaded by a request of its own, whatever the gateway did with its first."""
                topology.chat("cold", "warm-c", [topology.user(2, 4)], 2, url=engines["c"].url)
                settled([gateways["c"]])

            topology.warm = warm

        def restart() -> None:
            """The main engine restarted as it was; the template engine with another chat template."""
            engines["a"].stop()
            engines["a"].start()
            engines["c"].stop()
            engines["c"].args = [arg for arg in engines["c"].args if arg != "--lazy-load"]
            engines["c"].args += ["--chat-template", OTHER_TEMPLATE]
            engines["c"].start()

        around_restart([topology], restart, gateways, "restarting the main and the template engine")
    return gather(topology)


@pytest.fixture(scope="module")
def truth(tmp_path_factory, tiny_model):
    return once(lambda path: run_path(path, tmp_path_factory.mktemp(path), tiny_model))


#: Every answer is right on these paths (issue 44's one-shot prefix changes were the last wrong ones).
WRONG_ANSWER: dict[tuple[str, str], str] = {}
WRONG_SURFACES: dict[tuple[str, str], str] = {}


PATHS = ("engine", "gateway-engine", "engine-ring")


@pytest.mark.parametrize(("path", "situation"), marked(cases(*PATHS), WRONG_ANSWER))
def test_answer(truth, path, situation):
    check_answer(truth(path), situation)


@pytest.mark.parametrize(("path", "situation"), marked(cases(*PATHS), WRONG_SURFACES))
def test_surfaces(truth, path, situation):
    check_surfaces(truth(path), situation)

"""Truth matrix (docs/truth.md) on ``mlx_lm.server`` (mlx-lm's own server, which nobody here wrote)
behind ``tokentrace gateway --tokenizer``: path ``gateway-mlx``. Two servers on the tiny model, three
gateways in front of them, one collector; every situation once (tests/truth/matrix.py).
"""

from __future__ import annotations

import httpx
import pytest
from harness_collector import CollectorProcess
from harness_gateway import GatewayProcess, MlxLmServer
from matrix import (
    Topology,
    around_restart,
    cases,
    check_answer,
    check_surfaces,
    gather,
    marked,
    once,
    stopping,
)

pytestmark = pytest.mark.slow

PATH = "gateway-mlx"


def run_path(workdir, model):
    collector = CollectorProcess(workdir).start()
    servers = {"a": MlxLmServer(workdir, model, "--prompt-cache-size", "4", "--decode-concurrency", "2"),
               "b": MlxLmServer(workdir, model)}
    gateways: dict[str, GatewayProcess] = {}
    with stopping(collector, gateways, servers):
        for server in servers.values():
            server.start()
        a, b = servers["a"].url, servers["b"].url
        tokenizer = ("--tokenizer", str(model))
        gateways.update({"main": GatewayProcess(workdir, {"mlx-a": a}, *tokenizer, collector=collector),
                         "narrow": GatewayProcess(workdir, {"mlx-a": a}, *tokenizer, "--max-concurrency", "1",
                                                  collector=collector),
                         "rr": GatewayProcess(workdir, {"mlx-a": a, "mlx-b": b}, *tokenizer, "--route",
                                              "round_robin", collector=collector)})
        for gateway in gateways.values():
            gateway.start()

        def refuse(rid: str) -> httpx.Response:  # mlx_lm.server checks no context length; it refuses this
            body = {"model": "default_model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}
            return httpx.post(gateways["main"].url + "/v1/chat/completions", json=body,
                              headers={"X-Request-Id": rid}, timeout=60)

        # mlx_lm.server makes 120 tokens of the tiny model in ~150 ms: once in CI the gateway's queued
        # request arrived when the long one had 10 ms left (queue 10 ms, nothing decomposed: the
        # situation was not built). 1,000 hold the slot ~1 s here (the model's context is 2,048).
        topology = Topology(PATH, collector, {"main": gateways["main"].url, "narrow": gateways["narrow"].url,
                                              "move": (gateways["rr"].url, gateways["rr"].url)},
                            model="default_model", refuse=refuse, prefix="tm-", long_tokens=1000)

        def restart() -> None:
            servers["a"].stop()
            servers["a"].start()

        around_restart([topology], restart, gateways, "restarting mlx-a")
    return gather(topology)


@pytest.fixture(scope="module")
def truth(tmp_path_factory, tiny_model):
    return once(lambda path: run_path(tmp_path_factory.mktemp("mlx"), tiny_model))


#: Every answer is right on this path.
WRONG_ANSWER: dict[tuple[str, str], str] = {}
WRONG_SURFACES: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize(("path", "situation"), marked(cases(PATH), WRONG_ANSWER))
def test_answer(truth, path, situation):
    check_answer(truth(path), situation)


@pytest.mark.parametrize(("path", "situation"), marked(cases(PATH), WRONG_SURFACES))
def test_surfaces(truth, path, situation):
    check_surfaces(truth(path), situation)

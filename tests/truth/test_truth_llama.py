"""Truth matrix (docs/truth.md) on llama.cpp's ``llama-server`` behind ``tokentrace gateway``: path
``gateway-llama``. Two servers on the tiny model's GGUF, each with one slot and no host-memory prompt
cache (what a slot holds is all a request can reuse), three gateways, one collector; every situation
once (tests/truth/matrix.py).
"""

from __future__ import annotations

import pytest
from harness_collector import CollectorProcess
from harness_gateway import GatewayProcess
from harness_llama import LlamaServer, tiny_gguf  # noqa: F401 - fixture
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

PATH = "gateway-llama"
SERVER_ARGS = ("-np", "1", "--cache-ram", "0", "-c", "2048")


def run_path(workdir, gguf):
    collector = CollectorProcess(workdir).start()
    servers = {name: LlamaServer(workdir, gguf / "model.gguf", *SERVER_ARGS) for name in ("a", "b")}
    gateways: dict[str, GatewayProcess] = {}
    with stopping(collector, gateways, servers):
        for server in servers.values():
            server.start()
        a, b = servers["a"].url, servers["b"].url
        gateways.update({"main": GatewayProcess(workdir, {"llama-a": a}, collector=collector),
                         "narrow": GatewayProcess(workdir, {"llama-a": a}, "--max-concurrency", "1",
                                                  collector=collector),
                         "rr": GatewayProcess(workdir, {"llama-a": a, "llama-b": b}, "--route", "round_robin",
                                              collector=collector)})
        for gateway in gateways.values():
            gateway.start()
        # One slot: one long generation fills the server; it holds one prompt, so one other evicts it.
        # llama-server makes 120 tokens of the tiny model in less than a poll of the gateway's /health
        # (the situation was then not built); 1,500 hold the slot for a while (context 2,048).
        topology = Topology(PATH, collector, {"main": gateways["main"].url, "narrow": gateways["narrow"].url,
                                              "move": (gateways["rr"].url, gateways["rr"].url)},
                            slots=1, fillers=2, prefix="tl-", long_tokens=1500,
                            # 64 tokens take llama-server ~2 ms: not decode-bound against a few ms of
                            # stream and scheduling noise (a CI run once found 6.6 ms after the last token)
                            decode_tokens=512)

        def restart() -> None:
            servers["a"].stop()
            servers["a"].start()

        around_restart([topology], restart, gateways, "restarting llama-a")
    return gather(topology)


@pytest.fixture(scope="module")
def truth(tmp_path_factory, tiny_gguf):  # noqa: F811
    return once(lambda path: run_path(tmp_path_factory.mktemp("llama"), tiny_gguf))


#: Every answer is right on this path. (The gateway's own wait, once wrong here, was a situation not
#: built: 120 tokens had ended before the short request arrived.)
WRONG_ANSWER: dict[tuple[str, str], str] = {}
WRONG_SURFACES: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize(("path", "situation"), marked(cases(PATH), WRONG_ANSWER))
def test_answer(truth, path, situation):
    check_answer(truth(path), situation)


@pytest.mark.parametrize(("path", "situation"), marked(cases(PATH), WRONG_SURFACES))
def test_surfaces(truth, path, situation):
    check_surfaces(truth(path), situation)

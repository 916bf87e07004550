"""Truth matrix (docs/truth.md) on vLLM CPU with the tokentrace plugin, behind ``tokentrace gateway``
(path ``gateway-vllm``) and direct (path ``vllm``). vLLM takes tens of seconds to start, so both paths
share two vLLM processes and one collector (each path sends its own prompts, ids and sessions); the
first process restarts once, between both paths' first and second turns (tests/truth/matrix.py).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from harness_collector import CollectorProcess, free_port, wait_for
from harness_gateway import GatewayProcess
from matrix import (
    Topology,
    around_restart,
    cases,
    check_answer,
    check_surfaces,
    gather_all,
    marked,
    once,
    stopping,
)
from vllm_fixtures import MODEL, VLLM_PYTHON, healthy, make_model, require_vllm_python, stop

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PATHS = ("gateway-vllm", "vllm")
KV_BLOCKS, BLOCK_SIZE, MAX_SEQS = 96, 32, 4


class Vllm:
    """One vLLM API server with the plugin, on fixed ports (a restart comes back on the same ones)."""

    def __init__(self, model_dir, workdir, collector: CollectorProcess, instance: str):
        self.port, kv_port = free_port(), free_port()
        self.log_path = workdir / f"vllm-{instance}.log"
        self.env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENTRACE_COLLECTOR_URL": collector.url,
                    "TOKENTRACE_INSTANCE_ID": instance, "TOKENTRACE_SPOOL_DIR": str(workdir / f"spool-{instance}"),
                    "OTEL_BSP_SCHEDULE_DELAY": "200"}
        self.cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                    "--gpu-memory-utilization", "0.3", "--max-model-len", "1024", "--block-size", str(BLOCK_SIZE),
                    "--num-gpu-blocks-override", str(KV_BLOCKS), "--max-num-seqs", str(MAX_SEQS),
                    "--disable-log-stats", "--enable-request-id-headers", "--enable-prompt-tokens-details",
                    "--otlp-traces-endpoint", f"{collector.url}/v1/traces",
                    "--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                      "endpoint": f"tcp://*:{kv_port}"})]
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> Vllm:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         env=self.env, start_new_session=True)
        return self

    def ready(self) -> Vllm:
        wait_for(lambda: healthy(self.proc, self.url, self.log_path), 400, f"vLLM /health (log {self.log_path})",
                 interval=0.5)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def run_paths(workdir):
    require_vllm_python()
    model_dir = workdir / "tiny-llama"
    make_model(model_dir)
    collector = CollectorProcess(workdir).start()
    engines = [Vllm(model_dir, workdir, collector, name) for name in ("vllm-1", "vllm-2")]
    gateways: dict[str, GatewayProcess] = {}
    with stopping(collector, gateways, engines):
        for engine in engines:  # both start at once: the start is mostly waiting
            engine.spawn()
        for engine in engines:
            engine.ready()
        one, two = engines[0].url, engines[1].url
        gateways.update({"main": GatewayProcess(workdir, {"vllm-1": one}, collector=collector),
                         "narrow": GatewayProcess(workdir, {"vllm-1": one}, "--max-concurrency", "1",
                                                  collector=collector),
                         "rr": GatewayProcess(workdir, {"vllm-1": one, "vllm-2": two}, "--route", "round_robin",
                                              collector=collector)})
        for gateway in gateways.values():
            gateway.start()
        # vLLM's tokenizer makes ~5 tokens of one of the matrix's words: a long prompt of ~750 tokens
        # (max-model-len 1024), one of ~1,500 refused, and six fillers of ~23 blocks each (96 blocks).
        # The queueing situations' requests arrive together (Topology.burst); 600 tokens hold a slot for
        # about a second on vLLM CPU. The cancelled request asks 900 tokens: its prompt and 2,000 were
        # over the context (1,024), so it was refused with a 400, not cancelled.
        sizes = {"model": MODEL, "slots": MAX_SEQS, "fillers": 6, "filler_words": 150, "long_words": 150,
                 "too_long_words": 300, "burst": True, "long_tokens": 600, "cancel_tokens": 900}
        paths = [Topology("gateway-vllm", collector, {"main": gateways["main"].url, "narrow": gateways["narrow"].url,
                                                       "move": (gateways["rr"].url, gateways["rr"].url)},
                          prefix="tgv-", seed=0, **sizes),
                 Topology("vllm", collector, {"main": one, "move": (one, two)}, prefix="tv-", seed=5000, **sizes)]

        def restart() -> None:
            engines[0].stop()
            engines[0].spawn().ready()

        # Both paths share vllm-1: each restart's first turn comes after both paths' fillers.
        around_restart(paths, restart, gateways, "restarting vllm-1")
    return gather_all(*paths)


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    both = once(lambda _: run_paths(tmp_path_factory.mktemp("vllm-truth")))
    return lambda path: both("both")[path]


#: Every situation is right on both paths (2026-12-07). Until the plugin watched vLLM's prompts
#: (engine_shim/vllm/prompts.py), every cache cause on the direct path was "unknown" (no prompt
#: fingerprint reached the store) and a refused request was never stored: those cells were marked
#: wrong here. Every surface agrees with the API wherever a request is stored.
WRONG_ANSWER: dict[tuple[str, str], str] = {}
#: Situations the harness cannot always build here are checked for having been built, from the
#: stored rows, and skipped as "not built" otherwise (matrix.py: ``_queue_built``, and the cancelled
#: check in ``check_answer``), never marked: the short request must reach vLLM's scheduler after
#: the long generations that fill its four slots, but vLLM CPU on two cores starves its own API
#: server while it generates, so the five requests are sent together, in order (Topology.burst), and
#: vLLM's API server (and the gateway before it) may still hand them on in another order; a client
#: hanging up at its first content may find vLLM has generated and sent the whole answer. (Both were
#: marked unreliable here before, and a cancelled request on the direct path was never stored until
#: the plugin recorded vLLM's aborts.)
UNRELIABLE: dict[tuple[str, str], str] = {
    # Once in a review run (2026-12-07, after both CIs passed it) the short request behind the narrow
    # gateway was answered as prefill (queue 0.02 ms) while the built check, reading the long
    # request's stored arrival and queue, said its slot was held: on this path the stored rows do not
    # show which of the two the gateway admitted first. Marked as before until they do.
    ("gateway-vllm", "queueing_gateway"): "the gateway may take the burst's short request before the long one"}
WRONG_SURFACES: dict[tuple[str, str], str] = {}
UNRELIABLE_SURFACES: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize(("path", "situation"), marked(cases(*PATHS), WRONG_ANSWER, UNRELIABLE))
def test_answer(truth, path, situation):
    check_answer(truth(path), situation)


@pytest.mark.parametrize(("path", "situation"), marked(cases(*PATHS), WRONG_SURFACES, UNRELIABLE_SURFACES))
def test_surfaces(truth, path, situation):
    check_surfaces(truth(path), situation)

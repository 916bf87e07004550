"""Regenerates tests/fixtures/demo_trace.jsonl: the OTLP the two demo engines export while the
demo's scripted workload runs (every slowness category and cache cause, produced by real engines).

    .venv/bin/python tests/capture_demo_trace.py

The engines export to a port where nothing listens, so every batch lands in their spools; the spool
files become one OTLP JSON request per line (the OpenTelemetry Collector file exporter's format),
with the requests the demo shows and their expected verdicts in tests/fixtures/demo_trace.shown.json.
The store conformance suite replays the file into every backend and compares the verdicts.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from google.protobuf import json_format
from harness_collector import free_port
from harness_engine import EngineProcess
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokentrace.demo_workload import INSTANCE_FLAGS, Cluster, run_workload

FIXTURES = Path(__file__).parent / "fixtures"
INSTANCE_IDS = {"A": "demo-a", "B": "demo-b"}


def _hex_ids(document: dict) -> dict:
    """OTLP JSON carries ids in hex, where protobuf's JSON mapping writes base64."""
    for resource in document.get("resourceSpans", []):
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64decode(span[key]).hex()
                for link in span.get("links", []):
                    for key in ("traceId", "spanId"):
                        link[key] = base64.b64decode(link[key]).hex()
    return document


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "tiny"
        subprocess.run([sys.executable, "-m", "tokentrace", "make-model", str(model), "--size", "tiny"], check=True)
        nowhere = SimpleNamespace(url=f"http://127.0.0.1:{free_port()}", token=None)
        engines = {key: EngineProcess(work, model, *INSTANCE_FLAGS[key], collector=nowhere,
                                      instance_id=INSTANCE_IDS[key]) for key in ("A", "B")}
        try:
            engines["A"].start()
            engines["B"].start(ready=False)
            shown = run_workload(Cluster({key: engine.url for key, engine in engines.items()}), print)
        finally:
            for engine in engines.values():
                engine.stop()
        lines = []
        for engine in engines.values():
            for path in sorted(engine.spool_dir.rglob("*.pb")):
                request = ExportTraceServiceRequest.FromString(path.read_bytes())
                lines.append(json.dumps(_hex_ids(json_format.MessageToDict(request)), separators=(",", ":")))
    (FIXTURES / "demo_trace.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (FIXTURES / "demo_trace.shown.json").write_text(json.dumps([asdict(s) for s in shown], indent=1) + "\n",
                                                    encoding="utf-8")
    print(f"{len(lines)} export requests, {len(shown)} requests shown")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

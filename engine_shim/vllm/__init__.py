"""The vLLM plugin: a stat-logger plugin and a KV-event subscriber inside a running vLLM, reporting
vLLM's own numbers under the telemetry contract (docs/vllm.md). Imported only by vLLM's plugin
entry points (pyproject), inside vLLM's process."""

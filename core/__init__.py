"""tokentrace: why was this LLM request slow, and why did the prefix cache miss.

Subpackages: ``tokentrace.collector`` (OTLP in, store), ``tokentrace.analyzers`` (verdicts),
``tokentrace.dashboards`` (pages), ``tokentrace.engine_shim`` (instrumented engines).
"""

__version__ = "0.1.0"

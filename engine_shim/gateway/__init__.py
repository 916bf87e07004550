"""The gateway: any OpenAI-compatible engine observed from outside, routed with the cache in mind
(docs/gateway.md). Per-engine knowledge lives in ``adapters/``."""

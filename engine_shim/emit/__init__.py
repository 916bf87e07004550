"""The emitting layer every way in shares: the on-disk spool and the exporter that falls back to it,
and shared defaults. Nothing here imports mlx or vLLM."""

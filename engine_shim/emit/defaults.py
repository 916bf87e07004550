"""Defaults every way in shares (the MLX engine, the vLLM plugin, the gateway)."""

from __future__ import annotations

import os
from pathlib import Path


def default_spool_dir() -> str:
    """Where span batches wait while the collector is away (engine, vLLM plugin, gateway)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "tokentrace" / "spool")

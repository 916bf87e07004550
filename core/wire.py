"""What tokentrace's own processes send each other besides OTLP (docs/collector.md, docs/engine.md)."""

from __future__ import annotations

import re

#: HTTP header on a POST /v1/traces whose body is a spool file's bytes (the engine shim's resends):
#: the file's name. The collector stores such a body once per SHA-256, as a file of its
#: --spool-dir, so a resend after a lost acknowledgement, or a file both resent and ingested from
#: the directory, is stored once.
SPOOL_FILE_HEADER = "X-Tokentrace-Spool-File"
#: What that header may hold: a plain file name.
SPOOL_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")

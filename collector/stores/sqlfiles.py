"""The SQL of every store backend, kept as data (STYLE §5): ``sql/<backend>/NNN_name.sql`` are the
numbered migrations, ``sql/<backend>/queries/<name>.sql`` the named queries of the reader role.

Every backend ships every named query (tests/test_store_conformance.py checks the two folders hold
the same names and that each pair binds the same parameters).
"""

from __future__ import annotations

import re
from importlib import resources

from tokentrace.errors import StoreError

BACKENDS = ("duckdb", "clickhouse")
_ROOT = resources.files("tokentrace.collector.stores") / "sql"
_MIGRATION = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")
_NAME = re.compile(r"[a-z0-9_]+")
#: A line that includes a fragment (``include``).
INCLUDE = "-- include:"


def folder(backend: str):
    """The SQL folder of a backend (a Traversable)."""
    return _ROOT / backend


def migrations(backend: str) -> list[tuple[int, str, str]]:
    """(version, file name, SQL) of every migration of ``backend``, in order."""
    found = []
    for entry in folder(backend).iterdir():
        match = _MIGRATION.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    return sorted(found)


def read(backend: str, name: str) -> str:
    """The text of ``sql/<backend>/<name>``."""
    return (folder(backend) / name).read_text(encoding="utf-8")


def query_names(backend: str) -> set[str]:
    """Names of the named queries ``backend`` ships."""
    return {e.name[:-4] for e in (folder(backend) / "queries").iterdir() if e.name.endswith(".sql")}


class NamedQueries:
    """Loads and caches the named queries of one backend."""

    def __init__(self, backend: str, label: str):
        self._folder = folder(backend) / "queries"
        self._label = label
        self._cache: dict[str, str] = {}

    def text(self, name: str) -> str:
        """The SQL of query ``name``; StoreError when the name is malformed or unknown."""
        sql = self._cache.get(name)
        if sql is None:
            if not _NAME.fullmatch(name):
                raise StoreError(f"query names are lower-case words, received {name!r}")
            path = self._folder / f"{name}.sql"
            if not path.is_file():
                raise StoreError(f"no query named {name!r} for {self._label}")
            sql = self._cache[name] = include(self._folder.parent, path.read_text(encoding="utf-8"))
        return sql


def include(root, sql: str) -> str:
    """``sql`` with each line ``-- include: NAME`` replaced by ``<root>/fragments/NAME.sql``: SQL that
    several named queries share (the merge of a request's observers, fragments/request_rows.sql) is
    written once."""
    lines = []
    for line in sql.splitlines():
        name = line.strip().removeprefix(INCLUDE)
        if name != line.strip() and _NAME.fullmatch(name.strip()):
            line = (root / "fragments" / f"{name.strip()}.sql").read_text(encoding="utf-8").rstrip("\n")
        lines.append(line)
    return "\n".join(lines)


def statements(sql: str) -> list[str]:
    """Split a script into statements at ``;`` outside quotes and comments (ClickHouse's HTTP
    interface runs one statement per request). Comment-only pieces are dropped."""
    parts, current, quote, i = [], [], "", 0
    while i < len(sql):
        ch = sql[i]
        if quote:
            current.append(ch)
            if ch == "\\" and i + 1 < len(sql):
                current.append(sql[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = len(sql) if end < 0 else end
            continue
        elif ch in "'\"`":
            quote = ch
            current.append(ch)
        elif ch == ";":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]

"""The compiled decoder (collector/decoding/fastotlp*.c): an OTLP protobuf body straight into ``Columns``.

``decode(body, max_value_length)`` returns exactly what
``normalize(ExportTraceServiceRequest.FromString(body), max_value_length).columns()`` returns, or
None: the body is one the decoder does not reproduce exactly, and the caller takes the Python
path, which raises the proper error or handles the case (issue 17: the normalizer costs ~21 µs of
Python per span; the decoder builds the same Arrow columns without a Python object per value).

None, and the Python normalizer, for: a body that is not valid protobuf or valid UTF-8; a span the
normalizer refuses (ids, times) or changes (values, names, status messages cut to the length limit,
typed values left out, a contract span that breaks the contract's types); an attribute key sent
twice; kvlist, bytes or nested array values; a non-string value where the normalizer reads a
string (it would store ``str(value)``: a resource's instance id, a request id, a role); ``llm.request``
with legacy GenAI or vLLM latency names; spans of engine translations (vLLM's native spans); a
negative length limit; protobuf oddities (groups, a singular field sent twice, resource entity refs).

The tables arrive through the Arrow C data interface (PyCapsules), without a copy. ``TOKENTRACE_FASTPATH=0``
turns the decoder off (A/B runs, and an escape hatch).
"""

from __future__ import annotations

import os
from functools import cache

import numpy as np
import pyarrow as pa

from tokentrace import contract as c
from tokentrace.collector.decoding import normalize
from tokentrace.collector.decoding.columns import SCHEMAS, Columns
from tokentrace.engine_shim import translations
from tokentrace.engine_shim.vllm import names as v

try:
    from tokentrace.collector.decoding import _fastotlp
except ImportError:  # a source tree nobody built: every payload takes the Python path
    _fastotlp = None

#: Environment variable that turns the decoder off when set to 0 (or false, no, off).
ENV = "TOKENTRACE_FASTPATH"
_OFF = {"0", "false", "no", "off"}


class _SchemaCapsule:
    """The Arrow PyCapsule protocol's producer side, for pyarrow to import a schema (``unavailable``;
    the decoder's arrays are imported by address with these schemas, ``imported``)."""

    def __init__(self, schema):
        self._schema = schema

    def __arrow_c_schema__(self):
        return self._schema


@cache
def unavailable() -> str | None:
    """None when the decoder is built and configured; otherwise why it is not used.

    Configured on first use, not at import: the engine translations' span names (left to Python)
    load engine code, which importing the collector must not (engine_shim/translations.py)."""
    if _fastotlp is None:
        return "the extension tokentrace.collector.decoding._fastotlp is not built"
    configure(_fastotlp)
    for name, capsule in _fastotlp.schemas():
        exported = pa.schema(_SchemaCapsule(capsule))
        if not exported.equals(SCHEMAS[name]):
            return f"the decoder's {name} columns are {exported}, not those of tables.py"
    return None


def configure(module) -> None:
    """Give a build of the decoder (``_fastotlp``, or another commit's for bench/decode.py
    ``--against``) the names it needs: the contract's, and the spans it leaves to Python."""
    implemented = {getattr(c, name) for name in module.SPANS}
    # The engine translations' builders (and any builder normalize gains before the C side) are Python's.
    fallback = (set(normalize._BUILDERS) | set(translations.builders())) - implemented
    legacy = (*v.LEGACY_USAGE, *v.LATENCY_TO_CONTRACT_MS)  # what vllm.names.with_both_names rewrites
    module.configure(c, tuple(sorted(normalize.EXPANDED)), legacy, c.LIFECYCLE_EVENTS, tuple(sorted(fallback)))


def enabled() -> bool:
    """Whether ``decode`` tries the compiled decoder (built, and not turned off by ``ENV``)."""
    return os.environ.get(ENV, "1").strip().lower() not in _OFF and unavailable() is None


def decode(body: bytes, max_value_length: int) -> Columns | None:
    """The payload's ``Columns``, or None: use the Python normalizer (module docstring)."""
    if not enabled():
        return None
    found = _fastotlp.decode(body, max_value_length)
    return None if found is None else imported(found)


def imported(found: tuple) -> Columns:
    """The ``Columns`` of what ``_fastotlp.decode`` returned: (spans, key hashes, tables as Arrow
    array capsules with their addresses and each row's span, the bytes of the tables' buffers).
    Each array is imported with its table's schema from ``SCHEMAS``, which ``unavailable`` found
    equal to the decoder's: importing a schema with every table took a third of the import (issue
    17). The decoder's count of the bytes is ``Columns.nbytes``: pyarrow's took 0.16 ms an engine
    batch, holding the GIL."""
    spans, keys, tables, nbytes = found
    out = Columns(keys=np.frombuffer(keys, dtype=np.uint64), spans=spans)
    exported = {name: (array, address, origin) for name, array, address, origin in tables}
    for name in normalize.MARKED:  # the order Batch.columns() gives
        if name in exported:
            _array, address, origin = exported[name]  # the capsule frees the array if the import fails
            out.tables[name] = pa.Table.from_batches([pa.RecordBatch._import_from_c(address, SCHEMAS[name])])
            out.origin[name] = np.frombuffer(origin, dtype=np.int32)
    out.counted(nbytes)
    return out

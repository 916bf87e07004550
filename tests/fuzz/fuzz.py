"""Coverage-guided fuzzing of tokentrace's C code under AddressSanitizer and UBSan (issue 45 item 5).

Targets (the first argument), each with an oracle beyond "does not crash":

- ``decoder``: an OTLP/HTTP protobuf body through the compiled decoder (collector/decoding/fastotlp*.c); where
  it decodes the body, the Python normalizer must give exactly the same Columns (every table, origin,
  key hash and counter: tests/harness_fastpath.assert_same), and must not refuse what the decoder took.
- ``keys``: uint64 arrays through the store's key memories (collector/stores/frontier.c ``RecentKeys``,
  collector/stores/spankeys.c ``KeyTable``): answers are checked against a set kept here.
- ``wire``: attribute dicts (strings, ints, floats, bools, bytes, lists, nested) through the engine's
  OTLP wire writer (engine_shim/emit/otlpwire.c); protobuf must parse what it writes back to the
  same attributes.

The modules are tests/fuzz/build.py's sanitized builds, loaded in place of the installed ones; run
with atheris's ASan runtime preloaded (tests/fuzz/run.sh does all of it):

    bash tests/fuzz/run.sh decoder 60            # a minute; corpus in build/fuzz/corpus-decoder
    bash tests/fuzz/run.sh keys 600 -jobs=2      # longer, and any libFuzzer flag after the seconds

The decoder's corpus starts from the bodies real senders sent (tests/fixtures/senders). A crash, a
sanitizer report or a failed oracle stops the run with a non-zero exit, and libFuzzer writes the
input as ``crash-<sha1>`` in the working directory: add it to tests/fixtures/fuzz-regressions/ and the
test that replays them (tests/test_fuzz_sanitized.py) keeps it fixed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def load_sanitized(folder: Path) -> None:
    """Import tests/fuzz/build.py's modules under the installed ones' names, before anything
    imports those."""
    import tokentrace.collector.decoding
    import tokentrace.collector.stores
    import tokentrace.engine_shim.emit  # noqa: F401

    for path in sorted(folder.glob("tokentrace.*.so")):
        name = path.name.split(".cpython")[0]
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        sys.modules[name] = module
        package, _, leaf = name.rpartition(".")
        setattr(sys.modules[package], leaf, module)


# --- targets -------------------------------------------------------------------------------------
def decoder_target():
    from google.protobuf.message import DecodeError
    from harness_fastpath import assert_same, reference

    from tokentrace.collector.decoding import fastpath

    assert fastpath.unavailable() is None, fastpath.unavailable()

    def one(data: bytes) -> None:
        got = fastpath.decode(data, 4096)
        if got is None:
            return
        try:
            expected = reference(data, 4096)
        except DecodeError as exc:
            raise AssertionError(f"the decoder took a body the Python normalizer refuses: {exc}") from None
        assert_same(got, expected)

    return one


def keys_target():
    import atheris
    import numpy as np

    from tokentrace.collector.stores import _spankeys
    from tokentrace.collector.stores.frontier import RecentKeys

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        recent = RecentKeys(fdp.ConsumeIntInRange(1, 64))
        table = _spankeys.KeyTable(max_slots=0)  # no limit: every key added stays until dropped
        held: dict[int, tuple[int, int]] = {}  # key -> (bucket, check) of its first add, as the table keeps
        while fdp.remaining_bytes():
            count = fdp.ConsumeIntInRange(0, 300)
            keys = fdp.ConsumeIntListInRange(count, 0, 2**64 - 1)
            fresh = np.frombuffer(recent.fresh(np.array(keys, dtype=np.uint64)), dtype=bool)
            assert len(fresh) == len(keys)
            buckets = fdp.ConsumeIntListInRange(len(keys), 0, 2**31 - 1)
            checks = fdp.ConsumeIntListInRange(len(keys), 0, 2**32 - 1)
            array = np.array(keys, dtype=np.uint64)
            new = np.frombuffer(table.add(array, np.array(buckets, dtype=np.int32),
                                          np.array(checks, dtype=np.uint32)), dtype=np.uint8)
            for key, bucket, check, added in zip(keys, buckets, checks, new.tolist(), strict=True):
                assert bool(added) == (key not in held), (key, added)
                held.setdefault(key, (bucket, check))
            probe = keys + fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 20), 0, 2**64 - 1)
            has = np.frombuffer(table.has(np.array(probe, dtype=np.uint64)), dtype=np.uint8).tolist()
            assert has == [int(k in held) for k in probe], "has() disagrees with what was added"
            match = np.frombuffer(table.match(np.array(keys, dtype=np.uint64), np.array(checks, dtype=np.uint32)),
                                  dtype=np.uint8).tolist()
            assert match == [1 if held[k][1] == ch else 2 for k, ch in zip(keys, checks, strict=True)]
            if fdp.ConsumeBool():
                cut = fdp.ConsumeIntInRange(0, 2**31 - 1)
                dropped = table.drop_before(cut)
                gone = [k for k, (bucket, _) in held.items() if bucket < cut]
                assert dropped == len(gone), (dropped, len(gone))
                for k in gone:
                    del held[k]

    return one


def wire_target():
    import atheris
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource

    from tokentrace.engine_shim.emit.otlp_wire import resource_attributes

    def value(fdp, depth: int):
        kind = fdp.ConsumeIntInRange(0, 6 if depth < 3 else 4)
        if kind == 0:
            return fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 40))
        if kind == 1:
            return fdp.ConsumeInt(9)
        if kind == 2:
            return fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat()
        if kind == 3:
            return fdp.ConsumeBool()
        if kind == 4:
            return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40))
        if kind == 5:
            return [value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
        return {fdp.ConsumeUnicode(8): value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))}

    def same(given, got) -> bool:
        if isinstance(given, float) and math.isnan(given):
            return isinstance(got, float) and math.isnan(got)
        return given == got or (isinstance(given, tuple | list) and list(given) == got)

    def plain(any_value):
        which = any_value.WhichOneof("value")
        if which == "array_value":
            return [plain(v) for v in any_value.array_value.values]
        if which == "kvlist_value":
            return {kv.key: plain(kv.value) for kv in any_value.kvlist_value.values}
        return getattr(any_value, which) if which else None

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        attributes = {fdp.ConsumeUnicode(fdp.ConsumeIntInRange(0, 12)): value(fdp, 0)
                      for _ in range(fdp.ConsumeIntInRange(0, 8))}
        try:
            body = resource_attributes(attributes)
        except (TypeError, ValueError, OverflowError, UnicodeError):
            return  # refused with a Python exception: the caller's to handle, not memory corruption
        parsed = Resource.FromString(body)
        keys = [kv.key for kv in parsed.attributes]
        assert set(keys) <= set(attributes), (keys, list(attributes))
        for kv in parsed.attributes:
            given = attributes[kv.key]
            got = plain(kv.value)
            if isinstance(given, int | float | str | bytes) and not isinstance(given, bool):
                assert same(given, got), (kv.key, given, got)

    return one


def canary_target():
    """The harness's self-test: canary.c overflows a heap buffer on inputs that start with BOOM,
    which libFuzzer finds within seconds and AddressSanitizer must report."""
    import tokentrace_fuzz_canary

    def one(data: bytes) -> None:
        tokentrace_fuzz_canary.copy(data)

    return one


TARGETS = {"decoder": decoder_target, "keys": keys_target, "wire": wire_target, "canary": canary_target}


def main() -> None:
    import atheris

    target = sys.argv.pop(1)
    folder = Path(os.environ.get("TOKENTRACE_FUZZ_BUILD", ROOT / "build" / "fuzz"))
    load_sanitized(folder)
    sys.path.insert(0, str(folder))  # the canary
    one = TARGETS[target]()
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

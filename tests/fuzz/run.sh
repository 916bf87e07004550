#!/usr/bin/env bash
# Fuzz one target of tests/fuzz/fuzz.py for SECONDS under AddressSanitizer and UBSan:
#   bash tests/fuzz/run.sh TARGET SECONDS [libFuzzer flags...]
# Builds the sanitized modules (tests/fuzz/build.py, into build/fuzz), keeps the corpus in
# build/fuzz/corpus-TARGET (the decoder's seeded from tests/fixtures/senders), and preloads atheris's
# ASan runtime. Exit 0: no finding; otherwise libFuzzer's report and a crash-* file in build/fuzz.
set -euo pipefail
cd "$(dirname "$0")/../.."
target=$1
seconds=$2
shift 2
python=${PYTHON:-.venv/bin/python}
out=build/fuzz
"$python" tests/fuzz/build.py "$out" >/dev/null
corpus="$out/corpus-$target"
mkdir -p "$corpus"
seeds=()
if [ "$target" = decoder ]; then
    seeds=(tests/fixtures/senders tests/fixtures/fuzz-regressions)
fi
runtime=$("$python" -c 'import atheris, os; print(os.path.join(atheris.path(), "asan_with_fuzzer.so"))')
cd "$out"
# detect_leaks=0: the interpreter itself keeps what it allocates at exit. allocator_may_return_null:
# a fuzzed size that asks for too much is a MemoryError, as it would be without ASan.
ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=0 \
TOKENTRACE_FUZZ_BUILD="$PWD" LD_PRELOAD="$runtime" \
    "../../$python" ../../tests/fuzz/fuzz.py "$target" -max_total_time="$seconds" -rss_limit_mb=4096 \
    -timeout=30 "$@" "corpus-$target" "${seeds[@]/#/../../}"

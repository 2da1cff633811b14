"""`kernels.library.steady_heap`: once the kernels are loaded, memory a graph call frees stays in the heap for the
next call instead of going back to the OS (each process in its own subprocess: the setting is process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_FAULTS = """
import resource, sys, torch
from optimum.neuron.kernels import library
set_ = library.steady_heap() if sys.argv[1] == "steady" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):  # 32 MiB, like a call's buffers (torch aligns them to 2 MiB): the heap settles (after 8 to 13
    torch.empty(8 << 20).fill_(1.0)  # blocks in the runs seen: each aligned block first grows it)
before = faults()
for _ in range(10):
    torch.empty(8 << 20).fill_(1.0)
print(set_, faults() - before)
"""


def _faults(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    was_set, faults = out.stdout.split()
    return was_set, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_buffers_are_reused_without_page_faults() -> None:
    was_set, steady = _faults("steady")
    _, default = _faults("default")
    assert was_set == "True"
    assert default >= 10 * 8192 * 0.9  # glibc maps a 32 MiB block on its own each time: every page faults again
    assert steady < 1000  # the heap kept its blocks: no page of them faults again


def test_a_users_malloc_settings_are_left_alone() -> None:
    was_set, _ = _faults("steady", MALLOC_TRIM_THRESHOLD_="131072")
    assert was_set == "False"

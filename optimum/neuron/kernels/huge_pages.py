"""The weights the packed kernels stream, placed on transparent huge pages.

A decode step reads every packed weight once (538 MB for SmolLM2-135M in fp32): on 4 KiB pages that is a new page,
and so a TLB miss and a page walk, every 4 KiB of each panel's stream. `on_huge_pages` moves those tensors into one
anonymous mapping advised for huge pages (``madvise(MADV_HUGEPAGE)``), 2 MiB aligned, so that a 2 MiB page holds what
512 small ones did. Measured on the 2-core AMD Zen 3 VM (family 25 model 1), the two placements alternating in one
process, in a noisy spell (2026-12-07): SmolLM2's 30 layers of products and its LM head at 1 row took 0.907-0.947x
the time on small pages (24-30 rounds, two runs), at 8 rows 0.963-0.977x; the engine's decode step (SmolLM2, two
engines of one artifact, 60-80 rounds of 16 steps) 0.944-0.971x at batch 1, 0.955-0.985x at batch 8. The values do
not change, only their pages: every result is bitwise what it was.

Linux only, and only where the kernel offers transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled``
not ``[never]``); elsewhere, or with ``OPTIMUM_NEURON_HUGE_PAGES=0`` (for comparison), the tensors stay where torch
allocated them.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 and arm64 with 4 KiB base pages: the arena's alignment."""
ALIGN = 64
"""Each tensor's alignment in the arena: one cache line (the kernels' vector loads and prefetches)."""
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_offered() -> bool:
    """Whether this process may place memory on transparent huge pages: Linux with THP in ``always`` or ``madvise``
    mode, and not switched off by ``OPTIMUM_NEURON_HUGE_PAGES=0``."""
    if os.environ.get("OPTIMUM_NEURON_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


def _mapping(size: int) -> tuple[mmap.mmap, int]:
    """A fresh anonymous mapping of at least ``size`` bytes advised for huge pages, and the offset in it of the first
    huge page boundary: the arena starts there."""
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return mapping, -address % HUGE_PAGE


def on_huge_pages(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (CPU, contiguous) moved into one arena on huge pages, in their order, each cache-line aligned: the
    same names, shapes, dtypes and values. Each tensor has a storage of its own in the arena (its region of the
    mapping, which every such storage keeps alive), so tracing does not see the weights alias one another
    (``torch.cond`` refuses branch inputs that share a storage). The tensors are taken out of ``tensors`` one by one
    as they are moved (``tensors`` is left empty), so each one's memory can be freed as soon as its copy is made:
    placing a weight set adds one tensor to the load's peak, not the set (the arena's pages are only backed once
    written). The tensors themselves when huge pages are not offered (`huge_pages_offered`), or when the mapping
    cannot be made; empty tensors stay as they are."""
    if not tensors or not huge_pages_offered():
        return _taken(tensors)
    offsets, size = {}, 0
    for name, tensor in tensors.items():
        offsets[name] = size
        size += -(-tensor.nbytes // ALIGN) * ALIGN
    try:
        mapping, start = _mapping(size)
    except (OSError, ValueError):
        return _taken(tensors)
    placed = {}
    for name, offset in offsets.items():
        tensor = tensors.pop(name)
        if tensor.numel() == 0:
            placed[name] = tensor
            continue
        region = torch.frombuffer(mapping, dtype=tensor.dtype, count=tensor.numel(), offset=start + offset)
        placed[name] = region.view(tensor.shape).copy_(tensor)
    return placed


def _taken(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``tensors`` in a new dict, ``tensors`` left empty (`on_huge_pages`'s contract)."""
    taken = dict(tensors)
    tensors.clear()
    return taken

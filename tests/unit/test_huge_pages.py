"""`kernels.huge_pages.on_huge_pages`: the packed weights moved into one arena advised for transparent huge pages,
with their names, shapes, dtypes and values unchanged; left where they are when switched off."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import pytest
import torch

from optimum.neuron.kernels.huge_pages import ALIGN, HUGE_PAGE, huge_pages_offered, on_huge_pages
from tests.utils import tile_one_arena

needs_thp = pytest.mark.skipif(not huge_pages_offered(), reason="this OS offers no transparent huge pages")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(37, 576, 16, generator=g),
        "b.weight": torch.randint(-127, 128, (3, 5, 16), generator=g, dtype=torch.int8),
        "b.scales": torch.randn(1, 48, generator=g),
        "c.weight": torch.randint(0, 256, (7, 576, 8), generator=g, dtype=torch.uint8),
    }


@needs_thp
def test_the_tensors_move_into_one_aligned_arena_unchanged() -> None:
    tensors, given = _tensors(), _tensors()
    placed = on_huge_pages(given)
    assert not given, "the tensors were copied, not moved: the load's peak holds the set twice"
    assert list(placed) == list(tensors)
    for name, tensor in tensors.items():
        assert placed[name].dtype == tensor.dtype and placed[name].shape == tensor.shape
        assert torch.equal(placed[name], tensor)
        assert placed[name].data_ptr() % ALIGN == 0
    assert tile_one_arena(list(placed.values())), "not one arena, in order"
    storages = {t.untyped_storage().data_ptr() for t in placed.values()}
    assert len(storages) == len(placed), "the tensors share a storage: tracing would see them alias"


@needs_thp
def test_the_arena_outlives_everything_but_one_tensor() -> None:
    placed = on_huge_pages(_tensors())
    kept, expected = placed["c.weight"], placed["c.weight"].clone()
    del placed
    gc.collect()
    torch.empty(64 << 20).fill_(1.0)  # memory freed under the tensor would be reused here
    assert torch.equal(kept, expected)


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_the_arena_is_backed_by_huge_pages() -> None:
    placed = on_huge_pages({"w": torch.ones(8 << 20)})  # 32 MiB: 16 huge pages
    assert _anon_huge_kib(placed["w"].data_ptr()) >= HUGE_PAGE // 1024


def test_switched_off_the_tensors_stay_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTIMUM_NEURON_HUGE_PAGES", "0")
    tensors = _tensors()
    given = dict(tensors)
    assert not huge_pages_offered()
    placed = on_huge_pages(given)
    assert not given and all(placed[name] is tensor for name, tensor in tensors.items())

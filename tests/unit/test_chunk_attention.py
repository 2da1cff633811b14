"""The chunk attention kernel (`kernels.attention.chunk_attention`): a prefill chunk's queries over the blocks of their
window, read in place, and over the chunk's own keys equal torch's ``scaled_dot_product_attention`` on the gathered
window and the chunk (grouped-query attention, the masks of `models.layers.masks`: causal, padded columns, sliding
windows, no window at all; chunks of one tile, of several and with a partial last tile; verification rows), on the
vector path and the portable one. A query's result depends on its own mask row only: the same query gives bitwise the
same output whatever the chunk's padding. Bad inputs raise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from optimum.neuron.kernels import library
from optimum.neuron.kernels.attention import chunk_attention
from optimum.neuron.models.layers.kv_cache import read_blocks
from optimum.neuron.models.layers.masks import chunk_mask, chunk_window_mask

CASES = [  # (rows, query heads, KV heads, head size, block size, window blocks, chunk, first position, padded, window)
    (1, 4, 2, 16, 4, 4, 8, 16, 0, None),
    (1, 9, 3, 64, 32, 4, 100, 128, 7, None),  # two tiles, the last partial; SmolLM2's heads
    (1, 6, 2, 20, 8, 3, 70, 0, 0, None),  # a first chunk: the window's blocks all masked
    (1, 4, 4, 32, 4, 5, 9, 20, 2, 6),  # no grouping, a sliding window shorter than the chunk
    (3, 4, 2, 16, 4, 3, 5, 9, 0, None),  # verification: three rows, each its own sequence
    (1, 4, 2, 80, 8, 3, 40, 16, 3, None),  # a head size of 4 panels + 1: the values' product in two passes
    (1, 3, 1, 32, 16, 20, 300, 320, 5, None),  # over 256 keys: key blocks (AVX2, portable), a chunk cut in two
]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    library.load()


def inputs(case: tuple, seed: int = 0) -> tuple:
    rows, heads, kv_heads, dim, block, blocks, chunk, first, padded, window = case
    generator = torch.Generator().manual_seed(seed)
    pool = rows * blocks + 1  # block 0: the scratch block
    caches = [torch.randn(pool, kv_heads, block, dim, generator=generator) for _ in "KV"]
    table = (torch.randperm(pool - 1, generator=generator)[: rows * blocks] + 1).reshape(rows, blocks)
    q = torch.randn(rows, heads, chunk, dim, generator=generator)
    k, v = (torch.randn(rows, kv_heads, chunk, dim, generator=generator) for _ in "kv")
    positions = torch.arange(first, first + chunk).clamp(max=first + chunk - 1 - padded).expand(rows, -1)
    keys = torch.arange(blocks * block)
    mask = chunk_mask(positions, keys) if window is None else chunk_window_mask(positions, keys, window)
    return q, k, v, caches, table, mask


def strided_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v as views of one projection output [B, C, Hq + 2 Hk, D], the same values."""
    fused = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2)
    return tuple(t.transpose(1, 2) for t in fused.split([q.shape[1], k.shape[1], v.shape[1]], dim=2))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list, table: torch.Tensor | None,
              mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    if table is not None:
        k = torch.cat((read_blocks(caches[0], table), k), dim=2)
        v = torch.cat((read_blocks(caches[1], table), v), dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("case", CASES)
def test_equals_sdpa_on_the_gathered_window_and_the_chunk(case: tuple) -> None:
    q, k, v, caches, table, mask = inputs(case)
    got = chunk_attention(q, k, v, caches[0], caches[1], table, mask, q.shape[-1] ** -0.5)
    torch.testing.assert_close(got, reference(q, k, v, caches, table, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5]])
def test_queries_keys_and_values_are_read_where_they_lie(case: tuple) -> None:
    """q, k and v as views of one projection output [B, C, heads, D] (as a graph passes them: the rows of D contiguous,
    the heads and tokens strided) give bitwise what contiguous copies give, and the kernel reads them in place: it
    makes no copy of them."""
    q, k, v, caches, table, mask = inputs(case)
    q_view, k_view, v_view = strided_views(q, k, v)
    assert not any(t.is_contiguous() for t in (q_view, k_view, v_view))
    scale = q.shape[-1] ** -0.5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = chunk_attention(q_view, k_view, v_view, caches[0], caches[1], table, mask, scale)
    copies = {event.key for event in profile.key_averages()} & {"aten::contiguous", "aten::clone", "aten::copy_"}
    assert not copies, f"the kernel copied its strided inputs: {copies}"
    assert torch.equal(got, chunk_attention(q, k, v, caches[0], caches[1], table, mask, scale))


def test_any_mask_pattern_is_read_bit_for_bit() -> None:
    """The kernel reads the mask as bits per tile of 64 queries (each 64 x 64 square transposed): a random pattern over
    the window and the causal part of a chunk of two tiles and a partial one, the window and chunk not multiples of 64,
    equals torch's attention under the same mask."""
    q, k, v, caches, table, _ = inputs((2, 4, 2, 16, 8, 9, 150, 72, 0, None))
    generator = torch.Generator().manual_seed(1)
    window, chunk = table.shape[1] * 8, q.shape[2]
    mask = torch.rand(2, 1, chunk, window + chunk, generator=generator) < 0.3
    mask[..., window:] &= torch.ones(chunk, chunk, dtype=torch.bool).tril()
    mask[..., torch.arange(chunk), window + torch.arange(chunk)] = True  # every query attends itself
    got = chunk_attention(q, k, v, caches[0], caches[1], table, mask, 0.25)
    k_all = torch.cat((read_blocks(caches[0], table), k), dim=2)
    v_all = torch.cat((read_blocks(caches[1], table), v), dim=2)
    want = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_without_a_window_only_the_chunk_is_read() -> None:
    """Context encoding: no block table, the mask over the chunk's own keys."""
    q, k, v, caches, _, _ = inputs(CASES[1])
    positions = torch.arange(q.shape[2])[None]
    mask = chunk_mask(positions, None)
    got = chunk_attention(q, k, v, caches[0], caches[1], None, mask, 0.125)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_query_does_not_depend_on_the_padding_after_it() -> None:
    """The real queries of a chunk padded to 100 columns give bitwise the outputs of the same chunk padded to 70, and
    a query whose mask attends nothing gets zeros."""
    q, k, v, caches, table, _ = inputs(CASES[1])
    real = 60
    outs = []
    for chunk in (70, 100):
        positions = torch.arange(128, 128 + chunk).clamp(max=128 + real - 1)[None]
        mask = chunk_mask(positions, torch.arange(table.shape[1] * 32))
        outs.append(chunk_attention(q[:, :, :chunk], k[:, :, :chunk], v[:, :, :chunk], *caches, table, mask, 0.125))
    assert torch.equal(outs[0][:, :, :real], outs[1][:, :, :real])
    empty = torch.zeros(1, 1, 70, table.shape[1] * 32 + 70, dtype=torch.bool)
    got = chunk_attention(q[:, :, :70], k[:, :, :70], v[:, :, :70], *caches, table, empty, 0.125)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize(("case", "unread"), [(CASES[2], 3), (CASES[3], 3)], ids=["first chunk", "sliding window"])
def test_window_blocks_no_query_attends_are_not_read(case: tuple, unread: int) -> None:
    """The blocks before every query's first attended key (a first chunk's whole masked bucket, the blocks a sliding
    window left behind) are skipped, not multiplied by zero weights: NaN there changes nothing. A first chunk gives
    bitwise what the chunk alone gives (context encoding: no window)."""
    q, k, v, caches, table, mask = inputs(case)
    clean = chunk_attention(q, k, v, caches[0], caches[1], table, mask, 0.25)
    poisoned = [cache.clone() for cache in caches]
    for cache in poisoned:
        cache[table[:, :unread].flatten()] = float("nan")
    assert torch.equal(chunk_attention(q, k, v, poisoned[0], poisoned[1], table, mask, 0.25), clean)
    if case is CASES[2]:
        alone = chunk_attention(q, k, v, caches[0], caches[1], None, mask[..., table.numel() * case[4] :], 0.25)
        assert torch.equal(alone, clean)


def test_bad_inputs_raise() -> None:
    q, k, v, caches, table, mask = inputs(CASES[0])
    with pytest.raises(RuntimeError, match="float32"):
        chunk_attention(q.double(), k, v, caches[0], caches[1], table, mask, 0.25)
    with pytest.raises(RuntimeError, match="block_table names blocks"):
        chunk_attention(q, k, v, caches[0], caches[1], table + 100, mask, 0.25)
    with pytest.raises(RuntimeError, match="Hk dividing Hq"):
        chunk_attention(q[:, :3], k, v, caches[0], caches[1], table, mask, 0.25)
    with pytest.raises(RuntimeError, match="mask bool"):
        chunk_attention(q, k, v, caches[0], caches[1], table, mask[..., 1:], 0.25)


_OTHER_PATH = """
import sys
import torch
from tests.unit.test_chunk_attention import CASES, inputs, reference, strided_views
from optimum.neuron.kernels import library
from optimum.neuron.kernels.attention import chunk_attention
library.load()
outputs = []
for case in CASES:
    q, k, v, caches, table, mask = inputs(case, seed=3)
    got = chunk_attention(q, k, v, caches[0], caches[1], table, mask, q.shape[-1] ** -0.5)
    torch.testing.assert_close(got, reference(q, k, v, caches, table, mask), rtol=1e-5, atol=1e-6)
    in_place = chunk_attention(*strided_views(q, k, v), caches[0], caches[1], table, mask, q.shape[-1] ** -0.5)
    assert torch.equal(in_place, got), case
    outputs.append(got)
torch.save(outputs, sys.argv[1])
print("ok")
"""


@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_the_other_paths_equal_sdpa_too(path: str, tmp_path: Path) -> None:
    """The paths below the CPU's best equal SDPA, and read strided q, k and v in place (bitwise the contiguous
    inputs' results); the AVX2 path's results are bitwise those of this process's path (AVX-512 or AVX2: the same
    fused multiply-adds in the same order, the softmax the same lane for lane)."""
    env = {**os.environ, "OPTIMUM_NEURON_PACKED_ISA": path}
    saved = tmp_path / "outputs.pt"
    command = [sys.executable, "-c", _OTHER_PATH, str(saved)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    if path == "avx2":
        for case, theirs in zip(CASES, torch.load(saved), strict=True):
            q, k, v, caches, table, mask = inputs(case, seed=3)
            ours = chunk_attention(q, k, v, caches[0], caches[1], table, mask, q.shape[-1] ** -0.5)
            assert torch.equal(ours, theirs), f"AVX2 and this CPU's path differ on {case}"

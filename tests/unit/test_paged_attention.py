"""The paged attention kernel (`kernels.attention`): each row's attention over the blocks of its window, read in place,
equals torch's ``scaled_dot_product_attention`` on the gathered window (grouped-query attention, causal and
sliding-window masks, head sizes with and without a tail past the vector width, scattered blocks, an idle row reading
the scratch block), on each instruction-set path the CPU has (AVX-512, AVX2, portable); bad inputs raise. Its int8
twin (``--kv_cache_dtype int8``) is bitwise the float kernel on the dequantized cache, on each path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from optimum.neuron.kernels import library
from optimum.neuron.kernels.attention import paged_attention, paged_attention_int8
from optimum.neuron.models.layers.kv_cache import dequantize_kv, quantize_kv, read_blocks
from optimum.neuron.models.layers.masks import decode_mask, decode_window_mask

CASES = [  # (rows, query heads, KV heads, head size, block size, blocks per window, sliding window)
    (2, 4, 2, 16, 4, 4, None),
    (3, 9, 3, 64, 32, 8, None),
    (1, 8, 1, 20, 8, 3, None),  # a head size past the 8-float vectors
    (4, 6, 6, 32, 4, 5, 7),  # no grouping, a sliding window
    (2, 6, 2, 48, 16, 3, None),  # AVX-512: three single 16-float pieces; AVX2: a 32-float group and two 8-float pieces
    (2, 4, 2, 128, 8, 5, None),  # two 64-float groups of the value pass
]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    library.load()


def inputs(rows: int, heads: int, kv_heads: int, dim: int, block: int, blocks: int, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    pool = rows * blocks + 1  # block 0: the scratch block
    caches = [torch.randn(pool, kv_heads, block, dim, generator=generator) for _ in "KV"]
    table = (torch.randperm(pool - 1, generator=generator)[: rows * blocks] + 1).reshape(rows, blocks)
    q = torch.randn(rows, heads, 1, dim, generator=generator)
    positions = torch.randint(0, blocks * block, (rows, 1), generator=generator)
    return q, caches, table, positions


def reference(q: torch.Tensor, caches: list, table: torch.Tensor, mask: torch.Tensor, block: int) -> torch.Tensor:
    keys, values = (read_blocks(cache, table) for cache in caches)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim", "block", "blocks", "window"), CASES)
def test_equals_sdpa_on_the_gathered_window(
    rows: int, heads: int, kv_heads: int, dim: int, block: int, blocks: int, window: int | None
) -> None:
    q, caches, table, positions = inputs(rows, heads, kv_heads, dim, block, blocks)
    keys = torch.arange(blocks * block)
    mask = decode_mask(positions, keys) if window is None else decode_window_mask(positions, keys, window)
    got = paged_attention(q, caches[0], caches[1], table, mask.reshape(rows, -1), dim**-0.5)
    torch.testing.assert_close(got, reference(q, caches, table, mask, block), rtol=1e-5, atol=1e-6)


def test_an_idle_row_reads_the_scratch_block_and_a_row_with_no_key_gives_zeros() -> None:
    q, caches, table, positions = inputs(2, 4, 2, 16, 4, 4)
    table[1] = 0  # an idle row of the token-generation graph: all scratch, position 0
    positions[1] = 0
    mask = decode_mask(positions, torch.arange(16))
    got = paged_attention(q, caches[0], caches[1], table, mask.reshape(2, -1), 0.25)
    torch.testing.assert_close(got[1, :, 0], caches[1][0, :, 0].repeat_interleave(2, 0))  # its one key: slot 0
    empty = paged_attention(q, caches[0], caches[1], table, torch.zeros(2, 16, dtype=torch.bool), 0.25)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_bad_inputs_raise() -> None:
    q, caches, table, positions = inputs(2, 4, 2, 16, 4, 4)
    mask = decode_mask(positions, torch.arange(16)).reshape(2, -1)
    with pytest.raises(RuntimeError, match="float32"):
        paged_attention(q.double(), caches[0], caches[1], table, mask, 0.25)
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_attention(q, caches[0], caches[1], table + 100, mask, 0.25)
    with pytest.raises(RuntimeError, match="head layout"):
        paged_attention(q[:, :3], caches[0], caches[1], table, mask, 0.25)


def int8_caches(caches: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``[K, V, K scales, V scales]`` of float caches quantized per key (`quantize_kv`), with one all-zero key (scale
    0), and the float caches they dequantize to."""
    caches = [c.clone() for c in caches]
    caches[0][1, 0, 1] = 0
    (qk, sk), (qv, sv) = quantize_kv(caches[0]), quantize_kv(caches[1])
    return [qk, qv, sk, sv], [dequantize_kv(qk, sk, torch.float32), dequantize_kv(qv, sv, torch.float32)]


def check_int8(rows: int, heads: int, kv_heads: int, dim: int, block: int, blocks: int, seed: int) -> None:
    """The int8 kernel equals the float kernel on the dequantized cache bitwise, and SDPA on it within rounding."""
    q, caches, table, positions = inputs(rows, heads, kv_heads, dim, block, blocks, seed)
    quantized, dequantized = int8_caches(caches)
    mask = decode_mask(positions, torch.arange(blocks * block))
    got = paged_attention_int8(q, *quantized, table, mask.reshape(rows, -1), dim**-0.5)
    assert torch.equal(got, paged_attention(q, *dequantized, table, mask.reshape(rows, -1), dim**-0.5))
    torch.testing.assert_close(got, reference(q, dequantized, table, mask, block), rtol=1e-5, atol=1e-6)
    assert not torch.equal(got, paged_attention(q, *caches, table, mask.reshape(rows, -1), dim**-0.5))


@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim", "block", "blocks", "window"), CASES)
def test_int8_kernel_is_the_float_kernel_on_the_dequantized_cache(
    rows: int, heads: int, kv_heads: int, dim: int, block: int, blocks: int, window: int | None
) -> None:
    check_int8(rows, heads, kv_heads, dim, block, blocks, seed=1)


def test_int8_kernel_refuses_float_caches_and_misshaped_scales() -> None:
    q, caches, table, positions = inputs(2, 4, 2, 16, 4, 4)
    quantized, _ = int8_caches(caches)
    mask = decode_mask(positions, torch.arange(16)).reshape(2, -1)
    with pytest.raises(RuntimeError, match="int8 caches"):
        paged_attention_int8(q, caches[0], caches[1], *quantized[2:], table, mask, 0.25)
    with pytest.raises(RuntimeError, match="scales must be"):
        paged_attention_int8(q, *quantized[:2], *(s[:, :1].contiguous() for s in quantized[2:]), table, mask, 0.25)


_OTHER_PATH = """
import torch
from tests.unit.test_paged_attention import CASES, check_int8, inputs, reference
from optimum.neuron.kernels import library
from optimum.neuron.kernels.attention import paged_attention
from optimum.neuron.models.layers.masks import decode_mask
library.load()
for rows, heads, kv_heads, dim, block, blocks, _ in CASES:
    q, caches, table, positions = inputs(rows, heads, kv_heads, dim, block, blocks, seed=3)
    mask = decode_mask(positions, torch.arange(blocks * block))
    got = paged_attention(q, caches[0], caches[1], table, mask.reshape(rows, -1), dim ** -0.5)
    torch.testing.assert_close(got, reference(q, caches, table, mask, block), rtol=1e-5, atol=1e-6)
    check_int8(rows, heads, kv_heads, dim, block, blocks, seed=4)
print("ok")
"""


@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_the_other_paths_equal_sdpa_too(path: str) -> None:
    """The paths below the CPU's best (AVX2 on an AVX-512 CPU, portable): the float kernel equals SDPA, the int8
    kernel the float one on the dequantized cache."""
    env = {**os.environ, "OPTIMUM_NEURON_PACKED_ISA": path}
    done = subprocess.run([sys.executable, "-c", _OTHER_PATH], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

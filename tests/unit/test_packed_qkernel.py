"""The weight-only int8 / int4 packed kernel (``optimum_neuron::packed_qlinear``): its layouts (pack / unpack round
trips), its contracts for every group size, with group boundaries inside a K block (int8: bitwise ``packed_linear`` on
the packed dequantized weight; int4: bitwise the sums of `_int4_reference`, the scale taken once per run of a group),
the order of its sums (a row's result depends on that row only) and its refusals. The AVX-512 / AVX2 equality of its
paths is in test_packed_kernel.py's two-process test."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from optimum.neuron.kernels import library, packed

SHAPES = [(16, 8), (100, 64), (96, 200), (49, 1536)]
"""(out, in): a single panel, a ragged last panel, K not a multiple of the K block, K over several blocks."""
GROUPS = (8, 32, 40, 64, 128)
"""Group sizes tried where they divide K (and K itself: one group, per output channel): boundaries on, and inside, the
K blocks of 64."""
ROWS = (1, 3, 8, 13)
BITS = {8: (-127, 127, packed.pack_int8), 4: (-8, 7, packed.pack_int4)}
"""bits -> (lowest, highest value, packer)."""


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    library.load()


def _quantized(out: int, inp: int, bits: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``q [out, inp]`` int8 in the format's range and positive scales ``[out, inp // group]``."""
    generator = torch.Generator().manual_seed(seed)
    low, high, _ = BITS[bits]
    q = torch.randint(low, high + 1, (out, inp), dtype=torch.int8, generator=generator)
    scales = torch.rand(out, inp // group, generator=generator) / 32 + 1e-3
    return q, scales


def _dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The aten reference: one fp32 multiply per weight."""
    return q.float() * scales.repeat_interleave(q.shape[1] // scales.shape[1], dim=1)


BLOCK = 64
"""The kernel's K block (``kBlockK``): an int4 run of a scale group ends at a block's end too."""


def _int4_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fused: bool = True
) -> torch.Tensor:
    """packed_qlinear's int4 result, emulated: for each run of k steps sharing a scale group inside a K block,
    ``g = sum(x[:, k] * q[:, k])`` in order from zero, then ``out = g * scale + out``; the bias last. ``fused``: the
    vector paths (one rounding per fused multiply-add), else the portable one (the product rounded, then the sum).
    float64 holds each product exactly (a float32 times a 4-bit integer, or times a float32 scale) and each sum of two
    such values, then rounds to float32 where the kernel rounds."""
    rows, inp = x.shape
    group = inp // scales.shape[1]
    x64, q64, s64 = x.double(), q.double(), scales.double()

    def f32(t: torch.Tensor) -> torch.Tensor:
        return t.float().double()

    out = torch.zeros(rows, q.shape[0], dtype=torch.float64)
    for block in range(0, inp, BLOCK):
        k, stop = block, min(block + BLOCK, inp)
        while k < stop:
            end = min(stop, (k // group + 1) * group)
            g = torch.zeros_like(out)
            for i in range(k, end):
                product = x64[:, i : i + 1] * q64[:, i]
                g = f32(g + (product if fused else f32(product)))
            scaled = g * s64[:, k // group]
            out = f32(out + (scaled if fused else f32(scaled)))
            k = end
    return (out if bias is None else f32(out + bias.double())).float()


def _cases() -> list[tuple[int, int, int, int]]:
    return [
        (bits, out, inp, group)
        for bits in BITS
        for out, inp in SHAPES
        for group in sorted({g for g in GROUPS if inp % g == 0} | {inp})
    ]


def _expected(
    bits: int, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """What packed_qlinear must return, bitwise, on a vector path: int8 ``packed_linear`` on the packed dequantized
    weight, int4 `_int4_reference`."""
    if bits == 8:
        return packed.packed_linear(x, packed.pack(_dequantize(q, scales)), bias, q.shape[0])
    return _int4_reference(x.reshape(-1, x.shape[-1]), q, scales, bias).view(*x.shape[:-1], q.shape[0])


@pytest.mark.parametrize(("bits", "out", "inp", "group"), _cases())
def test_bitwise_the_contract_of_each_format(bits: int, out: int, inp: int, group: int) -> None:
    q, scales = _quantized(out, inp, bits, group)
    weight, table = BITS[bits][2](q), packed.pack_scales(scales)
    torch.manual_seed(inp + group)
    bias = torch.randn(out)
    for rows in ROWS:
        x = torch.randn(rows, inp)
        for b in (None, bias):
            got = packed.packed_qlinear(x, weight, table, b, out)
            assert got.shape == (rows, out) and got.dtype == torch.float32
            assert torch.equal(got, _expected(bits, x, q, scales, b)), (rows, b is None)
    x = torch.randn(2, 3, inp)
    assert torch.equal(packed.packed_qlinear(x, weight, table, bias, out), _expected(bits, x, q, scales, bias))


@pytest.mark.parametrize("bits", list(BITS))
def test_product_matches_float64(bits: int) -> None:
    out, inp, group = 100, 640, 64
    q, scales = _quantized(out, inp, bits, group, seed=3)
    x, bias = torch.randn(5, inp), torch.randn(out)
    got = packed.packed_qlinear(x, BITS[bits][2](q), packed.pack_scales(scales), bias, out)
    want = torch.nn.functional.linear(x.double(), _dequantize(q, scales).double(), bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * inp**0.5)


@pytest.mark.parametrize("bits", list(BITS))
@pytest.mark.parametrize("rows", [1, 4, 7, 8, 64])
def test_a_rows_result_depends_on_that_row_only(bits: int, rows: int) -> None:
    """Bitwise: equal rows of one call are equal, and a row alone gives what it gives among others."""
    out, inp, group = 100, 600, 40
    q, scales = _quantized(out, inp, bits, group, seed=rows)
    weight, table = BITS[bits][2](q), packed.pack_scales(scales)
    x = torch.randn(rows, inp)
    x[rows // 2 :] = x[rows // 2]
    y = packed.packed_qlinear(x, weight, table, None, out)
    assert torch.equal(y[rows // 2 :], y[rows // 2].expand(rows - rows // 2, out))
    for r in {0, rows - 1}:
        assert torch.equal(packed.packed_qlinear(x[r : r + 1], weight, table, None, out)[0], y[r])


def test_threads_do_not_change_a_result() -> None:
    q, scales = _quantized(300, 640, 4, 64, seed=1)
    weight, table, x = packed.pack_int4(q), packed.pack_scales(scales), torch.randn(8, 640)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = packed.packed_qlinear(x, weight, table, None, 300)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, packed.packed_qlinear(x, weight, table, None, 300))


@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_pack_unpack_round_trips_and_layouts(out: int, inp: int) -> None:
    q8, _ = _quantized(out, inp, 8, inp)
    t8 = packed.pack_int8(q8)
    assert t8.dtype == torch.int8 and t8.shape == packed.qpacked_shape(q8.shape, 8) == packed.packed_shape(q8.shape)
    assert torch.equal(packed.unpack_int8(t8, out), q8)
    assert torch.equal(t8, packed.pack(q8))

    q4 = torch.arange(out * inp, dtype=torch.int64).remainder(16).sub(8).to(torch.int8).view(out, inp)
    q4 = q4[torch.randperm(out)]  # every value in [-8, 7], the sign bit included
    t4 = packed.pack_int4(q4)
    panels = -(-out // 16)
    assert t4.dtype == torch.uint8 and t4.shape == packed.qpacked_shape(q4.shape, 4) == (panels, inp, 8)
    assert torch.equal(packed.unpack_int4(t4, out), q4)
    padded = torch.zeros(panels * 16, inp, dtype=torch.int8)
    padded[:out] = q4
    low, high = (padded[:, 0::2] & 0x0F).to(torch.uint8), (padded[:, 1::2] & 0x0F).to(torch.uint8)
    # byte j of pair i of panel p: column 16 p + j at k = 2 i in the low nibble, at k = 2 i + 1 in the high one
    pairs = (low | (high << 4)).view(panels, 16, inp // 2).transpose(1, 2)
    assert torch.equal(t4.view(panels, inp // 2, 16), pairs)

    scales = torch.rand(out, 3)
    table = packed.pack_scales(scales)
    assert table.shape == (3, panels * 16)
    assert torch.equal(table[:, :out], scales.t()) and not table[:, out:].any()


def test_helpers_refuse_what_they_cannot_pack() -> None:
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        packed.pack_int4(torch.full((4, 4), 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="K must be even"):
        packed.pack_int4(torch.zeros(4, 5, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        packed.pack_int8(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="float32"):
        packed.pack_scales(torch.zeros(4, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="8 or 4"):
        packed.qpacked_shape((4, 4), 2)


def _inputs(bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [2, 64], a packed weight of 20 x 64 and its scales in 2 groups."""
    q, scales = _quantized(20, 64, bits, 32)
    return torch.randn(2, 64), BITS[bits][2](q), packed.pack_scales(scales)


Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BAD: list[tuple[Call, str]] = [
    (lambda x, w, s: packed.packed_qlinear(x.double(), w, s, None, 20), "float32"),
    (lambda x, w, s: packed.packed_qlinear(x, w.float(), s, None, 20), "int8 weight"),
    (lambda x, w, s: packed.packed_qlinear(x, w.to(torch.int16), s, None, 20), "int8 weight"),
    (lambda x, w, s: packed.packed_qlinear(x, w[:, :, :8].contiguous(), s, None, 20), r"\[panels, K, 16\]"),
    (lambda x, w, s: packed.packed_qlinear(x, w.transpose(0, 1), s, None, 20), "contiguous"),
    (lambda x, w, s: packed.packed_qlinear(x[:, :60], w, s, None, 20), "features"),
    (lambda x, w, s: packed.packed_qlinear(x, w, s, None, 40), "output features"),
    (lambda x, w, s: packed.packed_qlinear(x, w, s, torch.randn(19), 20), "bias"),
    (lambda x, w, s: packed.packed_qlinear(x, w, s, torch.randn(20, dtype=torch.float64), 20), "bias"),
    (lambda x, w, s: packed.packed_qlinear(x, w, s.double(), None, 20), "scales must be float32"),
    (lambda x, w, s: packed.packed_qlinear(x, w, s[:, :16].contiguous(), None, 20), "scales must be"),
    (lambda x, w, s: packed.packed_qlinear(x, w, s[0], None, 20), "scales must be"),
    (lambda x, w, s: packed.packed_qlinear(x, w, s[:0], None, 20), "groups >= 1"),
    (lambda x, w, s: packed.packed_qlinear(x, w, torch.zeros(3, 32), None, 20), "groups do not divide"),
]


@pytest.mark.parametrize("bits", list(BITS))
@pytest.mark.parametrize(("call", "message"), BAD, ids=[f"{i}-{m}" for i, (_, m) in enumerate(BAD)])
def test_bad_inputs_are_refused_not_crashes(bits: int, call: Call, message: str) -> None:
    x, weight, scales = _inputs(bits)
    if bits == 4 and message == r"\[panels, K, 16\]":
        weight, message = weight[:, :, :4].contiguous(), r"\[panels, K, 8\]"
        call = lambda x, w, s: packed.packed_qlinear(x, w, s, None, 20)  # noqa: E731
    with pytest.raises(RuntimeError, match=message):
        call(x, weight, scales)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 8, 9, 300])
def test_cat_is_bitwise_the_separate_products(bits: int, rows: int) -> None:
    """packed_qlinear_cat: the weights' outputs side by side (ragged panels, K over several blocks), each bitwise what
    packed_qlinear gives it alone."""
    outs, inp, group = [100, 48, 20], 256, 64
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
    tables, scales = [], []
    for i, out in enumerate(outs):
        q, s = _quantized(out, inp, bits, group, seed=i)
        tables.append(BITS[bits][2](q))
        scales.append(packed.pack_scales(s))
    got = packed.packed_qlinear_cat(x, tables, scales, outs)
    alone = [packed.packed_qlinear(x, t, s, None, out) for t, s, out in zip(tables, scales, outs, strict=True)]
    assert torch.equal(got, torch.cat(alone, -1))


def test_cat_refuses_mixed_kinds_and_groups() -> None:
    q8, s8 = _quantized(32, 128, 8, 64)
    q4, s4 = _quantized(32, 128, 4, 64)
    x = torch.randn(2, 128)
    int8, int4 = packed.pack_int8(q8), packed.pack_int4(q4)
    with pytest.raises(RuntimeError, match="kind and group size"):
        packed.packed_qlinear_cat(x, [int8, int4], [packed.pack_scales(s8), packed.pack_scales(s4)], [32, 32])
    with pytest.raises(RuntimeError, match="kind and group size"):
        other = packed.pack_scales(torch.rand(32, 4))  # groups of 32
        packed.packed_qlinear_cat(x, [int8, int8], [packed.pack_scales(s8), other], [32, 32])
    with pytest.raises(RuntimeError, match="one scales tensor"):
        packed.packed_qlinear_cat(x, [int8, int8], [packed.pack_scales(s8)], [32, 32])


@pytest.mark.parametrize("bits", [8, 4])
def test_project_fuses_quantized_layers_only_in_short_calls(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`project` runs quantized layers of one scheme as one call up to QUANTIZED_CAT_ROWS rows, one call each beyond
    (and for mixed group sizes): bitwise what each layer gives alone either way."""
    from torch import nn

    from optimum.neuron.models.layers import packed_linear
    from optimum.neuron.models.layers.quantized import PackedQuantizedLinear

    def layer(out: int, group: int, seed: int) -> nn.Module:
        q, s = _quantized(out, 128, bits, group, seed=seed)
        module = nn.Linear(128, out, bias=seed == 0)
        module.__class__ = PackedQuantizedLinear
        module.weight = nn.Parameter(BITS[bits][2](q), requires_grad=False)
        module.weight_scale = nn.Parameter(packed.pack_scales(s), requires_grad=False)
        return module

    calls = []
    fused = packed_linear.packed_qlinear_cat
    monkeypatch.setattr(packed_linear, "packed_qlinear_cat", lambda *args: calls.append(1) or fused(*args))
    same, mixed = [layer(48, 64, 0), layer(20, 64, 1)], [layer(48, 64, 0), layer(20, 32, 1)]
    rows = packed_linear.QUANTIZED_CAT_ROWS
    for layers, count, want in ((same, rows, 1), (same, rows + 1, 0), (mixed, 1, 0)):
        calls.clear()
        x = torch.randn(1, count, 128)
        got = packed_linear.project(x, *layers)
        assert len(calls) == want
        for out, module in zip(got, layers, strict=True):
            assert torch.equal(out, module(x))


def test_int4_refuses_an_odd_group() -> None:
    """An int4 byte holds two steps of K: a group of one step (64 groups of K = 64) is refused, not misread."""
    x, weight, _ = _inputs(4)
    with pytest.raises(RuntimeError, match="group size must be even"):
        packed.packed_qlinear(x, weight, torch.ones(64, 32), None, 20)


def test_the_shape_function_matches_the_kernel() -> None:
    """The fake (meta) implementation that export and AOTInductor trace with gives the kernel's shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, weight, scales = _inputs(4)
    real = packed.packed_qlinear(x.view(1, 2, 64), weight, scales, None, 20)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = packed.packed_qlinear(torch.empty(1, 2, 64), weight, scales, None, 20)
    assert fake.shape == real.shape == (1, 2, 20) and fake.dtype == real.dtype


_CONTRACT = """
import sys
import torch
from optimum.neuron.kernels import library, packed
sys.path.insert(0, sys.argv[1])
from test_packed_qkernel import _int4_reference
library.load()
torch.manual_seed(4)
for pack_q, low, high in ((packed.pack_int8, -127, 127), (packed.pack_int4, -8, 7)):
    for n, k, group in ((100, 200, 40), (49, 160, 32), (16, 8, 8)):
        q = torch.randint(low, high + 1, (n, k), dtype=torch.int8)
        s = torch.rand(n, k // group) / 32
        w = q.float() * s.repeat_interleave(group, dim=1)
        for rows in (1, 7):
            x, b = torch.randn(rows, k), torch.randn(n)
            got = packed.packed_qlinear(x, pack_q(q), packed.pack_scales(s), b, n)
            if pack_q is packed.pack_int8:
                want = packed.packed_linear(x, packed.pack(w), b, n)
            else:
                want = _int4_reference(x, q, s, b, fused=False)
            assert torch.equal(got, want), (n, k, group, rows)
"""


def test_the_portable_path_keeps_the_contract() -> None:
    """OPTIMUM_NEURON_PACKED_ISA=portable (read once: its own process): the scalar loaders and tiles, bitwise int8
    ``packed_linear``'s portable tile on the dequantized weight and int4 `_int4_reference` with its roundings."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "OPTIMUM_NEURON_PACKED_ISA": "portable"}
    subprocess.run([sys.executable, "-c", _CONTRACT, str(Path(__file__).parent)], env=env, check=True)

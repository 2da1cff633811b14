"""``optimum_neuron::packed_linear``: the CPU kernel of the decoder's linear layers, and its weight layout.

A weight ``W [N, K]`` is packed once at load into ``[ceil(N / 16), K, 16]`` (`pack`): 16-column panels, each one
contiguous stretch of memory over the whole K, the zero-padded last panel included. The kernel
(``csrc/packed_linear.cpp``) streams a panel once per K block for every row of the call, so a decode step with 8 rows
reads its weights once, as a step with 1 row does; it sums each output in one fixed order whatever the row count or
the threads, so equal rows give bitwise equal outputs (DESIGN.md invariant 4). It runs AVX-512 where the CPU has it,
else AVX2 + FMA (bitwise equal results), else portable C++; ``OPTIMUM_NEURON_PACKED_ISA=avx2`` (or ``portable``) picks
a lesser path, read once per process.

``optimum_neuron::packed_qlinear`` is its weight-only int8 / int4 twin, on the same panels (`pack_int8`, `pack_int4`)
with fp32 scales per output column and group of K (`pack_scales`): a quarter (int8) or an eighth (int4) of the weight
bytes to read. int8 dequantizes each panel row at load, ``float(q) * scale`` in fp32 (one rounding), then runs
packed_linear's multiply-adds in packed_linear's order: bitwise ``packed_linear(x, pack(q * scales))``. int4 takes
each scale once per run of its group: for each run of k steps sharing a group inside the kernel's K block of 64, the
sum of ``x * q`` over the run in order (exact integer products), then ``out = fma(sum, scale, out)``; no multiply
per weight, so its products are bound by the bytes they stream, and within float32 rounding of the same product.

``optimum_neuron::packed_linear_swiglu`` runs a gated MLP's gate and up products and its SiLU in one call (each
product's sums bitwise packed_linear's), so the two products never reach memory.

The operators' schemas and their shape functions are defined here (what ``torch.export`` and AOTInductor need: a
compiled graph calls the operator by name through the dispatcher); their CPU implementation is the toolkit's small C++
library (`kernels.library`), compiled on first use into the cache (`library.load`: 20-50 s on two cores, then a cache
hit) and loaded before any graph runs.
"""

from __future__ import annotations

import torch

from ..quantization import pack_nibbles, unpack_nibbles

PANEL = 16
"""Output columns per panel."""
OPERATOR = "optimum_neuron::packed_linear"
QOPERATOR = "optimum_neuron::packed_qlinear"
CAT_OPERATOR = "optimum_neuron::packed_linear_cat"
QCAT_OPERATOR = "optimum_neuron::packed_qlinear_cat"
SWIGLU_OPERATOR = "optimum_neuron::packed_linear_swiglu"

torch.library.define(
    OPERATOR, "(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor", tags=(torch.Tag.flexible_layout,)
)
"""``flexible_layout``: the kernel takes ``x`` in any strides (it reads a contiguous view) and its weights are
contiguous constants, so inductor passes the operator's input as it is. Without a tag inductor applied its default
constraint the first time the operator appeared in a process and another one after, so a graph's code depended on
which graphs the process had compiled before (copies of the input of some projections)."""


@torch.library.register_fake(OPERATOR)
def _output_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W^T + bias`` for ``weight = pack(W)``: ``x [..., K]`` -> ``[..., out_features]``."""
    return torch.ops.optimum_neuron.packed_linear(x, weight, bias, out_features)


torch.library.define(
    CAT_OPERATOR, "(Tensor x, Tensor[] weights, int[] out_features) -> Tensor", tags=(torch.Tag.flexible_layout,)
)
"""Several packed weights on the same ``x``, their outputs side by side. No bias: a caller adds it after, bitwise
what packed_linear's kernel does (one fp32 add to the finished sum). (An empty or optional ``Tensor[]`` of biases is
not an option: AOTInductor's proxy executor passed an empty list as None, and the call failed in the graph.)"""


@torch.library.register_fake(CAT_OPERATOR)
def _cat_output_shape(x: torch.Tensor, weights: list[torch.Tensor], out_features: list[int]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(out_features)))


def packed_linear_cat(x: torch.Tensor, weights: list[torch.Tensor], out_features: list[int]) -> torch.Tensor:
    """``cat([x @ W_i^T for each i], -1)`` for ``weights[i] = pack(W_i)``, in one call: the threads share one parallel
    region over every weight's panels, where separate calls pay a fork and a barrier each. Each output is bitwise
    ``packed_linear(x, weights[i], None, out_features[i])``."""
    return torch.ops.optimum_neuron.packed_linear_cat(x, weights, out_features)


torch.library.define(
    SWIGLU_OPERATOR, "(Tensor x, Tensor gate, Tensor up, int out_features) -> Tensor", tags=(torch.Tag.flexible_layout,)
)
"""A gated MLP's ``silu(x @ G^T) * (x @ U^T)`` in one call (no bias)."""


@torch.library.register_fake(SWIGLU_OPERATOR)
def _swiglu_output_shape(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def packed_linear_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out_features: int) -> torch.Tensor:
    """``silu(x @ G^T) * (x @ U^T)`` for ``gate = pack(G)`` and ``up = pack(U)`` of one shape: ``x [..., K]`` ->
    ``[..., out_features]``. For each group of panels, a thread computes the gate's and the up's products (each sum
    bitwise what `packed_linear` gives) into buffers of its own, then ``silu(g) * u = g / (1 + exp(-g)) * u``: the two
    products never go to memory and back through a pointwise kernel. The exp is the attention kernels' (vec_exp.h,
    within 2 ulp of the exact value) on AVX2 and AVX-512, bitwise equal to each other, and ``std::exp`` on the portable
    path."""
    return torch.ops.optimum_neuron.packed_linear_swiglu(x, gate, up, out_features)


torch.library.define(
    QOPERATOR,
    "(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int out_features) -> Tensor",
    tags=(torch.Tag.flexible_layout,),
)
"""``weight``: int8 ``[P, K, 16]`` (`pack_int8`) or uint8 int4 pairs ``[P, K, 8]`` (`pack_int4`); ``scales``: float32
``[groups, P * 16]`` (`pack_scales`), ``groups`` dividing K. ``flexible_layout`` as for packed_linear."""


@torch.library.register_fake(QOPERATOR)
def _qoutput_shape(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def packed_qlinear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ W^T + bias`` for a weight-only quantized ``W``: ``x [..., K]`` float32 -> ``[..., out_features]``.

    ``weight`` is ``pack_int8(q)`` (int8) or ``pack_int4(q)`` (int4) of ``q [N, K]``, ``scales`` is
    ``pack_scales(s)`` of ``s [N, groups]``; ``W[n, k] = float(q[n, k]) * s[n, k // (K // groups)]``, one fp32
    multiply. int8: the result is bitwise ``packed_linear(x, pack(W), bias, out_features)``; int4: each scale is
    taken once per run of its group (the module docstring). Bad dtypes or shapes (groups not dividing K included)
    raise RuntimeError."""
    return torch.ops.optimum_neuron.packed_qlinear(x, weight, scales, bias, out_features)


torch.library.define(
    QCAT_OPERATOR,
    "(Tensor x, Tensor[] weights, Tensor[] scales, int[] out_features) -> Tensor",
    tags=(torch.Tag.flexible_layout,),
)
"""`packed_linear_cat`'s quantized twin: weights of one kind (int8 or int4) and one group size, a scales tensor each."""


@torch.library.register_fake(QCAT_OPERATOR)
def _qcat_output_shape(
    x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor], out_features: list[int]
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(out_features)))


def packed_qlinear_cat(
    x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor], out_features: list[int]
) -> torch.Tensor:
    """``cat([packed_qlinear(x, weights[i], scales[i], None, out_features[i]) for each i], -1)`` in one call (one
    parallel region), each output bitwise that; the weights of one kind and one group size (else RuntimeError)."""
    return torch.ops.optimum_neuron.packed_qlinear_cat(x, weights, scales, out_features)


def packed_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int]:
    """The packed shape of a weight of ``shape = (N, K)``."""
    rows, columns = shape
    return (-(-rows // PANEL), columns, PANEL)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` -> ``[ceil(N / 16), K, 16]``, ``P[p, k, j] = W[16 p + j, k]`` (zero past N)."""
    panels, columns, _ = packed_shape(weight.shape)
    padded = weight.new_zeros(panels * PANEL, columns)
    padded[: weight.shape[0]] = weight
    return padded.view(panels, PANEL, columns).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``[rows, K]`` weight that `pack` made ``packed`` from."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:rows]


ROWS_OPERATOR = "optimum_neuron::packed_rows"
torch.library.define(ROWS_OPERATOR, "(Tensor table, Tensor ids) -> Tensor")
"""An operator rather than a tensor index: inductor inlined the index into every kernel that read the rows, and each
gathered them again from a line per value (csrc/packed_rows.cpp)."""


@torch.library.register_fake(ROWS_OPERATOR)
def _rows_shape(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return table.new_empty((*ids.shape, table.shape[1]))


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``W[ids]`` of a packed weight, ``[*ids.shape, K]`` (``P[ids // 16, :, ids % 16]``): an embedding lookup in
    a tied embedding/LM head table kept only in the packed layout (fp32 or int8 panels). An id outside the table's
    rows raises RuntimeError."""
    return torch.ops.optimum_neuron.packed_rows(packed, ids)


def qpacked_shape(shape: torch.Size | tuple[int, ...], bits: int) -> tuple[int, int, int]:
    """The packed shape of a quantized weight of ``shape = (N, K)``: ``[P, K, 16]`` int8 (``bits=8``) or
    ``[P, K, 8]`` uint8 (``bits=4``, two weights a byte), ``P = ceil(N / 16)``."""
    if bits not in (4, 8):
        raise ValueError(f"quantized weights have 8 or 4 bits, not {bits}")
    panels, columns, _ = packed_shape(shape)
    return (panels, columns, PANEL if bits == 8 else PANEL // 2)


def _check_quantized(q: torch.Tensor, low: int, high: int) -> None:
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"expected an int8 [N, K] weight, got {q.dtype} {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < low or int(q.max()) > high):
        raise ValueError(f"quantized values must lie in [{low}, {high}], got [{int(q.min())}, {int(q.max())}]")


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` int8 (values in [-127, 127]) -> ``[ceil(N / 16), K, 16]`` int8, ``P[p, k, j] = q[16 p + j, k]``
    (zero past N): `pack`'s layout."""
    _check_quantized(q, -128, 127)
    return pack(q)


def unpack_int8(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``[rows, K]`` int8 weight that `pack_int8` made ``packed`` from."""
    return unpack(packed, rows)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` int8 with values in [-8, 7], K even -> ``[ceil(N / 16), K, 8]`` uint8, read as pairs of steps of
    K ``[P, K / 2, 16]``: byte ``j`` of pair ``i`` of panel ``p`` holds ``q[16 p + j, 2 i]`` in its low nibble and
    ``q[16 p + j, 2 i + 1]`` in its high nibble, each as 4-bit two's complement (zero past N: a zero byte is two zero
    weights). One 16-byte load gives the kernel two steps of a panel (each nibble a shift or two, or on AVX-512 a table
    lookup, away from its value)."""
    _check_quantized(q, -8, 7)
    if q.shape[1] % 2:
        raise ValueError(f"int4 panels pair the steps of K: K must be even, got {q.shape[1]}")
    panels, columns, _ = packed_shape(q.shape)
    pairs = pack(q).view(panels, columns // 2, 2, PANEL).transpose(2, 3)  # [P, K / 2, 16, 2]: (even, odd) per column
    return pack_nibbles(pairs.contiguous()).view(panels, columns, PANEL // 2)


def unpack_int4(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``[rows, K]`` int8 weight (values in [-8, 7]) that `pack_int4` made ``packed`` (uint8 ``[P, K, 8]``) from."""
    panels, columns, _ = packed.shape
    pairs = unpack_nibbles(packed.view(panels, columns // 2, PANEL)).view(panels, columns // 2, PANEL, 2)
    return unpack(pairs.transpose(2, 3).reshape(panels, columns, PANEL), rows)


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scales ``[N, groups]`` float32 (``scales[n, g]`` for output ``n`` and the g-th group of K) ->
    ``[groups, ceil(N / 16) * 16]``, zero past N: the layout `packed_qlinear` reads."""
    if scales.dtype != torch.float32 or scales.dim() != 2:
        raise ValueError(f"expected float32 scales [N, groups], got {scales.dtype} {tuple(scales.shape)}")
    rows, groups = scales.shape
    padded = scales.new_zeros(groups, -(-rows // PANEL) * PANEL)
    padded[:, :rows] = scales.t()
    return padded

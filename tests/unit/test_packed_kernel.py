"""The packed CPU kernel (`optimum/neuron/kernels`): its layout, its products against float64, the order of its sums
(a row's result depends on that row only: bitwise, whatever the row count), its refusals, and the packed twins of the
decoder's modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optimum.neuron.cache_dir import cache_root
from optimum.neuron.errors import BackendUnavailableError
from optimum.neuron.kernels import library, packed
from optimum.neuron.models.layers.embedding import PackedEmbedding, ScaledEmbedding
from optimum.neuron.models.layers.packed import PackedLinear, head_logits, pack_decoder, packable, packed_weights

SHAPES = [(16, 8), (100, 64), (96, 200), (49, 1536)]
"""(out, in): a single panel, a ragged last panel, K not a multiple of the K block, K over several blocks."""


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    library.load()


@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_pack_round_trip_and_rows(out: int, inp: int) -> None:
    weight = torch.randn(out, inp)
    table = packed.pack(weight)
    assert table.shape == packed.packed_shape(weight.shape) == (-(-out // 16), inp, 16)
    assert torch.equal(packed.unpack(table, out), weight)
    assert torch.equal(table.transpose(1, 2).reshape(-1, inp)[out:], torch.zeros(table.shape[0] * 16 - out, inp))
    ids = torch.tensor([[0, out - 1, out // 2], [1, 2, 3]]) % out
    assert torch.equal(packed.packed_rows(table, ids), weight[ids])


def test_packed_rows_of_int8_panels_and_ids_out_of_the_table() -> None:
    """The lookup operator copies int8 panels' rows as they are (a quantized tied table), gives [*ids.shape, K], and
    refuses an id outside the table's rows (its padded ones included) with a typed error, not a read out of bounds."""
    q = torch.randint(-127, 128, (100, 64), dtype=torch.int8)
    table = packed.pack_int8(q)
    ids = torch.tensor([[0, 99, 50, 7], [1, 2, 3, 16]])
    assert torch.equal(packed.packed_rows(table, ids), q[ids])
    assert torch.equal(packed.packed_rows(table, torch.tensor([100, 111]))[:, 0], torch.zeros(2, dtype=torch.int8))
    for bad in (112, -1):
        with pytest.raises(RuntimeError, match="outside the table's 112 rows"):
            packed.packed_rows(table, torch.tensor([3, bad]))


@pytest.mark.parametrize(("out", "inp"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 13, 64])
def test_product_matches_float64(out: int, inp: int, rows: int) -> None:
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(out, inp), torch.randn(out), torch.randn(2, rows, inp)
    got = packed.packed_linear(x, packed.pack(weight), bias, out)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert got.shape == (2, rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * inp**0.5)
    no_bias = packed.packed_linear(x, packed.pack(weight), None, out)
    torch.testing.assert_close(no_bias.double(), want - bias.double(), rtol=1e-5, atol=1e-4 * inp**0.5)


@pytest.mark.parametrize("rows", [1, 4, 6, 7, 8, 64, 256])
def test_a_rows_result_depends_on_that_row_only(rows: int) -> None:
    """Bitwise: equal rows of one call are equal, and a row alone gives what it gives among others (the padded
    columns of a prefill chunk repeat the last real one: invariant 4)."""
    torch.manual_seed(0)
    out, inp = 100, 600
    table = packed.pack(torch.randn(out, inp))
    x = torch.randn(rows, inp)
    x[rows // 2 :] = x[rows // 2]
    y = packed.packed_linear(x, table, None, out)
    assert torch.equal(y[rows // 2 :], y[rows // 2].expand(rows - rows // 2, out))
    for r in {0, rows - 1}:
        assert torch.equal(packed.packed_linear(x[r : r + 1], table, None, out)[0], y[r])


def test_threads_do_not_change_a_result() -> None:
    torch.manual_seed(1)
    table, x = packed.pack(torch.randn(300, 640)), torch.randn(8, 640)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = packed.packed_linear(x, table, None, 300)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, packed.packed_linear(x, table, None, 300))


@pytest.mark.parametrize("rows", [0, 1, 8, 9, 64, 300])
@pytest.mark.parametrize("outs", [[576, 192, 192], [1536, 1536], [20, 33, 16], [5]])
def test_cat_is_bitwise_the_separate_products(rows: int, outs: list[int]) -> None:
    """packed_linear_cat: the weights' outputs side by side, each bitwise what packed_linear gives it alone (ragged
    panels, no row at all, decode and prefill row counts), and its shape function agrees."""
    torch.manual_seed(rows)
    inp = 200
    x = torch.randn(2, rows, inp)
    tables = [packed.pack(torch.randn(out, inp)) for out in outs]
    got = packed.packed_linear_cat(x, tables, outs)
    alone = [packed.packed_linear(x, t, None, out) for t, out in zip(tables, outs, strict=True)]
    assert torch.equal(got, torch.cat(alone, -1))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = packed.packed_linear_cat(mode.from_tensor(x), [mode.from_tensor(t) for t in tables], outs)
    assert fake.shape == got.shape


CAT_BAD = [
    (lambda t: packed.packed_linear_cat(torch.randn(2, 8), [t, t], [20]), "one output size per weight"),
    (lambda t: packed.packed_linear_cat(torch.randn(2, 8), [], []), "at least one"),
    (lambda t: packed.packed_linear_cat(torch.randn(2, 8), [t, t[:, :7].contiguous()], [20, 20]), "features"),
    (lambda t: packed.packed_linear_cat(torch.randn(2, 8), [t, t.double()], [20, 20]), "float32"),
    (lambda t: packed.packed_linear_cat(torch.randn(2, 8), [t, t], [20, 40]), "output features"),
]


@pytest.mark.parametrize(("call", "message"), CAT_BAD, ids=[m for _, m in CAT_BAD])
def test_cat_refuses_mismatched_weights(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match=message):
        call(packed.pack(torch.randn(20, 8)))


def test_project_fuses_exactly_plain_packed_layers() -> None:
    """`project` gives bitwise what each layer gives alone, whether it fuses (plain packed layers, with biases or
    not, or some of each) or not (a layer in torch's layout among them)."""
    from optimum.neuron.models.layers.packed_linear import project

    torch.manual_seed(3)
    x = torch.randn(1, 5, 64)

    def packed_layer(out: int, bias: bool) -> nn.Module:
        layer = nn.Linear(64, out, bias=bias)
        twin = nn.Linear(64, out, bias=bias)
        twin.load_state_dict(layer.state_dict())
        twin.__class__ = PackedLinear
        twin.weight = nn.Parameter(packed.pack(layer.weight.detach()), requires_grad=False)
        return twin

    for layers in (
        [packed_layer(48, False), packed_layer(16, False)],
        [packed_layer(48, True), packed_layer(20, True)],
        [packed_layer(48, True), packed_layer(16, False)],
        [packed_layer(48, False), nn.Linear(64, 16)],
    ):
        got = project(x, *layers)
        assert len(got) == len(layers)
        for out, layer in zip(got, layers, strict=True):
            assert torch.equal(out, layer(x))


def _swiglu_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, out: int) -> torch.Tensor:
    """torch's SiLU of the gate's packed product, times the up's: what the MLP computed before the fused call."""
    return F.silu(packed.packed_linear(x, gate, None, out)) * packed.packed_linear(x, up, None, out)


@pytest.mark.parametrize("rows", [0, 1, 8, 9, 64, 300])
@pytest.mark.parametrize(("out", "inp"), [(1536, 576), (100, 64), (49, 1536)])
def test_swiglu_is_silu_of_the_gates_product_times_the_ups(rows: int, out: int, inp: int) -> None:
    """packed_linear_swiglu: torch's ``silu(x @ G^T) * (x @ U^T)`` on the packed products within a few float32 ulps
    (its own exp), for decode and prefill row counts, ragged panels and K over several blocks; its shape function
    agrees."""
    torch.manual_seed(rows + out)
    x, gate, up = torch.randn(2, rows, inp), packed.pack(torch.randn(out, inp) / 8), packed.pack(torch.randn(out, inp))
    got = packed.packed_linear_swiglu(x, gate, up, out)
    want = _swiglu_reference(x, gate, up, out)
    assert got.shape == want.shape == (2, rows, out)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = packed.packed_linear_swiglu(mode.from_tensor(x), mode.from_tensor(gate), mode.from_tensor(up), out)
    assert fake.shape == got.shape


@pytest.mark.parametrize("rows", [1, 8, 256])
def test_swiglus_products_are_bitwise_packed_linears(rows: int) -> None:
    """Where SiLU is the identity in float32 (gate outputs above ~20: exp(-g) vanishes beside 1), the fused call gives
    bitwise the product of packed_linear's two outputs: its sums are packed_linear's, in its order."""
    torch.manual_seed(rows)
    x, gate, up = torch.rand(rows, 576) + 1, packed.pack(torch.rand(100, 576) + 1), packed.pack(torch.randn(100, 576))
    got = packed.packed_linear_swiglu(x, gate, up, 100)
    assert torch.equal(got, packed.packed_linear(x, gate, None, 100) * packed.packed_linear(x, up, None, 100))


@pytest.mark.parametrize("rows", [4, 8, 256])
def test_a_rows_swiglu_depends_on_that_row_only(rows: int) -> None:
    torch.manual_seed(rows)
    gate, up, x = packed.pack(torch.randn(100, 600)), packed.pack(torch.randn(100, 600)), torch.randn(rows, 600)
    x[rows // 2 :] = x[rows // 2]
    y = packed.packed_linear_swiglu(x, gate, up, 100)
    assert torch.equal(y[rows // 2 :], y[rows // 2].expand(rows - rows // 2, 100))
    assert torch.equal(packed.packed_linear_swiglu(x[:1], gate, up, 100)[0], y[0])


SWIGLU_BAD = [
    (lambda t: packed.packed_linear_swiglu(torch.randn(2, 8), t, t[:1].contiguous(), 20), "one shape"),
    (lambda t: packed.packed_linear_swiglu(torch.randn(2, 8, dtype=torch.float64), t, t, 20), "float32"),
    (lambda t: packed.packed_linear_swiglu(torch.randn(2, 7), t, t, 20), "features"),
    (lambda t: packed.packed_linear_swiglu(torch.randn(2, 8), t, t, 40), "output features"),
]


@pytest.mark.parametrize(("call", "message"), SWIGLU_BAD, ids=[m for _, m in SWIGLU_BAD])
def test_swiglu_refuses_bad_inputs(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match=message):
        call(packed.pack(torch.randn(20, 8)))


def test_the_mlps_fuse_exactly_plain_packed_silu_layers() -> None:
    """A gated MLP (separate gate and up, or Phi-3's fused gate_up) with SiLU and plain packed layers runs the fused
    call; with biases, another activation, an intermediate size that splits a panel or torch's layout, the separate
    products. Either way, what the unfused MLP gives within float32 rounding."""
    from optimum.neuron.models.layers.mlp import FusedGatedMLP, GatedMLP

    torch.manual_seed(4)
    x = torch.randn(1, 5, 64)

    def packed_twin(layer: nn.Linear) -> nn.Linear:
        twin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        twin.load_state_dict(layer.state_dict())
        twin.__class__ = PackedLinear
        twin.weight = nn.Parameter(packed.pack(layer.weight.detach()), requires_grad=False)
        return twin

    calls = []
    real = packed.packed_linear_swiglu

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[-1])
        return real(*args)

    cases = [
        (GatedMLP(64, 48, "silu"), True),
        (GatedMLP(64, 48, "silu", bias=True), False),
        (GatedMLP(64, 48, "gelu_pytorch_tanh"), False),
        (FusedGatedMLP(64, 48, "silu"), True),
        (FusedGatedMLP(64, 40, "silu"), False),
    ]
    for mlp, fuses in cases:
        want = mlp(x)
        for name in [n for n, m in mlp.named_children() if isinstance(m, nn.Linear)]:
            setattr(mlp, name, packed_twin(getattr(mlp, name)))
        calls.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("optimum.neuron.models.layers.packed_linear.packed_linear_swiglu", counting)
            got = mlp(x)
        assert calls == ([mlp.down_proj.in_features] if fuses else []), (mlp, calls)
        torch.testing.assert_close(got, want)


BAD = [
    (lambda t: packed.packed_linear(torch.randn(2, 8, dtype=torch.float64), t, None, 20), "float32"),
    (lambda t: packed.packed_linear(torch.randn(2, 7), t, None, 20), "features"),
    (lambda t: packed.packed_linear(torch.randn(2, 8), t, None, 40), "output features"),
    (lambda t: packed.packed_linear(torch.randn(2, 8), t, torch.randn(19), 20), "bias"),
    (lambda t: packed.packed_linear(torch.randn(2, 8), t.transpose(0, 1), None, 20), "contiguous"),
]


@pytest.mark.parametrize(("call", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_inputs_are_refused_not_crashes(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match=message):
        call(packed.pack(torch.randn(20, 8)))


def test_no_compiler_is_a_typed_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.utils import cpp_extension

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(library, "_loaded", [])
    monkeypatch.setenv("OPTIMUM_NEURON_CACHE", str(tmp_path))  # nothing built there yet
    with pytest.raises(BackendUnavailableError, match="--linear_kernel aten --attention_kernel sdpa"):
        library.load()


def test_a_build_killed_midway_does_not_hang_the_next(tmp_path: Path) -> None:
    """torch's extension builder keeps a ``lock`` file in the build folder while it builds; a process killed then (a
    compile worker killed with its exporter) left it, and every later load waited for it forever. A load under the
    build's cache lock drops it (here: the built library copied into a fresh cache without its mark of a finished
    build, so ninja finds every output up to date and nothing is recompiled)."""
    build = _built_copy(tmp_path)
    (build / library.BUILT).unlink()
    (build / "lock").write_text("")
    _load_in_fresh_process(tmp_path, timeout=120)  # without the fix: forever
    assert not (build / "lock").exists() and (build / library.BUILT).exists()


def test_a_built_library_loads_from_an_environment_reached_by_another_path(tmp_path: Path) -> None:
    """The environment linked under another name (as every docs-check block links ``.venv``) changes the paths torch's
    builder writes into its compile commands, and loading through the builder recompiled the whole library (~40 s)
    in every such process; a finished build is now loaded as it is. Here the builder fails if called, and the loaded
    library computes a product."""
    _built_copy(tmp_path)
    (tmp_path / "env").symlink_to(sys.prefix, target_is_directory=True)
    script = (
        "import torch; from torch.utils import cpp_extension\n"
        "def builder(*args, **kwargs): raise AssertionError('the library was built again')\n"
        "cpp_extension.load = builder\n"
        "from optimum.neuron.kernels import library, packed; library.load()\n"
        "x, w = torch.randn(3, 8), torch.randn(20, 8)\n"
        "print(torch.allclose(packed.packed_linear(x, packed.pack(w), None, 20), x @ w.t(), atol=1e-5))"
    )
    env = {**os.environ, "OPTIMUM_NEURON_CACHE": str(tmp_path)}
    python = tmp_path / "env" / "bin" / Path(sys.executable).name
    done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("True"), done.stderr[-2000:]


def test_a_built_library_whose_file_is_gone_is_built_again(tmp_path: Path) -> None:
    """The mark of a finished build with no library beside it (a cache pruned by hand) is not trusted: the load builds
    (here ninja only links again: the objects are there) instead of failing to open the file."""
    build = _built_copy(tmp_path)
    library.library_file(build).unlink()
    _load_in_fresh_process(tmp_path, timeout=300)
    assert library.library_file(build).is_file() and (build / library.BUILT).exists()


def _load_in_fresh_process(cache: Path, timeout: int) -> None:
    """`library.load` in a new Python process whose cache is ``cache``; fails the test unless it loads."""
    env = {**os.environ, "OPTIMUM_NEURON_CACHE": str(cache)}
    command = [sys.executable, "-c", "from optimum.neuron.kernels import library; library.load(); print('ok')"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def _built_copy(cache: Path) -> Path:
    """The library this process loaded, copied into the kernels folder of the fresh cache ``cache``."""
    library.load()
    key = library._build_key()
    build = cache / "kernels" / key
    shutil.copytree(cache_root() / "kernels" / key, build)
    return build


class _Tiny(nn.Module):
    """The names `packable` looks for: decoder layers, a tied embedding table, an LM head."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tied = tied
        self.model = nn.Module()
        self.model.embed_tokens = ScaledEmbedding(40, 8, 2.0)
        self.model.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 20), nn.Linear(20, 8, bias=False))])
        self.lm_head = None if tied else nn.Linear(8, 40, bias=False)


@pytest.mark.parametrize("tied", [True, False])
def test_pack_decoder_swaps_exactly_the_packable_modules(tied: bool) -> None:
    plain = _Tiny(tied).eval()
    decoder = _Tiny(tied).eval()
    decoder.load_state_dict(plain.state_dict())
    names = packable(decoder)
    pack_decoder(decoder)
    assert isinstance(decoder.model.layers[0][0], PackedLinear)
    assert isinstance(decoder.model.embed_tokens, PackedEmbedding) is tied
    assert packed_weights(decoder) == {f"{n}.weight" for n in names}
    state = {k: packed.pack(v) if k in packed_weights(decoder) else v for k, v in plain.state_dict().items()}
    decoder.load_state_dict(state, assign=True)
    ids, h = torch.tensor([[3, 39, 0]]), torch.randn(1, 3, 8)
    assert torch.equal(decoder.model.embed_tokens(ids), plain.model.embed_tokens(ids))
    torch.testing.assert_close(decoder.model.layers[0](h), plain.model.layers[0](h))
    head = lambda m: m.model.embed_tokens if tied else m.lm_head  # noqa: E731
    torch.testing.assert_close(head_logits(head(decoder), h), head_logits(head(plain), h))


_PRODUCTS = """
import sys, torch
from optimum.neuron.kernels import library, packed
library.load()
torch.manual_seed(2)
out = {}
for rows in (1, 6, 8, 64, 256):
    for n, k in ((100, 600), (49, 1536), (576, 576)):
        w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
        out[(rows, n, k)] = packed.packed_linear(x, packed.pack(w), b, n)
for bits, pack_q, low in ((8, packed.pack_int8, -127), (4, packed.pack_int4, -8)):
    for rows in (1, 6, 13):
        for n, k, group in ((100, 600, 40), (49, 1536, 64), (96, 200, 200)):
            q = torch.randint(low, -low + 1 if bits == 8 else 8, (n, k), dtype=torch.int8)
            s = packed.pack_scales(torch.rand(n, k // group) / 64)
            x, b = torch.randn(rows, k), torch.randn(n)
            out[(bits, rows, n, k, group)] = packed.packed_qlinear(x, pack_q(q), s, b, n)
for rows in (1, 8, 256):
    for n, k in ((1536, 576), (49, 1536)):
        g, u, x = torch.randn(n, k) / 8, torch.randn(n, k), torch.randn(rows, k)
        out[("swiglu", rows, n, k)] = packed.packed_linear_swiglu(x, packed.pack(g), packed.pack(u), n)
torch.save(out, sys.argv[1])
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            line = next((row for row in info if row.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def _products_under(tmp_path: Path, name: str, env: dict[str, str]) -> dict[tuple, torch.Tensor]:
    """`_PRODUCTS`' outputs computed in a fresh process with ``env`` added (the kernels read their switches once)."""
    path = tmp_path / f"{name}.pt"
    subprocess.run([sys.executable, "-c", _PRODUCTS, str(path)], env={**os.environ, **env}, check=True)
    return torch.load(path)


def _assert_bitwise_equal(first: dict[tuple, torch.Tensor], second: dict[tuple, torch.Tensor]) -> None:
    assert first.keys() == second.keys()
    for key, value in first.items():
        assert torch.equal(value, second[key]), key


@pytest.mark.skipif(not {"avx512f", "avx2", "fma"} <= _cpu_flags(), reason="needs a CPU with AVX-512 and AVX2 + FMA")
def test_avx512_and_avx2_paths_are_bitwise_equal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The AVX-512 tile (16-float registers, other tile sizes) runs the same fused multiply-adds in the same order as
    the AVX2 one: every output is bitwise equal, for decode and prefill row counts, fp32 and the int8 / int4 weights
    of packed_qlinear (their own decoders per path), and packed_linear_swiglu (the same exp lane for lane); each path
    in its own process (OPTIMUM_NEURON_PACKED_ISA is read once)."""
    results = {isa: _products_under(tmp_path, isa, {"OPTIMUM_NEURON_PACKED_ISA": isa}) for isa in ("avx512", "avx2")}
    _assert_bitwise_equal(results["avx512"], results["avx2"])


def test_the_decode_stream_schedule_does_not_change_a_result(tmp_path: Path) -> None:
    """A decode step's products read their weights as one stream per thread on some CPUs and as groups of panels on
    others (`stream_once_pays` in isa.h, OPTIMUM_NEURON_STREAM_ONCE=1 / 0 forcing either): the same sums in the same
    order, so every output is bitwise equal either way."""
    results = {on: _products_under(tmp_path, on, {"OPTIMUM_NEURON_STREAM_ONCE": on}) for on in ("1", "0")}
    _assert_bitwise_equal(results["1"], results["0"])

"""The candidates kernel of sampling (``optimum_neuron::top_candidates``): the ``k`` largest logits of each row and
their ids, best first, equal logits by increasing id, NaN above every number, of several logits equal to the ``k``-th
those of the smallest ids, bitwise against a reference that sorts the whole row; torch's path (``topk`` and two
sorts) gives the same tensors where no tie straddles the ``k``-th; every instruction-set path; refusals."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from optimum.neuron.kernels import library
from optimum.neuron.kernels.candidates import top_candidates
from optimum.neuron.models.layers.sampling import _candidates


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    library.load()


def _reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule by sorting each whole row: NaN first, then larger values, then smaller ids."""
    values, ids = [], []
    for row in x.tolist():
        order = sorted(range(len(row)), key=lambda i: (not math.isnan(row[i]), -row[i] if row[i] == row[i] else 0, i))
        ids.append(order[:k])
        values.append([row[i] for i in order[:k]])
    return torch.tensor(values, dtype=torch.float32), torch.tensor(ids, dtype=torch.long)


def _rows(kind: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=generator)
    if kind == "ties":  # few distinct values: ties everywhere, the k-th included
        x = torch.randint(0, 4, (rows, vocab), generator=generator).float()
    elif kind == "bf16":
        x = x.bfloat16().float()
    elif kind == "special":  # masked tokens, infinities, signed zeros, NaN
        x[:, ::7] = -1.0e30
        x[:, 3::11] = -math.inf
        x[0, 5], x[-1, 9] = math.inf, math.inf
        x[:, 6], x[:, 8] = -0.0, 0.0
        x[0, 4], x[-1, 10:12] = math.nan, math.nan
    return x


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Bitwise equal values (NaN where NaN) and equal ids."""
    (gv, gi), (wv, wi) = got, want
    return (
        torch.equal(gi, wi)
        and torch.equal(gv.isnan(), wv.isnan())
        and torch.equal(gv.nan_to_num(7.0).view(torch.int32), wv.nan_to_num(7.0).view(torch.int32))
    )


@pytest.mark.parametrize("kind", ["normal", "ties", "bf16", "special"])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 37), (3, 1000), (8, 4099)])
def test_the_rule_bitwise(kind: str, rows: int, vocab: int) -> None:
    x = _rows(kind, rows, vocab)
    for k in sorted({1, 5, min(256, vocab), vocab}):
        assert _same(top_candidates(x, k), _reference(x, k)), (kind, k)


def test_torch_path_gives_the_same_tensors_without_a_tie_at_the_kth() -> None:
    x = _rows("normal", 8, 49152, seed=3)
    values, _ = _reference(x, 257)
    assert bool((values[:, 255] != values[:, 256]).all()), "the case needs no tie at the k-th"
    assert _same(top_candidates(x, 256), _candidates(x, 256))
    assert _same(_candidates(x, 256, kernel=True), _candidates(x, 256))


def test_a_rows_result_depends_on_that_row_only_and_not_on_threads() -> None:
    x = _rows("ties", 8, 3000, seed=1)
    together = top_candidates(x, 64)
    for r in (0, 7):
        assert _same(top_candidates(x[r : r + 1], 64), (together[0][r : r + 1], together[1][r : r + 1]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = top_candidates(x, 64)
    finally:
        torch.set_num_threads(threads)
    assert _same(alone, together)


_PATH = """
import sys
import torch
from optimum.neuron.kernels import library
from optimum.neuron.kernels.candidates import top_candidates
sys.path.insert(0, sys.argv[1])
from test_top_candidates import _reference, _rows, _same
library.load()
for kind in ("normal", "ties", "special"):
    x = _rows(kind, 3, 1003)
    for k in (1, 9, 256, 1003):
        assert _same(top_candidates(x, k), _reference(x, k)), (kind, k)
"""


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_every_instruction_set_path_keeps_the_rule(isa: str) -> None:
    """OPTIMUM_NEURON_PACKED_ISA is read once per process: each lesser path in its own."""
    env = {**os.environ, "OPTIMUM_NEURON_PACKED_ISA": isa}
    subprocess.run([sys.executable, "-c", _PATH, str(Path(__file__).parent)], env=env, check=True)


@pytest.mark.parametrize(
    ("logits", "k", "message"),
    [
        (torch.zeros(2, 8, dtype=torch.float64), 2, "float32"),
        (torch.zeros(8), 2, r"\[rows, vocabulary\]"),
        (torch.zeros(2, 8), 0, r"k must lie in \[1, 8\]"),
        (torch.zeros(2, 8), 9, r"k must lie in \[1, 8\]"),
    ],
)
def test_bad_inputs_are_refused_not_crashes(logits: torch.Tensor, k: int, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        top_candidates(logits, k)


def test_the_shape_function_matches_the_kernel() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = top_candidates(torch.randn(3, 50), 7)
    with FakeTensorMode():
        fake = top_candidates(torch.empty(3, 50), 7)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


def test_graphs_take_the_kernels_candidates_exactly_where_they_call_the_toolkits_kernels() -> None:
    """fp32 on the CPU (eager, inductor): the graphs' sampling and the engine's host sampling take the kernel's
    candidates; without the toolkit's kernels (``--linear_kernel aten --attention_kernel sdpa``, bf16), torch's."""
    from transformers import LlamaConfig

    from optimum.neuron.artifact import graph_decoder
    from optimum.neuron.config import NeuronConfig

    hf_config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    base = NeuronConfig(batch_size=1, sequence_length=64, prefill_chunk_size=16)
    cases = {
        base: True,
        base.derive(backend="eager"): True,
        base.derive(linear_kernel="aten"): True,  # the paged attention still calls the library
        base.derive(linear_kernel="aten", attention_kernel="sdpa"): False,
        base.derive(auto_cast_type="bf16"): False,
    }
    for config, expected in cases.items():
        assert config.cpu_kernels is expected, config
        assert graph_decoder(hf_config, config).cpu_candidates is expected, config

"""The bitwise check of invariant 4, shared by `tests/contract/test_backend_contract.py` (fp32, every backend)
and `tests/models/test_kv_bitwise.py` (bf16, eager and inductor).

A chunk with ``fill < C`` real tokens is padded by repeating the last real token id and position. The
padded columns must not change anything live: they write their K/V to the scratch block (block 0, never read),
and they cannot influence the real columns (those only attend to earlier, real keys). So the
shipped graph, run on a cache filled with noise, must write exactly positions ``[start, start + fill)`` of its
sequence (through its blocks), bitwise equal to the rows written when the same tokens are the first ``fill`` of an
unpadded chunk of the same length (the chunk bucket the call runs at, `--chunk_buckets`: ``fill`` tokens are padded
to the shortest bucket holding them; calls of different lengths agree within rounding, not bitwise), plus the
scratch block, and leave every other row of the cache untouched.

(An earlier form of this invariant let padded columns write duplicates of the last real row, relying on
them computing it bitwise; XLA:CPU on an AVX2 host computes identical rows of a matmul differently in the
last bit depending on their place in the kernel's row blocks, so that premise does not hold everywhere.)

The padded chunk is the prompt's second chunk (the first is full), so cache reads are exercised. A placeholder
sequence holds slot 0 and the pool's first block, so the sequence's slot and blocks are not the first ones.
`FAMILIES` adds a sliding-window layer (gemma3: window 12, so the second chunk's queries lose the first
keys) and a sparse MoE layer (qwen3_moe) to the llama reference.
"""

from __future__ import annotations

import torch

from optimum.neuron.artifact import Artifact
from optimum.neuron.graphs import GraphKind, select_graph
from optimum.neuron.models.layers.kv_cache import SCRATCH_BLOCK
from optimum.neuron.runtime.engine import Engine
from tests.contract.engine_tools import GREEDY, by_slot, sequence_slots
from tests.models.exports import CHUNK, dtype_fixture

FAMILY = "llama"
FAMILIES = (FAMILY, "gemma3", "qwen3_moe")
"""The families the check runs on: the reference, one with sliding-window layers, one with an MoE layer."""
SLOT = 1
START = CHUNK  # the padded chunk follows one full chunk
FILLS = (1, 2, 5, CHUNK - 1)  # real tokens in the padded chunk


class Setup:
    """The shipped engine of one (backend, dtype) case (or a given engine), with a placeholder sequence holding
    slot 0."""

    def __init__(self, backend: str, dtype: str, family: str = FAMILY, engine: Engine | None = None) -> None:
        self.engine = engine or Engine(Artifact.open(dtype_fixture(family, backend, dtype)))
        self.engine.admit("placeholder", [3], GREEDY)  # holds slot 0, never stepped
        prompt = torch.randint(3, 256, (2 * CHUNK,), generator=torch.Generator().manual_seed(5)).tolist()
        self.first, self.second = prompt[:CHUNK], prompt[CHUNK:]

    def start(self, tokens: list[int], seed: int) -> list[torch.Tensor]:
        """Fill the cache with noise, admit ``first + tokens`` in slot `SLOT` (no cached block reused: the noise
        overwrote them), prefill the full first chunk, and return a host copy of the cache."""
        generator = torch.Generator().manual_seed(seed)
        for tensor in self.engine.kv_cache:
            tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype).to(tensor.device))
        self.engine.release("chunks")
        assert self.engine.admit("chunks", self.first + tokens, GREEDY, reuse=False).slot == SLOT
        self.engine.step({"chunks": CHUNK})
        return [by_slot(t) for t in self.engine.kv_cache]

    def shipped(self, tokens: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Host copies of the cache (`by_slot`) before and after the shipped graph prefills ``tokens`` at
        ``START``."""
        before = self.start(tokens, seed)
        self.engine.step({"chunks": len(tokens)})
        return before, [by_slot(t) for t in self.engine.kv_cache]

    def slots(self, first: int, last: int) -> torch.Tensor:
        """The cache rows of positions ``[first, last)`` of the sequence."""
        return sequence_slots(self.engine, "chunks", first, last)

    @property
    def scratch(self) -> slice:
        """The cache rows of the scratch block."""
        size = self.engine.block_size
        return slice(SCRATCH_BLOCK * size, (SCRATCH_BLOCK + 1) * size)


_setups: dict[tuple[str, str, str], Setup] = {}


def setup(backend: str, dtype: str, family: str = FAMILY) -> Setup:
    if (backend, dtype, family) not in _setups:
        _setups[(backend, dtype, family)] = Setup(backend, dtype, family)
    return _setups[(backend, dtype, family)]


def rows(cache: list[torch.Tensor], slots: torch.Tensor | slice) -> list[torch.Tensor]:
    """The rows ``slots`` of every K and V tensor."""
    return [t[slots] for t in cache]


def unchanged_outside(case: Setup, before: list[torch.Tensor], after: list[torch.Tensor], live: torch.Tensor) -> bool:
    """True when only the rows ``live`` and the scratch block differ between the caches."""
    for old, new in zip(before, after, strict=True):
        old, new = old.clone(), new.clone()
        for tensor in (old, new):
            tensor[live] = 0
            tensor[case.scratch] = 0
        if not torch.equal(old, new):
            return False
    return True


def check_padded_chunk_writes(backend: str, dtype: str, family: str = FAMILY) -> None:
    """The shipped graph writes only the real rows (bitwise as the same tokens in a full chunk do) and,
    for its padded columns, the scratch row."""
    _check_padded_chunk_writes(setup(backend, dtype, family))


def check_padded_chunk_writes_on(engine: Engine) -> None:
    """`check_padded_chunk_writes` on an engine of a chunked artifact with ``C = CHUNK``, ``S = SEQUENCE_LENGTH`` (a
    tensor-parallel rank's: its own heads of the cache), its slots free; it ends holding two sequences."""
    _check_padded_chunk_writes(Setup("", "", engine=engine))


def _check_padded_chunk_writes(case: Setup) -> None:
    for fill in FILLS:
        before, padded = case.shipped(case.second[:fill], seed=fill)
        chunk = case.slots(START, START + fill)
        assert unchanged_outside(case, before, padded, chunk), f"fill {fill}: a live row outside the chunk changed"
        written = zip(rows(before, chunk), rows(padded, chunk), strict=True)
        assert not any(torch.equal(old, new) for old, new in written), f"fill {fill}: the chunk's rows were not written"
        scratch = zip(rows(before, case.scratch), rows(padded, case.scratch), strict=True)
        assert not any(torch.equal(old, new) for old, new in scratch), (
            f"fill {fill}: padding did not use the scratch block"
        )
        prefix = case.slots(0, START + fill)
        call = select_graph(case.engine.specs.values(), GraphKind.CHUNKED_PREFILL, reach=START, tokens=fill)
        assert call is not None, "the artifact has a chunked-prefill graph"
        bucket = call.tokens  # the padded call's length
        _, full = case.shipped(case.second[:bucket], seed=fill)  # same noise, same first chunk, no padding
        for got, want in zip(rows(padded, prefix), rows(full, case.slots(0, START + fill)), strict=True):
            assert torch.equal(got, want), f"fill {fill}: padded and unpadded chunks wrote different K/V"

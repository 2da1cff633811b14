"""The two bitwise checks of invariant 4, shared by `tests/contract/test_backend_contract.py` (fp32, every
backend) and `tests/models/test_kv_bitwise.py` (bf16, eager and inductor).

A chunk with ``fill < C`` real tokens is padded by repeating the last real token id and position, so
all padded columns write cache row ``start + fill - 1``. That duplicate write is harmless only if
every padded column computes K/V *bitwise* equal to the real last token's, in every layer: a backend
may apply duplicate scatter indices in any order. The shipped graph hides the losing writes, so:

* the **inspection graph** is the chunked-prefill graph compiled by the same backend from the same
  model code, traced with `write_rows` spreading column ``j`` to row ``start + j``; every padded
  column's K/V row then shows, and must equal the real last token's row bitwise, while the real
  columns' rows must equal what the shipped graph writes (`check_padded_columns`);
* the **shipped graph**, run on a cache filled with noise, must write exactly rows
  ``[start, start + fill)`` of its slot, bitwise equal to the rows written when the same tokens are
  the first ``fill`` of a full, unpadded chunk, and leave every other row untouched
  (`check_padded_chunk_writes`).

The padded chunk is the prompt's second chunk (the first is full), so cache reads are exercised. The
sequence is prefilled in slot 1 (a placeholder holds slot 0), so the slot offset of the writes counts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from optimum.exporters.neuron.cache import cache_lock, code_fingerprint
from optimum.exporters.neuron.export import load_decoder, model_fingerprint
from optimum.neuron.artifact import Artifact
from optimum.neuron.backends import get_backend
from optimum.neuron.graphs import GraphKind, example_inputs, graph_args, graph_spec
from optimum.neuron.models.base import graph_module
from optimum.neuron.models.layers import attention, kv_cache
from optimum.neuron.runtime.engine import Engine
from optimum.neuron.runtime.padding import pad_chunk
from tests.contract.engine_tools import GREEDY
from tests.fixtures.llm.models import cache_dir, tiny_model
from tests.models.exports import CHUNK, dtype_fixture

FAMILY = "llama"
SLOT = 1
START = CHUNK  # the padded chunk follows one full chunk
FILLS = (1, 2, 5, CHUNK - 1)  # real tokens in the padded chunk
Graph = Callable[..., torch.Tensor]


def spread_rows(cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, new: torch.Tensor) -> None:
    """Inspection `write_rows`: column ``j`` of the call goes to row ``positions[b, 0] + j``, so
    duplicate (padded) positions land on rows of their own."""
    spread = positions[:, :1] + torch.arange(new.shape[2], device=positions.device)[None, :]
    kv_cache.write_rows(cache, rows, spread, new)


@contextmanager
def spreading_writes() -> Iterator[None]:
    """Trace or run the attention layers with `spread_rows` instead of `write_rows`."""
    original = attention.write_rows
    attention.write_rows = spread_rows
    try:
        yield
    finally:
        attention.write_rows = original


class Setup:
    """The shipped engine and the inspection graph of one (backend, dtype) case."""

    def __init__(self, backend: str, dtype: str) -> None:
        self.engine = Engine(Artifact.open(dtype_fixture(FAMILY, backend, dtype)))
        self.engine.admit("placeholder", [3], GREEDY)  # holds slot 0, never stepped
        self.inspect = inspection_graph(backend, self.engine)
        prompt = torch.randint(3, 256, (2 * CHUNK,), generator=torch.Generator().manual_seed(5)).tolist()
        self.first, self.second = prompt[:CHUNK], prompt[CHUNK:]

    def start(self, tokens: list[int], seed: int) -> list[torch.Tensor]:
        """Fill the cache with noise, admit ``first + tokens`` in slot `SLOT`, prefill the full first chunk,
        and return a host copy of the cache."""
        generator = torch.Generator().manual_seed(seed)
        for tensor in self.engine.kv_cache:
            tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype).to(tensor.device))
        self.engine.release("chunks")
        assert self.engine.admit("chunks", self.first + tokens, GREEDY).slot == SLOT
        self.engine.step({"chunks": CHUNK})
        return [t.cpu().clone() for t in self.engine.kv_cache]

    def shipped(self, tokens: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Host copies of the cache before and after the shipped graph prefills ``tokens`` at ``START``."""
        before = self.start(tokens, seed)
        self.engine.step({"chunks": len(tokens)})
        return before, [t.cpu().clone() for t in self.engine.kv_cache]

    def inspected(self, tokens: list[int], before: list[torch.Tensor]) -> list[torch.Tensor]:
        """The cache (on the host) after the inspection graph runs the padded chunk of ``tokens`` on ``before``."""
        device = self.engine.device
        cache = [t.clone().to(device) for t in before]
        ids, positions = pad_chunk(tokens, START, CHUNK)
        inputs = {"input_ids": ids, "position_ids": positions, "seq_ids": torch.tensor([SLOT])}
        inputs = {k: v.to(device) for k, v in inputs.items()}
        self.inspect(*graph_args(GraphKind.CHUNKED_PREFILL, inputs, cache))
        return [t.cpu() for t in cache]


def inspection_graph(backend: str, engine: Engine) -> Graph:
    """The chunked-prefill graph of ``engine``'s artifact with spread writes, built by ``backend``."""
    config, model_dir = engine.config, tiny_model(FAMILY)
    decoder, weights = load_decoder(engine.hf_config, model_dir, config, engine.device)
    spec = graph_spec(config, GraphKind.CHUNKED_PREFILL)
    module = graph_module(decoder, spec).eval()
    if backend == "eager":

        def run(*args: Any) -> torch.Tensor:
            with spreading_writes(), torch.inference_mode():
                return module(*args)

        return run
    key = config.cache_key(f"{model_fingerprint(model_dir)}:{code_fingerprint()}:spread-rows-v1")
    folder = cache_dir() / "inspect" / key
    compiler = get_backend(backend)
    path = folder / f"{GraphKind.CHUNKED_PREFILL.value}{compiler.suffix}"
    with cache_lock(folder.with_name(f"{key}.lock")):
        if not path.is_file():
            staging = folder.with_name(f"{key}.tmp{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            cache = [torch.zeros(t.shape, dtype=t.dtype).to(engine.device) for t in engine.kv_cache]
            inputs = example_inputs(config, GraphKind.CHUNKED_PREFILL, engine.hf_config.vocab_size)
            inputs = {k: v.to(engine.device) for k, v in inputs.items()}
            with spreading_writes():
                compiler.compile(module, graph_args(GraphKind.CHUNKED_PREFILL, inputs, cache), staging / path.name)
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
    return compiler.load(path, weights, lambda: module)


_setups: dict[tuple[str, str], Setup] = {}


def setup(backend: str, dtype: str) -> Setup:
    if (backend, dtype) not in _setups:
        _setups[(backend, dtype)] = Setup(backend, dtype)
    return _setups[(backend, dtype)]


def rows(cache: list[torch.Tensor], first: int, last: int) -> list[torch.Tensor]:
    """Rows ``[first, last)`` of slot `SLOT` in every K and V tensor."""
    return [t[SLOT, :, first:last] for t in cache]


def padded_rows_equal_last_real(cache: list[torch.Tensor], fill: int) -> list[bool]:
    """Per K/V tensor: do rows ``START + fill - 1 .. START + C - 1`` (the last real column and every
    padded column of an inspected call) all equal the last real one bitwise?"""
    last = START + fill - 1
    padded = [t[SLOT, :, last : START + CHUNK] for t in cache]
    return [torch.equal(p, p[:, :1].expand_as(p)) for p in padded]


def unchanged_outside(before: list[torch.Tensor], after: list[torch.Tensor], first: int, last: int) -> bool:
    """True when only rows ``[first, last)`` of slot `SLOT` differ between the two caches."""
    for old, new in zip(before, after, strict=True):
        old, new = old.clone(), new.clone()
        old[SLOT, :, first:last] = 0
        new[SLOT, :, first:last] = 0
        if not torch.equal(old, new):
            return False
    return True


def check_padded_columns(backend: str, dtype: str) -> None:
    """The inspection graph shows every padded column's K/V: bitwise the real last token's."""
    case = setup(backend, dtype)
    for fill in FILLS:
        tokens = case.second[:fill]
        before, shipped = case.shipped(tokens, seed=fill)
        inspected = case.inspected(tokens, before)
        equal = padded_rows_equal_last_real(inspected, fill)
        assert all(equal), f"fill {fill}: padded K/V differ from the last real token's in tensors {equal}"
        for got, want in zip(rows(inspected, START, START + fill), rows(shipped, START, START + fill), strict=True):
            assert torch.equal(got, want), f"fill {fill}: inspection graph computes other K/V than the shipped one"


def check_padded_chunk_writes(backend: str, dtype: str) -> None:
    """The shipped graph writes only the real rows, bitwise as the same tokens in a full chunk do."""
    case = setup(backend, dtype)
    for fill in FILLS:
        before, padded = case.shipped(case.second[:fill], seed=fill)
        assert unchanged_outside(before, padded, START, START + fill), f"fill {fill}: a row outside the chunk changed"
        written = zip(rows(before, START, START + fill), rows(padded, START, START + fill), strict=True)
        assert not any(torch.equal(old, new) for old, new in written), f"fill {fill}: the chunk's rows were not written"
        _, full = case.shipped(case.second, seed=fill)  # same noise, same first chunk, no padding
        for got, want in zip(rows(padded, 0, START + fill), rows(full, 0, START + fill), strict=True):
            assert torch.equal(got, want), f"fill {fill}: padded and unpadded chunks wrote different K/V"

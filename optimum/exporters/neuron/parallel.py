"""The process group a tensor-parallel graph is traced under at export.

A rank's graph ends each attention and MLP block with an all-reduce over the default process group
(`optimum.neuron.models.layers.parallel.all_reduce`). Tracing it needs a default group of the artifact's degree,
but no live peers: torch's *fake* process group (rank 0 of N, collectives return their input) lets
``torch.export`` record ``_c10d_functional.all_reduce(x, "sum", "0")`` and AOTInductor compile it in this one
process. At run time each rank's process joins a real group (gloo, started by vLLM's workers) whose default group
has the same name, and the same graph runs the real collective.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from ...neuron.errors import IncompatibleConfigError


@contextmanager
def tracing_group(degree: int) -> Iterator[None]:
    """A default process group of ``degree`` ranks for the duration of the block (none needed at degree 1): the
    caller's own when it has one of that size, else a fake one, destroyed afterwards."""
    if degree == 1:
        yield
        return
    if dist.is_initialized():
        if dist.get_world_size() != degree:
            raise IncompatibleConfigError(
                f"this process already belongs to a process group of {dist.get_world_size()} ranks: export "
                f"--tensor_parallel_size {degree} from a process without one (or of that size)."
            )
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    try:
        yield
    finally:
        dist.destroy_process_group()

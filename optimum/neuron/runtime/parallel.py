"""Which tensor-parallel rank this process runs.

A tensor-parallel artifact's graphs all-reduce over the default torch.distributed process group, so every rank is
its own process, all in one group of exactly ``tp_degree`` processes, and every rank runs the same engine steps in
the same order (each holds its heads' part of every sequence's KV cache). vLLM's multiprocess executor does exactly
that: one worker per rank, the same scheduler output broadcast to each. ``generate()`` runs in one process, so at
``tp_degree > 1`` it works only when the caller started the ranks itself (one process per rank, a gloo group, the
same calls on every rank).
"""

from __future__ import annotations

import torch.distributed as dist

from ..config import NeuronConfig, flag
from ..errors import IncompatibleConfigError


def tensor_parallel_rank(config: NeuronConfig) -> int:
    """0 for a single-rank artifact; else this process's rank in the default process group, which must hold
    exactly ``config.tp_degree`` processes (`IncompatibleConfigError` saying how to run it otherwise)."""
    if config.tp_degree == 1:
        return 0
    if not dist.is_initialized():
        raise IncompatibleConfigError(
            f"this artifact was exported with {flag('tp_degree')} {config.tp_degree}: its graphs run in "
            f"{config.tp_degree} processes that exchange partial results. Serve it with `vllm serve <artifact>` "
            "(one worker process per rank), or start one process per rank that joins a torch.distributed gloo group "
            "(`init_process_group`) and makes the same calls; or re-export with --tensor_parallel_size 1."
        )
    if dist.get_world_size() != config.tp_degree:
        raise IncompatibleConfigError(
            f"this artifact runs on {config.tp_degree} tensor-parallel ranks but the process group holds "
            f"{dist.get_world_size()}: start exactly {config.tp_degree} processes, or re-export with "
            f"{flag('tp_degree')} {dist.get_world_size()}."
        )
    return dist.get_rank()

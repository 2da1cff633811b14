"""Run a function on N tensor-parallel ranks: N spawned processes in one gloo group on 127.0.0.1, each calling
the same function (the engine's steps must run on every rank in the same order), each result saved by rank."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(*args), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_on_ranks(world: int, fn: Callable[..., Any], *args: Any, tmp: Path) -> list[Any]:
    """``fn(*args)`` on each of ``world`` ranks (``fn`` importable at module level); the results, by rank. A rank
    that fails makes the whole call raise."""
    import torch.multiprocessing as mp

    from benchmark.serving.server import free_port

    mp.start_processes(
        _rank_main, args=(world, free_port(), fn, args, str(tmp)), nprocs=world, start_method="spawn", join=True
    )
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]

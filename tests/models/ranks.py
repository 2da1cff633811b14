"""Run a function on N tensor-parallel ranks: N spawned processes in one gloo group on 127.0.0.1, each calling
the same function (the engine's steps must run on every rank in the same order), each result saved by rank.

Each rank writes its standard error to ``rank{r}.err`` beside its result, with `faulthandler` on, so a rank that dies
(a signal: a C++ abort in gloo, say) leaves its last words and every thread's Python stack there; a failed call
raises with the tail of each rank's file (pytest's capture of the spawned processes' output was cut from CI's log)."""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _rank_main(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out: str) -> None:
    import torch.distributed as dist

    err = open(Path(out) / f"rank{rank}.err", "w", buffering=1)  # noqa: SIM115 - the rank's fd 2 until it exits
    os.dup2(err.fileno(), 2)
    faulthandler.enable(err, all_threads=True)
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
    from torch.multiprocessing.spawn import ProcessException

    from benchmark.serving.server import free_port

    try:
        mp.start_processes(
            _rank_main, args=(world, free_port(), fn, args, str(tmp)), nprocs=world, start_method="spawn", join=True
        )
    except ProcessException as error:
        raise RankFailed(f"{error}\n{_ranks_stderr(world, tmp)}") from error
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


class RankFailed(RuntimeError):
    """A rank of `run_on_ranks` failed: the error of the first rank that did, then each rank's standard error."""


def _ranks_stderr(world: int, tmp: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of each rank's ``rank{r}.err`` (what `_rank_main` sent there)."""
    parts = []
    for r in range(world):
        path = tmp / f"rank{r}.err"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no file)"]
        parts.append(f"--- rank {r} stderr, last {lines} lines ({path}) ---\n" + "\n".join(text))
    return "\n".join(parts)


def greedy_on_rank(names: list[str], lengths: tuple[int, ...], new: int) -> dict[str, dict[int, list[int]]]:
    """On one rank, for each named export fixture: ``new`` greedy tokens after the prompt of each of ``lengths``
    (`engine_tools.prompt`), by length; and the padded-chunk writes checked bitwise on the rank's heads."""
    from optimum.neuron.modeling import NeuronModelForCausalLM
    from tests.contract import kv_inspection
    from tests.contract.engine_tools import prompt
    from tests.fixtures.llm.models import export_fixture

    tokens: dict[str, dict[int, list[int]]] = {}
    for name in names:
        model = NeuronModelForCausalLM.from_pretrained(export_fixture(name))
        tokens[name] = {}
        for length in lengths:
            ids = torch.tensor([prompt(length, length)])
            tokens[name][length] = model.generate(ids, max_new_tokens=new, eos_token_id=[])[0, length:].tolist()
        kv_inspection.check_padded_chunk_writes_on(model.engine)
    return tokens

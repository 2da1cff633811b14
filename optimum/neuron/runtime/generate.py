"""HF-style generation as a thin adapter over the `Engine`: admit every prompt, prefill them all in one
step, then one decode step at a time until each sequence stops (an EOS id, ``max_new_tokens``, or a
full KV slot). Row ``i`` samples with ``seed + i`` when a seed is given."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from ..errors import InputError
from .engine import Engine
from .sampling import SamplingParams
from .sequence import Sequence


def generate_tokens(
    engine: Engine,
    prompts: Seq[Seq[int]],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: set[int],
) -> list[list[int]]:
    """New tokens for each prompt; every slot taken is given back, whatever happens."""
    _check_batch(engine, prompts, max_new_tokens)
    call = object()  # this call's sequence ids cannot clash with anyone else's
    ids = [(call, row) for row in range(len(prompts))]
    try:
        sequences = [engine.admit(ids[row], p, _row_params(params, row)) for row, p in enumerate(prompts)]
        engine.step({s.seq_id: s.pending for s in sequences})
        while live := [s for s in sequences if not _stopped(s, max_new_tokens, eos_token_ids)]:
            engine.step({s.seq_id: 1 for s in live})
    finally:
        for seq_id in ids:
            engine.release(seq_id)
    return [s.generated for s in sequences]


def _check_batch(engine: Engine, prompts: Seq[Seq[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise InputError("generate() needs at least one prompt.")
    if len(prompts) > engine.slots.free_count:
        raise InputError(
            f"{len(prompts)} prompts but only {engine.slots.free_count} free KV slots (batch_size="
            f"{engine.config.batch_size}): pass fewer prompts or re-export with a larger --batch_size."
        )
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")


def _row_params(params: SamplingParams, row: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + row)


def _stopped(sequence: Sequence, max_new_tokens: int, eos_token_ids: set[int]) -> bool:
    new = sequence.generated
    return new[-1] in eos_token_ids or len(new) >= max_new_tokens or sequence.full

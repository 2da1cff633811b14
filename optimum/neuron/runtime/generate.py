"""HF-style generation on an `Engine`: each prompt is prefilled into its own KV slot (chunk by chunk
for a chunked artifact), then all sequences decode together in the token-generation graph."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InputError
from .engine import Engine
from .sampling import SamplingParams, SequenceSampler, sample_on_host


@dataclass
class _Sequence:
    slot: int
    sampler: SequenceSampler
    tokens: list[int]
    position: int
    done: bool = False


def generate_tokens(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: set[int],
) -> list[list[int]]:
    """New tokens for each prompt (stopping at an EOS id, ``max_new_tokens``, or a full KV slot)."""
    _check_batch(engine, prompts, max_new_tokens)
    seqs: list[_Sequence] = []
    try:
        for index, prompt in enumerate(prompts):
            seqs.append(_start(engine, index, list(prompt), params, eos_token_ids))
        for _ in range(max_new_tokens - 1):
            live = {s.slot: s for s in seqs if not s.done}
            if not live:
                break
            _step(engine, live, max_new_tokens, eos_token_ids)
    finally:
        for s in seqs:
            engine.slots.release(s.slot)
    return [s.tokens for s in seqs]


def _check_batch(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise InputError("generate() needs at least one prompt.")
    if len(prompts) > engine.slots.free_count:
        raise InputError(
            f"{len(prompts)} prompts but only {engine.slots.free_count} free KV slots (batch_size="
            f"{engine.config.batch_size}): pass fewer prompts or re-export with a larger --batch_size."
        )
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    for prompt in prompts:
        engine.check_prompt_length(len(prompt))


def _start(engine: Engine, index: int, prompt: list[int], params: SamplingParams, eos: set[int]) -> _Sequence:
    slot = engine.slots.acquire(("generate", index))
    engine.reset_slot(slot)
    seeded = params if params.seed is None else SamplingParams(**{**params.__dict__, "seed": params.seed + index})
    sampler = SequenceSampler(seeded)
    logits = engine.prefill(prompt, slot)
    token = int(sample_on_host(logits[None], [sampler], engine.config.max_topk)[0])
    seq = _Sequence(slot, sampler, [token], len(prompt))
    seq.done = token in eos or seq.position >= engine.config.sequence_length
    return seq


def _step(engine: Engine, live: dict[int, _Sequence], max_new: int, eos: set[int]) -> None:
    active = {slot: (s.tokens[-1], s.position) for slot, s in live.items()}
    out = engine.decode(active, {slot: s.sampler for slot, s in live.items()})
    for slot, s in live.items():
        s.tokens.append(out[slot])
        s.position += 1
        full = s.position >= engine.config.sequence_length
        s.done = out[slot] in eos or len(s.tokens) >= max_new or full

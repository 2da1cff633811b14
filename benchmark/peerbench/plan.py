"""What one run measures (full or ``--quick``) and the token ids every system gets (made once per run, with a
fixed seed, so that ours and OpenVINO see the very same prompts; llama-bench draws its own)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SEQUENCE_LENGTH, CHUNK = 2048, 256
"""Our artifacts: room for a 1,024-token prompt and its answer; chunked prefill of 256 tokens."""
FIRST_ID, LAST_ID = 100, 40000
"""Random prompts use ordinary token ids (no special tokens)."""
DECODE_WARMUP = 3
"""Untimed decode steps of ours after the prompt, before the timed ones (`ours.decode`)."""


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    rounds: int = 3
    batch: int = 8
    """Rows of the batched decode step (and of our second artifact)."""
    decode_steps: int = 128
    decode_context: int = 16
    prefill_lengths: tuple[int, ...] = (256, 1024)
    prefill_repeats: int = 3
    workload_prompts: int = 8
    workload_prompt_len: int = 200
    workload_spread: float = 0.1
    workload_new_tokens: int = 128
    llama_repetitions: int = 3

    @classmethod
    def quick(cls, rounds: int | None = None) -> Plan:
        """A short run for validation: fewer rounds, steps, repeats and new tokens (same shapes otherwise)."""
        return cls(rounds=rounds or 2, decode_steps=16, prefill_repeats=1, workload_new_tokens=32, llama_repetitions=1)


def decode_positions(plan: Plan) -> float:
    """The mean number of cache positions a timed decode step of ours attends: the prompt, the warm-up steps, then
    one more per timed step (the KV cache a step reads grows with it: `figures.floors`)."""
    return plan.decode_context + DECODE_WARMUP + (plan.decode_steps + 1) / 2


def inputs(plan: Plan, seed: int = 0, last_id: int = LAST_ID) -> dict[str, Any]:
    """Every prompt of the run: decode contexts (1 and 8 rows), prefill prompts (a warm-up and ``prefill_repeats``
    fresh ones per length: no system can reuse a cached prefix), the workload's prompts (lengths uniform in
    ``workload_prompt_len`` +- ``workload_spread``) and a short warm-up prompt; ids in ``[FIRST_ID, last_id]``."""
    rng = random.Random(seed)

    def prompt(length: int) -> list[int]:
        return [rng.randint(FIRST_ID, last_id) for _ in range(length)]

    low = int(plan.workload_prompt_len * (1 - plan.workload_spread))
    high = int(plan.workload_prompt_len * (1 + plan.workload_spread))
    lengths = [rng.randint(low, high) for _ in range(plan.workload_prompts)]
    return {
        "decode_b1": [prompt(plan.decode_context)],
        "decode_b8": [prompt(plan.decode_context) for _ in range(plan.batch)],
        "prefill": {str(n): [prompt(n) for _ in range(1 + plan.prefill_repeats)] for n in plan.prefill_lengths},
        "workload": [prompt(n) for n in lengths],
        "warmup": prompt(8),
    }

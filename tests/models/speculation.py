"""Helpers of the speculative-decoding tests (`tests/models/test_speculation.py`, `tests/xla/test_xla_speculation.py`):
the ``-spec3`` fixtures, and a greedy run whose decode steps propose transformers' next tokens (some wrong) and check
which ones each step keeps."""

from __future__ import annotations

from collections.abc import Hashable

from optimum.neuron.artifact import Artifact
from optimum.neuron.runtime.engine import Engine
from tests.contract.engine_tools import GREEDY
from tests.fixtures.llm.models import export_fixture

K = 3
PLAN = (3, 1, 2, 3, 3, 2)
"""Proposed tokens per decode step, in turn (capped by what is left to generate)."""
WRONG_EVERY = 3
"""Every third step's proposal has its last token wrong."""


def spec_name(family: str, backend: str) -> str:
    return f"{family}-2x4x8-spec{K}-{backend}"


def spec_engine(family: str, backend: str) -> Engine:
    return Engine(Artifact.open(export_fixture(spec_name(family, backend))))


def proposal(reference: list[int], done: int, step: int) -> tuple[list[int], int]:
    """The tokens proposed at decode step ``step`` of a sequence that generated ``done`` of ``reference``, and how
    many of them must be kept."""
    count = min(PLAN[step % len(PLAN)], len(reference) - done - 1)
    drafts = list(reference[done : done + count])
    if drafts and step % WRONG_EVERY == 1:
        drafts[-1] = 3 + (drafts[-1] - 2) % 253  # another id of the tiny vocabulary (3..255)
        return drafts, count - 1
    return drafts, count


def speculate(engine: Engine, seq_id: Hashable, ids: list[int], reference: list[int]) -> list[int]:
    """Generate ``len(reference)`` tokens of ``ids`` greedily, each decode step proposing `proposal`'s tokens;
    asserts that each step keeps exactly the right ones. Returns the tokens generated."""
    engine.admit(seq_id, ids, GREEDY, reuse=False)
    try:
        engine.step({seq_id: len(ids)})
        sequence, step = engine.sequence(seq_id), 0
        while len(sequence.generated) < len(reference):
            drafts, keep = proposal(reference, len(sequence.generated), step)
            result = engine.step({seq_id: 1}, drafts={seq_id: drafts})
            assert result.accepted.get(seq_id, 0) == keep, (step, drafts, sequence.generated)
            if drafts:  # verified on the host: one logits row per new token
                assert len(result.token_logits[seq_id]) == keep + 1
            step += 1
        return list(sequence.generated)
    finally:
        engine.release(seq_id)

"""The model runner: one scheduler step (plain `Step` data) -> one `Engine.step` -> sampled tokens.

A thin adapter: finished requests are released, preempted ones preempted, new ones admitted,
resumed ones resumed, and the scheduled token counts go to the engine as they are. The engine keeps
every request's tokens, cache progress and sampler; the runner only checks that vLLM's count of
computed tokens agrees with the engine's, and keeps a log of what each step ran.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import InputError, SlotError
from ..runtime.engine import Engine
from ..runtime.sequence import StepResult
from .compat import CachedRequest, Step
from .sampling import to_sampling_params


@dataclass
class StepRecord:
    """What one step ran, for logs and tests: decoded request ids and ``(req_id, start, count)`` prefills."""

    index: int
    decodes: list[str] = field(default_factory=list)
    prefills: list[tuple[str, int, int]] = field(default_factory=list)


class Runner:
    """Drives an `Engine` from scheduler steps."""

    def __init__(self, engine: Engine, keep_records: int = 10_000) -> None:
        self.engine = engine
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self._steps = 0

    def execute(self, step: Step) -> tuple[list[str], dict[str, list[int]]]:
        """Run ``step``; returns the scheduled request ids and, per id, the tokens sampled
        (``[]`` for a prefill that has not reached the end of its prompt)."""
        for req_id in step.finished:
            self.engine.release(req_id)
        for req_id in step.preempted:
            self.engine.preempt(req_id)
        for new in step.new:
            if new.num_computed_tokens:
                raise SlotError(f"request {new.req_id} arrives with cached tokens, but prefix caching must be off.")
            self.engine.admit(new.req_id, new.prompt_token_ids, to_sampling_params(new.sampling_params))
        for cached in step.cached:
            self._sync(cached)
        result = self.engine.step(step.num_scheduled_tokens)
        self._record(result)
        scheduled = list(step.num_scheduled_tokens)
        return scheduled, {r: [result.tokens[r]] if r in result.tokens else [] for r in scheduled}

    def _sync(self, cached: CachedRequest) -> None:
        """Resume a preempted request; check vLLM's computed-token count against the engine's."""
        if cached.resumed:
            self.engine.resume(cached.req_id, cached.all_token_ids)
        computed = self.engine.sequence(cached.req_id).computed
        if computed != cached.num_computed_tokens:
            raise InputError(
                f"request {cached.req_id}: vLLM counts {cached.num_computed_tokens} computed tokens, the engine "
                f"{computed}; the scheduler and the runner disagree (is prefix caching or speculative decoding on?)."
            )

    def _record(self, result: StepResult) -> None:
        if result.decodes or result.prefills:
            decodes = [str(r) for r in result.decodes]
            prefills = [(str(r), start, count) for r, start, count in result.prefills]
            self.records.append(StepRecord(self._steps, decodes, prefills))
        self._steps += 1

"""The model runner: one scheduler step (plain `Step` data) -> one `Engine.step` -> what it sampled.

A thin adapter: finished requests are released, preempted ones preempted, new ones admitted,
resumed ones resumed, and the scheduled token counts go to the engine as they are, with vLLM's own
sampler (`host_sampling.HostSampling`, bound to the step's grammar bitmask) for the requests that need it. The
engine keeps every request's tokens, cache progress, sampler and prompt logprobs; the runner only checks
that vLLM's count of computed tokens agrees with the engine's, and keeps a log of what each step ran.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError, SlotError
from ..runtime.engine import Engine
from ..runtime.images import ImageInput, real_tiles
from ..runtime.logprobs import Logprobs
from ..runtime.sequence import StepResult
from .compat import CachedRequest, Step
from .host_sampling import HostSampling
from .sampling import to_sampling_params


@dataclass
class StepRecord:
    """What one step ran, for logs and tests: decoded request ids and ``(req_id, start, count)`` prefills."""

    index: int
    decodes: list[str] = field(default_factory=list)
    prefills: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass
class StepOutput:
    """What one scheduler step produced, per scheduled request."""

    req_ids: list[str]
    """The scheduled requests, in the scheduler's order."""
    sampled: dict[str, list[int]]
    """The tokens sampled (``[]`` for a prefill that has not reached the end of its prompt)."""
    logprobs: dict[str, Logprobs]
    """The sampled tokens' logprobs, for the requests that ask them."""
    prompt_logprobs: dict[str, Logprobs]
    """The prompt logprobs of the requests that ask them, at the step their prompt completes."""


class Runner:
    """Drives an `Engine` from scheduler steps."""

    def __init__(self, engine: Engine, keep_records: int = 10_000) -> None:
        self.engine = engine
        self.host = HostSampling(engine.config.batch_size, engine.hf_config.vocab_size)
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self._steps = 0

    def execute(self, step: Step, grammar_output: Any = None) -> StepOutput:
        """Run ``step`` (with the step's grammar bitmask, ``GrammarOutput``, for structured-output requests)."""
        for req_id in step.finished:
            self.engine.release(req_id)
        for req_id in step.preempted:
            self.engine.preempt(req_id)
        for new in step.new:
            if new.num_computed_tokens:
                raise SlotError(f"request {new.req_id} arrives with cached tokens, but prefix caching must be off.")
            images = [ImageInput(real_tiles(i.pixels, i.pixel_mask), i.positions) for i in new.images]
            self.engine.admit(new.req_id, new.prompt_token_ids, to_sampling_params(new.sampling_params), images)
        for cached in step.cached:
            self._sync(cached)
        result = self.engine.step(step.num_scheduled_tokens, self.host.for_step(grammar_output))
        self._record(result)
        scheduled = list(step.num_scheduled_tokens)
        sampled = {r: [result.tokens[r]] if r in result.tokens else [] for r in scheduled}
        return StepOutput(scheduled, sampled, result.logprobs, result.prompt_logprobs)  # type: ignore[arg-type]

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

"""The model runner: one scheduler step (plain `Step` data) -> one `Engine.step` -> what it sampled.

A thin adapter: finished requests are released, preempted ones preempted, new ones admitted (in the blocks vLLM's KV
cache manager placed them in, with its prefix-cache hit already computed), resumed ones resumed, running ones given
the blocks vLLM added, and the scheduled token counts go to the engine as they are (the tokens vLLM's scheduler
proposes after a decoding request, speculative decoding, as that request's drafts: `drafting`), with vLLM's own
sampler (`host_sampling.HostSampling`, bound to the step's grammar bitmask) for the requests that need it. The
engine keeps every request's tokens, cache progress, sampler and prompt logprobs; the runner only checks
that vLLM's count of computed tokens agrees with the engine's, and keeps a log of what each step ran.

A request the runner cannot run (refused at admission, a count that disagrees, an error of the step that it alone
causes) is released and reported in `StepOutput.failed`; the step runs for the others (`scheduler.NeuronxScheduler`
then finishes that request with an error). A step whose every request fails on its own raises: the engine is broken,
not a request, and vLLM stops (a supervisor restarts it, docs/vllm.md).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..runtime.engine import Engine
from ..runtime.logprobs import Logprobs
from ..runtime.sequence import StepResult
from . import compat
from .compat import CachedRequest, NewRequest, Step
from .host_sampling import HostSampling
from .lora import VllmAdapters
from .sampling import to_images, to_sampling_params

logger = compat.logger(__name__)


@dataclass
class StepRecord:
    """What one step ran, for logs and tests: decoded request ids, ``(req_id, start, count)`` prefills, the
    ``(req_id, image index)`` of every image encoded, whether the decodes ran in the mixed graph beside a chunk, and
    when the step's engine work began (``time.perf_counter()`` of the worker's process) and how long it took."""

    index: int
    decodes: list[str] = field(default_factory=list)
    prefills: list[tuple[str, int, int]] = field(default_factory=list)
    encoded: list[tuple[str, int]] = field(default_factory=list)
    mixed: bool = False
    started: float = 0.0
    seconds: float = 0.0


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
    failed: dict[str, str] = field(default_factory=dict)
    """Requests the step could not run, with why: each was released (its KV slot is free) and sampled nothing."""
    accepted: dict[str, int] = field(default_factory=dict)
    """The proposed tokens each request whose proposal was verified kept."""
    decodes: int = 0
    """Requests the step decoded (a proposal's verification counts as one)."""
    width: float = 1
    """Columns per decoding request of the decode call (`StepResult.width`)."""
    prefilled: bool = False
    """Whether the step also fed prompt tokens."""


class Runner:
    """Drives an `Engine` from scheduler steps."""

    def __init__(self, engine: Engine, keep_records: int = 10_000, cpu_loras: int = 0) -> None:
        """``cpu_loras``: the read adapters kept in host memory (vLLM's ``--max-cpu-loras``)."""
        self.engine = engine
        self.host = HostSampling(engine.config.batch_size, engine.hf_config.vocab_size)
        self.adapters = VllmAdapters(engine, cpu_loras) if engine.config.max_loras else None
        """vLLM's LoRA adapters on the engine's adapter slots (``--enable-lora``, `vllm.lora`)."""
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self._steps = 0

    def execute(self, step: Step, grammar_output: Any = None) -> StepOutput:
        """Run ``step`` (with the step's grammar bitmask, ``GrammarOutput``, for structured-output requests)."""
        for req_id in step.finished:
            self.engine.release(req_id)
        for req_id in step.preempted:
            self.engine.preempt(req_id)
        failed: dict[str, str] = {}
        for new in step.new:
            self._guarded(failed, new.req_id, self._admit, new)
        for cached in step.cached:
            self._guarded(failed, cached.req_id, self._sync, cached)
        work = {r: n for r, n in step.num_scheduled_tokens.items() if r not in failed}
        for req_id, rows in step.spec_rows.items():  # vLLM counts speculative positions among the scheduled tokens
            if req_id in work:
                work[req_id] -= rows
        drafts = {r: tokens for r, tokens in step.spec_tokens.items() if r in work}
        started = time.perf_counter()
        result = self._step(work, grammar_output, failed, drafts)
        self._record(result, started)
        scheduled = list(step.num_scheduled_tokens)
        sampled = {r: self._new_tokens(result, r) for r in scheduled}
        accepted = {str(r): n for r, n in result.accepted.items()}
        return StepOutput(
            scheduled,
            sampled,
            result.logprobs,  # type: ignore[arg-type]
            result.prompt_logprobs,  # type: ignore[arg-type]
            failed,
            accepted,
            len(result.decodes),
            result.width,
            bool(result.prefills),
        )

    def _new_tokens(self, result: StepResult, req_id: str) -> list[int]:
        """The tokens ``req_id`` gained this step: the proposed ones the verification kept, then its own one."""
        if req_id not in result.tokens:
            return []
        kept = result.accepted.get(req_id, 0)
        return self.engine.sequence(req_id).tokens[-kept - 1 :] if kept else [result.tokens[req_id]]

    def _admit(self, new: NewRequest) -> None:
        """Admit a new request in the blocks vLLM placed it in, its prefix-cache hit already computed."""
        params, images = to_sampling_params(new.sampling_params), to_images(new.images)
        blocks, computed = new.block_ids, new.num_computed_tokens
        adapter = None
        if new.lora is not None:
            if self.adapters is None:
                raise InputError("a LoRA request on an artifact without adapter slots: re-export with --max_loras.")
            adapter = self.adapters.slot_name(new.lora)
        self.engine.admit(
            new.req_id, new.prompt_token_ids, params, images, blocks=blocks, computed=computed, adapter=adapter
        )

    def _step(
        self, work: dict[str, int], grammar_output: Any, failed: dict[str, str], drafts: dict[str, list[int]]
    ) -> StepResult:
        """`Engine.step` on ``work`` (``drafts``: the tokens proposed after decoding requests). When it raises, each
        request is run alone (a failed step leaves every sequence as it was): the ones that fail alone are released
        into ``failed``; if every one of several fails, the step error is raised again."""
        sampler = self.host.for_step(grammar_output)
        try:
            return self.engine.step(work, sampler, drafts)
        except Exception as err:
            if len(work) > 1:
                logger.warning("a step of %d requests failed (%s); running each alone", len(work), err)
            alone, errors = StepResult(), {}
            for req_id, count in work.items():
                try:
                    own = {req_id: drafts[req_id]} if req_id in drafts else None
                    _merge(alone, self.engine.step({req_id: count}, sampler, own))
                except Exception as alone_err:
                    errors[req_id] = alone_err
            if len(work) > 1 and len(errors) == len(work):
                raise err
            for req_id, error in errors.items():
                self._fail(failed, req_id, error)
            return alone

    def _guarded(self, failed: dict[str, str], req_id: str, run: Callable[[Any], None], request: Any) -> None:
        """``run(request)``; an error fails that request only."""
        try:
            run(request)
        except Exception as err:
            self._fail(failed, req_id, err)

    def _fail(self, failed: dict[str, str], req_id: str, err: Exception) -> None:
        """Release ``req_id`` (its slot is free again) and report it failed, with why."""
        self.engine.release(req_id)
        failed[req_id] = f"{type(err).__name__}: {err}"
        logger.error("request %s cannot run and is finished with an error: %s", req_id, failed[req_id])

    def _sync(self, cached: CachedRequest) -> None:
        """Resume a preempted request in its new blocks, or give a running one the blocks vLLM added; check vLLM's
        computed-token count against the engine's."""
        if cached.resumed:
            blocks, computed = cached.new_block_ids or [], cached.num_computed_tokens
            self.engine.resume(cached.req_id, cached.all_token_ids, blocks=blocks, computed=computed)
        elif cached.new_block_ids:
            self.engine.add_blocks(cached.req_id, cached.new_block_ids)
        computed = self.engine.sequence(cached.req_id).computed
        if computed != cached.num_computed_tokens:
            raise InputError(
                f"request {cached.req_id}: vLLM counts {cached.num_computed_tokens} computed tokens, the engine "
                f"{computed}; the scheduler and the runner disagree."
            )

    def _record(self, result: StepResult, started: float) -> None:
        """Log what ``result`` ran (`records`), its engine work having begun at ``started``."""
        if result.decodes or result.prefills:
            decodes = [str(r) for r in result.decodes]
            prefills = [(str(r), start, count) for r, start, count in result.prefills]
            encoded = [(str(r), index) for r, index in result.encoded]
            seconds = time.perf_counter() - started
            self.records.append(StepRecord(self._steps, decodes, prefills, encoded, result.mixed, started, seconds))
        self._steps += 1


def _merge(into: StepResult, part: StepResult) -> None:
    """Add what ``part`` (one request's step) ran and produced to ``into``."""
    for name in ("tokens", "logits", "logprobs", "prompt_logprobs", "token_logits", "accepted"):
        getattr(into, name).update(getattr(part, name))
    for name in ("decodes", "prefills", "encoded"):
        getattr(into, name).extend(getattr(part, name))
    into.width = max(into.width, part.width)
    into.mixed = into.mixed or part.mixed

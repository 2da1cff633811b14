"""The model runner: one scheduler step (plain `Step` data) -> engine calls -> sampled tokens.

It keeps, per request, its KV slot, its token ids (the scheduler does not send back the tokens we
sampled) and its seeded sampler. Each step it frees the slots of finished / preempted requests,
admits new ones, runs the token-generation graph once for every decoding request, then the prefill
graph for each scheduled prompt range (`Engine.prefill` splits a range into chunks and pads the
last one). It has no padding or chunking rule of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SlotError
from ..runtime.engine import Engine
from ..runtime.sampling import SequenceSampler, sample_on_host
from .compat import CachedRequest, NewRequest, Step
from .sampling import to_sampling_params


@dataclass
class RequestState:
    """What the runner remembers about one request."""

    slot: int | None
    prompt_len: int
    tokens: list[int]
    """Prompt then every token sampled so far."""
    sampler: SequenceSampler
    computed: int = 0
    """Tokens whose K/V are in the cache."""


@dataclass(frozen=True)
class Work:
    """One request's share of a step: ``count`` tokens from cache position ``start``."""

    req_id: str
    start: int
    count: int
    decode: bool


@dataclass
class StepRecord:
    """What one step ran, for logs and tests: decode slots and prefill ranges, in order."""

    index: int
    decodes: list[str] = field(default_factory=list)
    prefills: list[tuple[str, int, int]] = field(default_factory=list)


class Runner:
    """Drives an `Engine` from scheduler steps."""

    def __init__(self, engine: Engine, keep_records: int = 10_000) -> None:
        self.engine = engine
        self.requests: dict[str, RequestState] = {}
        self.records: list[StepRecord] = []
        self._keep = keep_records
        self._steps = 0

    def execute(self, step: Step) -> tuple[list[str], dict[str, list[int]]]:
        """Run ``step``; returns the scheduled request ids and, per id, the tokens sampled
        (``[]`` for a prefill that has not reached the end of its prompt)."""
        for req_id in step.finished:
            self._forget(req_id)
        for req_id in step.preempted:
            self._release(req_id)
        for new in step.new:
            self._admit(new)
        for cached in step.cached:
            self._refresh(cached)
        work = [self._work(req_id, count) for req_id, count in step.num_scheduled_tokens.items()]
        record = StepRecord(self._steps)
        sampled = self._decode([w for w in work if w.decode], record)
        for w in work:
            if not w.decode:
                sampled[w.req_id] = self._prefill(w, record)
        self._record(record)
        return list(step.num_scheduled_tokens), sampled

    # --- request lifetime -------------------------------------------------------------------

    def _admit(self, new: NewRequest) -> None:
        if new.num_computed_tokens:
            raise SlotError(f"request {new.req_id} arrives with cached tokens, but prefix caching must be off.")
        params = to_sampling_params(new.sampling_params, self.engine.config.max_topk)
        state = RequestState(None, len(new.prompt_token_ids), list(new.prompt_token_ids), SequenceSampler(params))
        self.requests[new.req_id] = state
        self._bind_slot(new.req_id, state)

    def _refresh(self, cached: CachedRequest) -> None:
        state = self.requests[cached.req_id]
        if cached.resumed:
            if cached.all_token_ids is not None:
                state.tokens = list(cached.all_token_ids)
            self._bind_slot(cached.req_id, state)
        state.computed = cached.num_computed_tokens

    def _bind_slot(self, req_id: str, state: RequestState) -> None:
        state.slot = self.engine.slots.acquire(req_id)
        self.engine.reset_slot(state.slot)
        state.computed = 0

    def _release(self, req_id: str) -> None:
        state = self.requests.get(req_id)
        if state is not None and state.slot is not None:
            self.engine.slots.release(state.slot)
            state.slot = None

    def _forget(self, req_id: str) -> None:
        self._release(req_id)
        self.requests.pop(req_id, None)

    # --- one step ---------------------------------------------------------------------------

    def _work(self, req_id: str, count: int) -> Work:
        state = self.requests[req_id]
        start = state.computed
        decode = count == 1 and start >= state.prompt_len and start == len(state.tokens) - 1
        return Work(req_id, start, count, decode)

    def _decode(self, work: list[Work], record: StepRecord) -> dict[str, list[int]]:
        if not work:
            return {}
        states = {w.req_id: self.requests[w.req_id] for w in work}
        active = {self._slot(s): (s.tokens[w.start], w.start) for w, s in zip(work, states.values(), strict=True)}
        out = self.engine.decode(active, {self._slot(s): s.sampler for s in states.values()})
        sampled = {}
        for req_id, state in states.items():
            token = out[self._slot(state)]
            state.tokens.append(token)
            sampled[req_id] = [token]
            record.decodes.append(req_id)
        return sampled

    def _prefill(self, w: Work, record: StepRecord) -> list[int]:
        state = self.requests[w.req_id]
        chunk = state.tokens[w.start : w.start + w.count]
        logits = self.engine.prefill(chunk, self._slot(state), start=w.start)
        record.prefills.append((w.req_id, w.start, w.count))
        if w.start + w.count < len(state.tokens):
            return []
        token = int(sample_on_host(logits[None], [state.sampler], self.engine.config.max_topk)[0])
        state.tokens.append(token)
        return [token]

    def _slot(self, state: RequestState) -> int:
        assert state.slot is not None, "a scheduled request always holds a slot"
        return state.slot

    def _record(self, record: StepRecord) -> None:
        self._steps += 1
        if record.decodes or record.prefills:
            self.records.append(record)
            del self.records[: -self._keep]

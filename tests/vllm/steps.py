"""Hand-built scheduler steps for the vLLM runner tests (no vLLM engine): the plain `compat.Step` data the worker
reads from vLLM's ``SchedulerOutput``, and a `Driver` that feeds them like vLLM's scheduler."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm import SamplingParams as VllmParams

from optimum.neuron.vllm.compat import CachedRequest, NewRequest, Step
from optimum.neuron.vllm.runner import Runner, StepOutput

CHUNK = 8
GREEDY = VllmParams(temperature=0.0, max_tokens=32)


def step(
    scheduled: dict[str, int],
    new: list[NewRequest] | None = None,
    cached: list[CachedRequest] | None = None,
    finished: set[str] | None = None,
    preempted: set[str] | None = None,
) -> Step:
    return Step(new or [], cached or [], scheduled, finished or set(), preempted or set())


def new_request(
    req_id: str, ids: list[int], params: VllmParams = GREEDY, blocks: list[int] | None = None
) -> NewRequest:
    """A new request; a `Driver` gives it its blocks when ``blocks`` is None."""
    return NewRequest(req_id, ids, params, 0, blocks or [])


def cached(req_id: str, computed: int, new_blocks: list[int] | None = None) -> CachedRequest:
    return CachedRequest(req_id, computed, False, None, new_blocks)


class Driver:
    """Feeds steps like vLLM's scheduler: it tracks computed tokens per request, places each request's KV blocks as
    vLLM's KV cache manager does (blocks for its computed and scheduled tokens, added as it grows, freed when it
    finishes or is preempted) and collects outputs."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.computed: dict[str, int] = {}
        self.out: dict[str, list[int]] = {}
        self.last: StepOutput | None = None
        self.grammar: Any = None
        """The ``GrammarOutput`` passed with every step (structured output)."""
        engine = runner.engine
        self.block_size = engine.block_size
        self.free = list(range(engine.config.kv_blocks - 1, 0, -1))  # block 0 is the scratch (vLLM's null) block
        self.blocks: dict[str, list[int]] = {}

    def grow(self, req_id: str, tokens: int) -> list[int]:
        """The blocks ``req_id`` needs beyond its own to hold ``tokens`` tokens, now its own."""
        held = self.blocks.setdefault(req_id, [])
        new = [self.free.pop() for _ in range(-(-tokens // self.block_size) - len(held))]
        held.extend(new)
        return new

    def drop(self, req_id: str) -> None:
        """Free ``req_id``'s blocks (finished, aborted or preempted)."""
        self.free.extend(reversed(self.blocks.pop(req_id, [])))
        self.computed.pop(req_id, None)

    def run(self, scheduled: dict[str, int], new: list[NewRequest] = (), **kw: set[str]) -> dict[str, list[int]]:  # type: ignore[assignment]
        """One step; returns the tokens sampled per scheduled request (the whole output is in `last`)."""
        for r in list(kw.get("finished", ())) + list(kw.get("preempted", ())):
            self.drop(r)
        placed = [
            dataclasses.replace(n, block_ids=self.grow(n.req_id, n.num_computed_tokens + scheduled[n.req_id]))
            for n in new
        ]
        known = [
            cached(r, self.computed[r], self.grow(r, self.computed[r] + scheduled[r]) or None)
            for r in scheduled
            if r in self.computed
        ]
        out = self.runner.execute(step(scheduled, placed, known, **kw), self.grammar)
        assert out.req_ids == list(scheduled)
        self.last, sampled = out, out.sampled
        for r, count in scheduled.items():
            if r in out.failed:
                self.drop(r)
                continue
            self.computed[r] = self.computed.get(r, 0) + count
            self.out.setdefault(r, []).extend(sampled[r])
        return sampled

    def resume(self, req_id: str, tokens: list[int]) -> list[int]:
        """A step resuming preempted ``req_id`` with every token so far, recomputed from position 0 in new blocks;
        returns the tokens it sampled."""
        resumed = CachedRequest(req_id, 0, True, tokens, self.grow(req_id, len(tokens)))
        sampled = self.runner.execute(step({req_id: len(tokens)}, cached=[resumed])).sampled[req_id]
        self.computed[req_id] = len(tokens)
        self.out.setdefault(req_id, []).extend(sampled)
        return sampled

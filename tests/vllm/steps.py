"""Hand-built scheduler steps for the vLLM runner tests (no vLLM engine): the plain `compat.Step` data the worker
reads from vLLM's ``SchedulerOutput``, and a `Driver` that feeds them like vLLM's scheduler."""

from __future__ import annotations

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


def new_request(req_id: str, ids: list[int], params: VllmParams = GREEDY) -> NewRequest:
    return NewRequest(req_id, ids, params, 0)


def cached(req_id: str, computed: int) -> CachedRequest:
    return CachedRequest(req_id, computed, False, None)


class Driver:
    """Feeds steps like vLLM's scheduler: it tracks computed tokens per request and collects outputs."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.computed: dict[str, int] = {}
        self.out: dict[str, list[int]] = {}
        self.last: StepOutput | None = None
        self.grammar: Any = None
        """The ``GrammarOutput`` passed with every step (structured output)."""

    def run(self, scheduled: dict[str, int], new: list[NewRequest] = (), **kw: set[str]) -> dict[str, list[int]]:  # type: ignore[assignment]
        """One step; returns the tokens sampled per scheduled request (the whole output is in `last`)."""
        known = [cached(r, self.computed[r]) for r in scheduled if r in self.computed]
        out = self.runner.execute(step(scheduled, list(new), known, **kw), self.grammar)
        assert out.req_ids == list(scheduled)
        self.last, sampled = out, out.sampled
        for r in list(kw.get("finished", ())) + list(kw.get("preempted", ())):
            self.computed.pop(r, None)
        for r, count in scheduled.items():
            self.computed[r] = self.computed.get(r, 0) + count
            self.out.setdefault(r, []).extend(sampled[r])
        return sampled

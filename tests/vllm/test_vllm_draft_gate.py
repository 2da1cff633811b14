"""`vllm.drafting.DraftGate`: which of vLLM's n-gram proposals the worker hands to vLLM, from the steps it timed (no
model: the steps, their tokens and times are made up; the proposals are vLLM's own ``DraftTokenIds``)."""

from __future__ import annotations

import pytest

from optimum.neuron.vllm import compat
from optimum.neuron.vllm.compat import Step
from optimum.neuron.vllm.drafting import DraftGate
from optimum.neuron.vllm.runner import StepOutput

pytestmark = pytest.mark.vllm
IDS = [f"r{i}" for i in range(8)]


def step(spec: dict[str, list[int]] | None = None, finished: tuple[str, ...] = ()) -> Step:
    """A decode step of every request of `IDS` (``spec``: the proposals it verifies)."""
    spec = spec or {}
    scheduled = {r: 1 + len(spec.get(r, [])) for r in IDS}
    return Step(
        [], [], scheduled, set(finished), set(), spec_tokens=spec, spec_rows={r: len(t) for r, t in spec.items()}
    )


def output(sampled: list[int], accepted: int | None = None, prefilled: bool = False, width: int = 1) -> StepOutput:
    """Every request of `IDS` sampled ``sampled``; ``accepted``: the proposed tokens each kept, when verified in a call
    of ``width`` columns."""
    kept = {} if accepted is None else dict.fromkeys(IDS, accepted)
    return StepOutput(list(IDS), dict.fromkeys(IDS, sampled), {}, {}, {}, kept, len(IDS), width, prefilled)


def proposals(tokens: list[int]) -> object:
    return compat.draft_token_ids(list(IDS), [list(tokens) for _ in IDS])


def test_proposals_pass_once_they_pay_and_are_withheld_once_they_do_not() -> None:
    gate = DraftGate()
    gate.observe(step(), output([5]), 0.020)  # a token-generation step of 8 rows: 20 ms
    held = gate.admit(proposals([7, 8]))
    assert held.req_ids == IDS and held.draft_token_ids == [[]] * 8, "no verification measured: not paying yet"
    gate.observe(step(), output([7]), 0.020)  # each sampled the token it had proposed first
    assert set(gate.policy.pending) == set(IDS), "1 of 2 proposed tokens generated: the count is not settled"
    assert gate.admit(proposals([7, 8])).draft_token_ids == [[]] * 8
    gate.observe(step(), output([8]), 0.020)  # then the second
    given = gate.admit(proposals([7, 8]))
    assert given.draft_token_ids == [[7, 8]] * 8, "the withheld proposals would have kept both tokens: verified"
    gate.observe(
        step({r: [7, 8] for r in IDS}), output([7, 8, 9], accepted=2, width=3), 0.024
    )  # 1.2x a step, 2 kept each
    assert gate.policy.seconds[(8, 3)] == 0.024, "a decode-only verification is timed at its width"
    assert gate.admit(proposals([9, 9])).draft_token_ids == [[9, 9]] * 8
    for _ in range(3):  # verifications that cost 3x a step and keep nothing
        gate.observe(step({r: [9, 9] for r in IDS}), output([4], accepted=0, width=3), 0.060)
    assert gate.admit(proposals([4, 4])).draft_token_ids == [[]] * 8, "8 x 2 extra steps' time for ~0.7 tokens"
    assert gate.withheld == {r: [4, 4] for r in IDS}


def test_a_step_that_prefills_is_not_timed_and_finished_requests_are_forgotten() -> None:
    gate = DraftGate()
    gate.observe(step(), output([5], prefilled=True), 5.0)
    assert gate.policy.seconds == {}, "a prefill chunk's time says nothing of a decode step's"
    gate.observe(step({r: [1] for r in IDS}), output([1, 2], accepted=1, prefilled=True, width=2), 5.0)
    assert gate.policy.seconds == {} and gate.policy.kept["r0"] > 0.5, "its verification's kept tokens still count"
    gate.observe(step(finished=("r0",)), output([3]), 0.02)
    assert "r0" not in gate.policy.kept and "r1" in gate.policy.kept


def test_with_packed_columns_only_the_proposals_worth_their_columns_pass() -> None:
    """Packed verification columns: each proposal costs its own columns, so the requests whose proposals have kept
    their tokens are verified and the others withheld (the rows layout verifies all or none)."""
    seconds = {(8, 1): 0.020, (8, 1.5): 0.022, (8, 3.0): 0.040}
    kept = {"r0": 2.0, "r1": 2.0, **{r: 0.0 for r in IDS[2:]}}
    packed, rows = DraftGate(packed=True), DraftGate()
    for gate in (packed, rows):
        gate.policy.seconds, gate.policy.kept = dict(seconds), dict(kept)
    given = packed.admit(proposals([7, 8]))
    assert given.draft_token_ids == [[7, 8], [7, 8]] + [[]] * 6, "r0 and r1: 4 tokens for 0.1 of a step x 8 rows"
    assert packed.withheld == {r: [7, 8] for r in IDS[2:]}
    assert rows.admit(proposals([7, 8])).draft_token_ids == [[]] * 8, "all 8 rows at 2x a step for 4 tokens: none"

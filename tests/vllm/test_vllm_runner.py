"""The vLLM model runner driven by hand-built scheduler steps (no vLLM engine), on the eager fixture.

A step is the plain `compat.Step` data the worker reads from vLLM's ``SchedulerOutput``. These tests
pin what the runner owes vLLM: a request's prompt can arrive in any split of chunks (several CP calls
in one step when it exceeds C), partial prefills return no token, decodes of running requests run in
the same step as another request's chunk, every way a request leaves (finished, aborted,
preempted) gives its slot and blocks back, and a request the runner cannot run fails alone, its slot freed.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams as VllmParams

from optimum.neuron.errors import InputError
from optimum.neuron.vllm.runner import Runner
from tests.contract.engine_tools import alone, engine_for, prompt
from tests.vllm.steps import CHUNK, Driver, cached, new_request, step

pytestmark = [pytest.mark.vllm]


@pytest.fixture
def runner() -> Runner:
    return Runner(engine_for("eager", caller_blocks=True))


def expected(runner: Runner, ids: list[int], new: int) -> list[int]:
    """Greedy tokens of ``generate()`` on another engine of the same artifact (the runner's places no blocks)."""
    return alone(engine_for(runner.engine.config.backend), ids, new)


def test_prompt_in_uneven_chunks_then_decode(runner: Runner) -> None:
    ids = prompt(2 * CHUNK + 5, 0)
    want = expected(runner, ids, 4)
    d = Driver(runner)
    assert d.run({"a": 5}, [new_request("a", ids)]) == {"a": []}, "a partial prefill returns no token"
    assert d.run({"a": 9}) == {"a": []}
    assert d.run({"a": len(ids) - 14}) == {"a": want[:1]}
    for _ in range(3):
        d.run({"a": 1})
    assert d.out["a"] == want


def test_whole_long_prompt_in_one_step_runs_several_chunks(runner: Runner) -> None:
    ids = prompt(3 * CHUNK + 1, 1)
    want = expected(runner, ids, 3)
    d = Driver(runner)
    d.run({"a": len(ids)}, [new_request("a", ids)])
    d.run({"a": 1})
    d.run({"a": 1})
    assert d.out["a"] == want
    assert runner.records[0].prefills == [("a", 0, len(ids))]
    assert runner.records[1].decodes == ["a"]
    prefill, decode = runner.records[0], runner.records[1]  # each step's engine work, timed one after the other
    assert prefill.seconds > 0 and prefill.started + prefill.seconds <= decode.started and decode.seconds > 0


def test_decodes_run_in_the_same_step_as_another_prompt_chunk(runner: Runner) -> None:
    short, long = prompt(3, 2), prompt(3 * CHUNK + 2, 3)
    want_short, want_long = expected(runner, short, 7), expected(runner, long, 3)
    d = Driver(runner)
    d.run({"s": 3}, [new_request("s", short)])
    d.run({"s": 1, "l": CHUNK - 1}, [new_request("l", long)])
    while d.computed["l"] < len(long):
        d.run({"s": 1, "l": min(CHUNK - 1, len(long) - d.computed["l"])})
    d.run({"s": 1, "l": 1})
    d.run({"s": 1, "l": 1})
    assert d.out["s"] == want_short and d.out["l"] == want_long
    interleaved = [r for r in runner.records if r.prefills and r.decodes]
    assert len(interleaved) >= 3 and all(r.decodes == ["s"] for r in interleaved)


def test_finished_and_aborted_requests_give_their_slot_back(runner: Runner) -> None:
    d = Driver(runner)
    d.run({"a": 4, "b": 4}, [new_request("a", prompt(4, 4)), new_request("b", prompt(4, 5))])
    assert runner.engine.slots.free_count == 0
    d.run({"b": 1}, finished={"a"})  # vLLM reports finished and aborted requests alike
    assert set(runner.engine.slots.used.values()) == {"b"}
    d.run({"c": 2}, [new_request("c", prompt(2, 6))], finished={"b"})
    assert set(runner.engine.slots.used.values()) == {"c"}
    d.run({}, finished={"c"})
    assert runner.engine.slots.free_count == 2
    for gone in ("a", "b", "c"):
        with pytest.raises(InputError, match="no sequence"):
            runner.engine.sequence(gone)


def test_preempted_request_resumes_with_the_same_tokens(runner: Runner) -> None:
    ids = prompt(CHUNK + 3, 7)
    want = expected(runner, ids, 6)
    d = Driver(runner)
    d.run({"a": len(ids)}, [new_request("a", ids)])
    d.run({"a": 1})
    d.run({"a": 1})
    d.run({}, preempted={"a"})
    assert runner.engine.slots.free_count == 2, "a preempted request keeps no slot"
    assert runner.engine.held_blocks() == {"a": []}, "a preempted request keeps no block"
    d.resume("a", ids + d.out["a"])  # vLLM resumes it with every token so far, recomputed from position 0
    for _ in range(2):
        d.run({"a": 1})
    assert d.out["a"] == want


def test_more_requests_than_slots_fails_that_request_only(runner: Runner) -> None:
    d = Driver(runner)
    d.run({"a": 2, "b": 2}, [new_request("a", [5, 6]), new_request("b", [7, 8])])
    out = runner.execute(step({"c": 2, "a": 1}, [new_request("c", [9, 10], blocks=d.grow("c", 2))], [cached("a", 2)]))
    assert "SlotError" in out.failed["c"] and "--batch_size" in out.failed["c"], out.failed
    assert out.sampled["c"] == [] and len(out.sampled["a"]) == 1, "the other request of the step ran"
    assert set(runner.engine.slots.used.values()) == {"a", "b"}


def test_unsupported_sampling_parameter_fails_that_request_only(runner: Runner) -> None:
    params = VllmParams(temperature=0.7, logprob_token_ids=[3, 4])
    out = runner.execute(
        step({"a": 2, "b": 2}, [new_request("a", [5, 6], params, blocks=[1]), new_request("b", [7, 8], blocks=[2])])
    )
    assert set(out.failed) == {"a"} and "logprob_token_ids" in out.failed["a"], out.failed
    assert out.sampled == {"a": [], "b": out.sampled["b"]} and len(out.sampled["b"]) == 1
    assert set(runner.engine.slots.used.values()) == {"b"}, "the refused request holds no slot"


def test_seeded_sampling_reproduces(runner: Runner) -> None:
    ids = prompt(CHUNK + 1, 8)
    params = VllmParams(temperature=1.3, top_k=40, top_p=0.9, seed=5, max_tokens=8)
    runs = []
    for name in ("x", "y"):
        d = Driver(runner)
        d.run({name: len(ids)}, [new_request(name, ids, params)])
        for _ in range(5):
            d.run({name: 1})
        d.run({}, finished={name})
        runs.append(d.out[name])
    assert runs[0] == runs[1] and len(runs[0]) == 6


def test_a_count_that_disagrees_with_the_engine_fails_that_request_and_frees_its_slot(runner: Runner) -> None:
    d = Driver(runner)
    d.run({"a": 3}, [new_request("a", prompt(5, 9))])
    out = runner.execute(step({"a": 2}, cached=[cached("a", 2)]))
    assert "vLLM counts 2 computed tokens, the engine 3" in out.failed["a"], out.failed
    assert runner.engine.slots.free_count == 2


def test_a_step_refused_for_one_request_runs_the_others(runner: Runner) -> None:
    """`Engine.step` refuses work a sequence cannot take (here more tokens than it has pending): the runner runs
    each request alone, fails the one the engine refuses and returns the others' tokens unchanged."""
    short, other = prompt(3, 10), prompt(4, 11)
    want = expected(runner, short, 3)
    d = Driver(runner)
    d.run({"s": 3, "o": 4}, [new_request("s", short), new_request("o", other)])
    out = runner.execute(step({"s": 1, "o": 2}, cached=[cached("s", 3), cached("o", 4)]))
    assert set(out.failed) == {"o"} and "pending tokens" in out.failed["o"], out.failed
    assert out.sampled == {"s": [want[1]], "o": []}
    assert set(runner.engine.slots.used.values()) == {"s"}
    d.computed = {"s": 4}
    d.run({"s": 1})
    assert d.out["s"] == [want[0], want[2]], "the request beside the failed one decodes on"


def test_a_step_every_request_of_which_fails_raises(runner: Runner) -> None:
    d = Driver(runner)
    d.run({"a": 3, "b": 3}, [new_request("a", prompt(3, 12)), new_request("b", prompt(3, 13))])
    with pytest.raises(InputError, match="pending tokens"):
        runner.execute(step({"a": 2, "b": 2}, cached=[cached("a", 3), cached("b", 3)]))

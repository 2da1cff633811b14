"""vLLM 0.32's scheduler and model-runner output, extended by one thing: a request the model runner could not run is
finished with an error, and the engine keeps serving the others.

vLLM treats an exception raised by a worker's ``execute_model`` as fatal to the engine core (every request dies,
``vllm serve`` exits), and its ``ModelRunnerOutput`` has no per-request error. So the worker returns
`FailedRequestsOutput` (a ``ModelRunnerOutput`` naming the requests it released, with why), and `NeuronxScheduler`
(set as ``scheduler_cls`` by the platform; `NeuronxAsyncScheduler` under async scheduling) finishes
them with ``RequestStatus.FINISHED_ERROR``: vLLM's front end answers that request with its internal-error response
(HTTP 500, or an error event in a stream), as it does for its own per-request errors (a grammar that rejects a token,
a failed KV load). Imported only in the engine core and the workers, after vLLM is loaded; with `compat` and
`host_sampling`, the only modules that touch vLLM internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from . import compat

logger = compat.logger(__name__)


@dataclass
class FailedRequestsOutput(ModelRunnerOutput):
    """A ``ModelRunnerOutput`` that also names the requests of the step the runner could not run."""

    failed: dict[str, str] = field(default_factory=dict)
    """Request id -> why: each was released by the runner (its KV slot is free) and returned no token."""


class NeuronxScheduler(Scheduler):
    """vLLM's ``Scheduler``; the requests a step's output names as failed are finished with an error."""

    # Under async scheduling a failed request may already sit in the next step, scheduled before this output was
    # read: the runner finds it unknown there and reports it failed again; ``finish_requests`` skips it (finished).

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        """vLLM's update, after finishing the failed requests (``FINISHED_ERROR``: their KV blocks are freed and the
        front end answers each with an error)."""
        failed = getattr(model_runner_output, "failed", None) or {}
        errored = self.finish_requests(set(failed), RequestStatus.FINISHED_ERROR) if failed else []
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in errored:
            logger.error("request %s failed in the model runner: %s", request.request_id, failed[request.request_id])
            eco = outputs.setdefault(request.client_index, EngineCoreOutputs())
            finished = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR)
            eco.outputs = [*eco.outputs, finished]
            eco.finished_requests = {*(eco.finished_requests or ()), request.request_id}
        return outputs


class NeuronxAsyncScheduler(NeuronxScheduler, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (step N+1 is scheduled while step N runs), finishing failed requests likewise."""


def runner_output(base: Any, failed: dict[str, str]) -> Any:
    """``base`` (a ``ModelRunnerOutput``) as a `FailedRequestsOutput` naming ``failed`` (``base`` when none)."""
    if not failed:
        return base
    fields = {name: getattr(base, name) for name in ModelRunnerOutput.__dataclass_fields__}
    return FailedRequestsOutput(**fields, failed=dict(failed))

"""Everything that touches vLLM 0.32 internals, in one place.

The rest of the plugin works on plain Python data (`Step`, `NewRequest`, `CachedRequest`, token lists) so a vLLM
upgrade only ever changes this module. Each function names the vLLM structure it reads or builds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

VLLM_VERSION = "0.32.0"
KV_LAYER_NAME = "optimum_neuron.kv"
"""The single layer name of the placeholder KV spec: our cache lives in the engine, not in vLLM."""


@dataclass(frozen=True)
class NewRequest:
    """A request the scheduler sends for the first time (``NewRequestData``)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    num_computed_tokens: int


@dataclass(frozen=True)
class CachedRequest:
    """A request already known to the runner (one row of ``CachedRequestData``)."""

    req_id: str
    num_computed_tokens: int
    resumed: bool
    """True when the request comes back after a preemption (its cache must be rebuilt)."""
    all_token_ids: list[int] | None


@dataclass(frozen=True)
class Step:
    """One ``SchedulerOutput`` in plain data."""

    new: list[NewRequest]
    cached: list[CachedRequest]
    num_scheduled_tokens: dict[str, int]
    finished: set[str]
    preempted: set[str]


def read_step(scheduler_output: Any) -> Step:
    """`Step` from a vLLM ``SchedulerOutput``."""
    new = [
        NewRequest(r.req_id, list(r.prompt_token_ids or []), r.sampling_params, r.num_computed_tokens)
        for r in scheduler_output.scheduled_new_reqs
    ]
    c = scheduler_output.scheduled_cached_reqs
    cached = [
        CachedRequest(rid, c.num_computed_tokens[i], rid in c.resumed_req_ids, c.all_token_ids.get(rid))
        for i, rid in enumerate(c.req_ids)
    ]
    return Step(
        new=new,
        cached=cached,
        num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
        finished=set(scheduler_output.finished_req_ids),
        preempted=set(scheduler_output.preempted_req_ids or ()),
    )


def runner_output(req_ids: list[str], sampled: dict[str, list[int]]) -> Any:
    """A ``ModelRunnerOutput``: per scheduled request the sampled tokens (``[]`` for a partial prefill)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if not req_ids:
        return EMPTY_MODEL_RUNNER_OUTPUT
    return ModelRunnerOutput(
        req_ids=list(req_ids),
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(r, []) for r in req_ids],
    )


def placeholder_kv_spec(block_size: int) -> dict[str, Any]:
    """A one-layer KV spec whose blocks only count tokens: it makes vLLM chunk prompts and bounds
    admissions (DESIGN.md §5, "How we drive chunks"), while the real cache lives in our engine."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return {KV_LAYER_NAME: spec}


def placeholder_page_bytes(block_size: int) -> int:
    """Bytes of one block of `placeholder_kv_spec`."""
    return int(placeholder_kv_spec(block_size)[KV_LAYER_NAME].page_size_bytes)


def vllm_default_max_num_seqs() -> set[int]:
    """The values vLLM puts in ``max_num_seqs`` when the user gives none (``EngineArgs`` defaults of
    vLLM 0.32 for a CPU platform and the generic fallback): used to tell a default from a request."""
    from vllm.config.scheduler import SchedulerConfig

    return {256, 128, int(SchedulerConfig.DEFAULT_MAX_NUM_SEQS)}


def disable_graph_capture(vllm_config: Any) -> None:
    """No torch.compile and no CUDA graphs: our graphs are already compiled."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    vllm_config.compilation_config.mode = CompilationMode.NONE
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE


def platform_base() -> tuple[type, Any]:
    """``(Platform, PlatformEnum)`` of vLLM."""
    from vllm.platforms.interface import Platform, PlatformEnum

    return Platform, PlatformEnum


def worker_base() -> type:
    """vLLM's ``WorkerBase``."""
    from vllm.v1.worker.worker_base import WorkerBase

    return WorkerBase


def compilation_times() -> Any:
    """Zero ``CompilationTimes`` (nothing is compiled at serve time)."""
    from vllm.v1.worker.worker_base import CompilationTimes

    return CompilationTimes(0.0, 0.0)


def logger(name: str) -> logging.Logger:
    """A logger under vLLM's ``vllm`` logger, so its lines show with vLLM's own (same format, level)."""
    from vllm.logger import init_logger

    return init_logger(f"vllm.optimum_neuronx.{name.rsplit('.', 1)[-1]}")


def request_error(message: str) -> Exception:
    """vLLM's per-request validation error (``VLLMValidationError``): the offline engine raises it, the
    server turns it into an HTTP 400 whose body carries ``message``."""
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message)

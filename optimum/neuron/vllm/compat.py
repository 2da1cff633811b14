"""Everything that touches vLLM 0.32 internals, but its sampler (`host_sampling`), in one place.

The rest of the plugin works on plain Python data (`Step`, `NewRequest`, `CachedRequest`, token lists) so a vLLM
upgrade only ever changes this module and `host_sampling` (vLLM's own ``Sampler``, logits processors and grammar
bitmask for the requests that need them). Each function names the vLLM structure it reads or builds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import lru_cache
from types import FrameType
from typing import Any

import numpy as np
import torch

from ..errors import IncompatibleConfigError, InputError

VLLM_VERSION = "0.32.0"
KV_LAYER_NAME = "model.layers.{}.self_attn.attn"
"""The name vLLM knows each layer's KV cache by (`kv_cache_spec`): our cache lives in the engine, vLLM only places
its blocks."""


@dataclass(frozen=True)
class ImageItem:
    """One image of a request (a ``MultiModalFeatureSpec`` of modality ``image``), as vLLM's multimodal processor made
    it from the model's transformers processor."""

    pixels: torch.Tensor | None
    """Its tiles, ``[t, 3, S, S]``; None when vLLM dropped its data (``strip_covered_mm_data``: every position of it
    lies in the request's prefix-cache hit, so no encoder call can need it)."""
    pixel_mask: torch.Tensor | None
    """``[t, S, S]``: which pixels of each tile are the image's."""
    positions: tuple[int, ...]
    """The prompt positions its rows go to: the embedding positions of its ``PlaceholderRange`` (``is_embed``)."""


@dataclass(frozen=True)
class LoraAdapter:
    """The LoRA adapter a request runs on (vLLM's ``LoRARequest``): its id, name and PEFT folder."""

    lora_id: int
    name: str
    path: str


def read_lora(lora_request: Any) -> LoraAdapter | None:
    """A ``LoRARequest`` (or None) as plain data."""
    if lora_request is None:
        return None
    return LoraAdapter(int(lora_request.lora_int_id), str(lora_request.lora_name), str(lora_request.lora_path))


@dataclass(frozen=True)
class NewRequest:
    """A request the scheduler sends for the first time (``NewRequestData``)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    num_computed_tokens: int
    """Its prompt tokens already in its blocks (vLLM's prefix-cache hit)."""
    block_ids: list[int]
    """Its KV blocks, in position order (of the one KV cache group)."""
    images: tuple[ImageItem, ...] = ()
    lora: LoraAdapter | None = None
    """The LoRA adapter it runs on (``--enable-lora``); None: the base model."""


@dataclass(frozen=True)
class CachedRequest:
    """A request already known to the runner (one row of ``CachedRequestData``)."""

    req_id: str
    num_computed_tokens: int
    resumed: bool
    """True when the request comes back after a preemption (its cache must be rebuilt)."""
    all_token_ids: list[int] | None
    new_block_ids: list[int] | None
    """Blocks vLLM gave it for this step: appended to its blocks, or, when ``resumed``, all of them."""


@dataclass(frozen=True)
class Step:
    """One ``SchedulerOutput`` in plain data."""

    new: list[NewRequest]
    cached: list[CachedRequest]
    num_scheduled_tokens: dict[str, int]
    finished: set[str]
    preempted: set[str]
    structured: bool = False
    """True when a scheduled request uses structured output: vLLM then sends the grammar bitmask to
    ``sample_tokens`` after ``execute_model`` returned nothing."""
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """The tokens vLLM's scheduler proposes after each decoding request's last one (speculative decoding: what the
    worker's proposer drafted last step, cut to the token budget)."""
    spec_budget: int | None = None
    """How many tokens to propose after this step (vLLM's ``num_spec_tokens_to_schedule``: ``num_speculative_tokens``,
    or what ``num_speculative_tokens_per_batch_size`` gives for this step's batch size; None: no such schedule)."""
    spec_rows: dict[str, int] = field(default_factory=dict)
    """How many of each request's ``num_scheduled_tokens`` are speculative positions: its ``spec_tokens`` and the
    ``-1`` placeholders vLLM pads with (a new request with one token left to compute gets ``1 + k`` rows, for CUDA
    graphs' sake), which propose nothing."""


def read_step(scheduler_output: Any) -> Step:
    """`Step` from a vLLM ``SchedulerOutput``."""
    new = [
        NewRequest(
            r.req_id,
            list(r.prompt_token_ids or []),
            r.sampling_params,
            r.num_computed_tokens,
            _one_group(r.block_ids) or [],
            read_images(r),
            read_lora(r.lora_request),
        )
        for r in scheduler_output.scheduled_new_reqs
    ]
    c = scheduler_output.scheduled_cached_reqs
    cached = [
        CachedRequest(
            rid,
            c.num_computed_tokens[i],
            rid in c.resumed_req_ids,
            c.all_token_ids.get(rid),
            _one_group(c.new_block_ids[i]),
        )
        for i, rid in enumerate(c.req_ids)
    ]
    spec = {r: list(t) for r, t in (scheduler_output.scheduled_spec_decode_tokens or {}).items() if t}
    return Step(
        new=new,
        cached=cached,
        num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
        finished=set(scheduler_output.finished_req_ids),
        preempted=set(scheduler_output.preempted_req_ids or ()),
        structured=bool(scheduler_output.has_structured_output_requests),
        spec_tokens={r: real for r, t in spec.items() if (real := _proposed(t))},
        spec_rows={r: len(t) for r, t in spec.items()},
        spec_budget=getattr(scheduler_output, "num_spec_tokens_to_schedule", None),
    )


def _proposed(spec_tokens: list[int]) -> list[int]:
    """The proposed tokens of a request's scheduled speculative positions: vLLM's own rule drops its ``-1`` padding
    (and what follows it)."""
    from vllm.v1.structured_output.utils import strip_speculative_padding

    return [int(t) for t in strip_speculative_padding(list(spec_tokens))]


def _one_group(block_ids: tuple[list[int], ...] | None) -> list[int] | None:
    """The block ids of the one KV cache group `kv_cache_spec` declares (vLLM sends one list per group)."""
    if block_ids is None:
        return None
    assert len(block_ids) == 1, f"vLLM placed {len(block_ids)} KV cache groups; the worker declares one"
    return [int(b) for b in block_ids[0]]


def read_images(new_request: Any) -> tuple[ImageItem, ...]:
    """The images of a ``NewRequestData`` from its ``mm_features`` (``pixel_values`` / ``pixel_attention_mask`` of the
    item's ``MultiModalKwargsItem``, positions from its ``PlaceholderRange``)."""
    images = []
    for feature in getattr(new_request, "mm_features", None) or ():
        if feature.modality != "image":
            raise InputError(
                f"request {new_request.req_id}: a {feature.modality} input reached the model runner; "
                "only images are served."
            )
        images.append(_image_item(feature.data, feature.mm_position))
    return tuple(images)


def _image_item(data: Any, place: Any) -> ImageItem:
    """An `ImageItem` from one ``MultiModalKwargsItem`` (None: its data dropped, the image cached) and its
    ``PlaceholderRange``."""
    offsets = range(place.length) if place.is_embed is None else place.is_embed.nonzero().flatten().tolist()
    positions = tuple(place.offset + int(o) for o in offsets)
    if data is None:
        return ImageItem(None, None, positions)
    fields = data.get_data()
    return ImageItem(fields["pixel_values"], fields.get("pixel_attention_mask"), positions)


def read_prompt(processed_inputs: Any) -> tuple[list[int], tuple[ImageItem, ...]]:
    """The prompt token ids and images of a request as vLLM's input processor made them (the ``EngineInput`` that
    ``Platform.validate_request`` receives: ``TokensInput`` or ``MultiModalInput``, its ``mm_kwargs`` and
    ``mm_placeholders``); `InputError` for prompt embeddings, encoder-decoder inputs and modalities other than
    images."""
    kind = processed_inputs.get("type")
    if kind not in ("token", "multimodal"):
        raise InputError(
            f"optimum-neuronx serves prompts of token ids (with images for an image-text artifact), not {kind} "
            "inputs: send text or token ids."
        )
    tokens = list(processed_inputs["prompt_token_ids"])
    if kind == "token":
        return tokens, ()
    kwargs, places = processed_inputs["mm_kwargs"], processed_inputs["mm_placeholders"]
    other = sorted(set(kwargs) - {"image"})
    if other:
        raise InputError(f"this artifact takes images only, not {', '.join(other)}: drop those inputs.")
    pairs = sorted(zip(kwargs.get("image", ()), places.get("image", ()), strict=True), key=lambda p: p[1].offset)
    if any(data is None for data, _ in pairs):
        raise InputError("an image reached the platform without its pixels (vLLM's multimodal processor cache is on).")
    return tokens, tuple(_image_item(data, place) for data, place in pairs)


def limit_images(vllm_config: Any, max_images: int) -> None:
    """Serve at most ``max_images`` images per prompt (``limit_mm_per_prompt``; vLLM's processor answers a prompt with
    more with a 400 naming the limit); an explicit larger ``--limit-mm-per-prompt`` is refused. Turns vLLM's multimodal
    processor cache off, so every image's pixels reach the runner."""
    from vllm.config.multimodal import MultiModalConfig

    mm = vllm_config.model_config.multimodal_config
    asked = mm.limit_per_prompt.get("image")
    if asked is not None and asked.count > max_images:
        raise IncompatibleConfigError(
            f"--limit-mm-per-prompt asks for {asked.count} images but the artifact serves at most max_images="
            f"{max_images} per prompt: lower it, or re-export with --max_images {asked.count}."
        )
    count = max_images if asked is None else asked.count
    mm.limit_per_prompt = MultiModalConfig._validate_limit_per_prompt({"image": count})
    mm.mm_processor_cache_gb = 0


def encoder_budget(vllm_config: Any) -> None:
    """vLLM's encoder accounting for chunked multimodal prefill: images may be split across steps
    (``disable_chunked_mm_input`` off), and the encoder compute budget and cache are one token budget, which vLLM
    raises to its largest image (``compute_mm_encoder_budget``), so an image larger than the token budget is still
    scheduled. docs/multimodal.md explains why this cannot deadlock."""
    sched = vllm_config.scheduler_config
    sched.disable_chunked_mm_input = False
    sched.max_num_encoder_input_tokens = sched.encoder_cache_size = sched.max_num_batched_tokens


def runner_output(
    req_ids: list[str],
    sampled: dict[str, list[int]],
    logprobs: Mapping[str, Any] | None = None,
    prompt_logprobs: Mapping[str, Any] | None = None,
) -> Any:
    """A ``ModelRunnerOutput``: per scheduled request the sampled tokens (``[]`` for a partial prefill), the sampled
    tokens' logprobs (``LogprobsLists``, one row per request) and the prompt logprobs of the requests whose prompt
    completed (``LogprobsTensors``). Logprobs come as `runtime.logprobs.Logprobs`, already in vLLM's layout."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsTensors, ModelRunnerOutput

    if not req_ids:
        return EMPTY_MODEL_RUNNER_OUTPUT
    return ModelRunnerOutput(
        req_ids=list(req_ids),
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(r, []) for r in req_ids],
        logprobs=_logprobs_lists(req_ids, logprobs) if logprobs else None,
        prompt_logprobs_dict={
            r: LogprobsTensors(p.token_ids.to(torch.int32), p.logprobs, p.ranks)
            for r, p in (prompt_logprobs or {}).items()
        },
    )


def ngram_proposer(vllm_config: Any) -> Any:
    """vLLM's n-gram (prompt lookup) proposer for ``--speculative-config '{"method": "ngram", ...}'``: its
    ``propose(k, sampled_token_ids, num_tokens, token_ids)`` drafts up to k tokens per request from the request's own
    tokens (the longest suffix n-gram, ``prompt_lookup_min`` to ``prompt_lookup_max`` long, found earlier)."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    return NgramProposer(vllm_config)


def draft_token_ids(req_ids: list[str], drafts: list[list[int]]) -> Any:
    """The worker's answer to ``take_draft_token_ids``: vLLM's ``DraftTokenIds`` (one list per request, maybe empty),
    which the scheduler schedules after each request's next token."""
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds(req_ids, drafts)


def pending_output(future: Future[Any]) -> Any:
    """A step's output still being computed (on the worker's step thread), as vLLM's ``AsyncModelRunnerOutput``: its
    executor hands it on at once and calls ``get_output`` when the engine core needs the step's tokens."""
    return _pending_output_class()(future)


@lru_cache(maxsize=1)
def _pending_output_class() -> type:
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class PendingOutput(AsyncModelRunnerOutput):
        """``get_output`` waits for the step (and raises its error: a broken engine stops vLLM, as without async)."""

        def __init__(self, future: Future[Any]) -> None:
            self.future = future

        def get_output(self) -> Any:
            return self.future.result()

    return PendingOutput


def _logprobs_lists(req_ids: list[str], logprobs: Mapping[str, Any]) -> Any:
    """vLLM's ``LogprobsLists`` of one step: row i is request i's sampled token (zeros for requests that asked
    none; narrower rows are padded, vLLM reads only the columns a request asked for)."""
    from vllm.v1.outputs import LogprobsLists

    width = max(p.token_ids.shape[1] for p in logprobs.values())
    ids = np.zeros((len(req_ids), width), dtype=np.int32)
    values = np.zeros((len(req_ids), width), dtype=np.float32)
    ranks = np.zeros(len(req_ids), dtype=np.int64)
    for i, req_id in enumerate(req_ids):
        if (found := logprobs.get(req_id)) is not None:
            columns = found.token_ids.shape[1]
            ids[i, :columns], values[i, :columns] = found.token_ids[0].numpy(), found.logprobs[0].numpy()
            ranks[i] = int(found.ranks[0])
    return LogprobsLists(ids, values, ranks)


def kv_cache_spec(
    layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, page_bytes: int
) -> dict[str, Any]:
    """vLLM's ``KVCacheSpec`` of the engine's paged cache, one ``FullAttentionSpec`` per layer (one KV cache group, one
    block table per request: sliding-window layers keep every position too, their window is a mask), so vLLM's KV
    cache manager places each request's blocks, counts the pool's memory and keys its prefix cache by blocks of
    ``block_size`` tokens. ``page_bytes``: what one block of one layer holds; above K and V's own bytes (an int8
    cache's scales) it is the spec's ``page_size_padded``, so vLLM's KV memory figures count every byte."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=dtype)
    if page_bytes > spec.page_size_bytes:
        spec = replace(spec, page_size_padded=page_bytes)
    return {KV_LAYER_NAME.format(layer): spec for layer in range(layers)}


def block_bytes(spec: dict[str, Any]) -> int:
    """Bytes of one block of `kv_cache_spec` over every layer (K and V)."""
    return sum(int(layer.page_size_bytes) for layer in spec.values())


def kv_cache_blocks(kv_cache_config: Any) -> int:
    """The blocks vLLM's ``KVCacheConfig`` gives the cache (its null block, our scratch block, included)."""
    return int(kv_cache_config.num_blocks)


@dataclass(frozen=True)
class Asked:
    """What the user gave for the settings the platform fits, None where vLLM's default stands."""

    max_num_seqs: int | None
    async_scheduling: bool | None
    enable_prefix_caching: bool | None = None
    max_num_batched_tokens: int | None = None


def asked_engine_args() -> Asked | None:
    """The `Asked` settings of the ``EngineArgs`` whose ``create_engine_config`` calls
    ``Platform.pre_register_and_update()`` first thing, before vLLM fills its defaults in (``max_num_seqs``: 128 or
    256 per CPU rank, or doubled, are also values a user may give; ``async_scheduling``: None becomes True), so the
    config alone cannot tell a choice from a default; None when no ``EngineArgs`` is found."""
    import sys

    from vllm.engine.arg_utils import EngineArgs

    frame: FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, EngineArgs):
            return Asked(
                candidate.max_num_seqs,
                candidate.async_scheduling,
                candidate.enable_prefix_caching,
                candidate.max_num_batched_tokens,
            )
        frame = frame.f_back
    return None


ENGINE_PROCESS_PREFIX = "EngineCore"
"""The name vLLM gives its engine-core processes (``EngineCore``, ``EngineCore_DP<i>``)."""


def engine_managers() -> list[Any]:
    """vLLM's engine-core process managers alive in this process (``CoreEngineProcManager``: created before the
    engine-core processes start, kept by the engine client). A scan of the garbage collector's objects: safe from any
    thread (reading another thread's frames is not), and run only until they are found."""
    import gc

    from vllm.v1.engine.utils import CoreEngineProcManager

    return [o for o in gc.get_objects() if isinstance(o, CoreEngineProcManager)]


def engine_failure(manager: Any) -> str | None:
    """The engine-core process vLLM saw end with a non-zero status before any shutdown was asked
    (``CoreEngineProcManager.failed_proc_name``, what vLLM's multi-API-server launcher raises on), or None."""
    return getattr(manager, "failed_proc_name", None)


KILL_TREE_TRIES = 8
"""How many times `tolerate_ended_processes` walks a process tree again after one of its processes ended mid-walk."""


def tolerate_ended_processes() -> None:
    """Make vLLM's ``kill_process_tree`` skip a process that ends while it walks the tree (once per process).

    vLLM's process manager SIGKILLs what a shutdown left with ``kill_process_tree``: it lists every descendant, then
    names each in a log line before killing it. One that ends between the two (the short-lived ``humming`` build
    probes each vLLM worker starts, see `skip_unused_kernel_builds`) raises ``psutil.NoSuchProcess`` out of the
    engine client's shutdown: ``vllm serve`` then never stops its HTTP server (seen in CI with two ranks: the engine
    core and its workers were killed, the API server kept logging stats). The wrapper walks the remaining tree again;
    the name is replaced in ``vllm.v1.utils``, where the process manager looks it up."""
    import psutil
    import vllm.v1.utils as v1_utils

    kill = v1_utils.kill_process_tree
    if getattr(kill, "tolerates_ended_processes", False):
        return

    def kill_process_tree(pid: int) -> None:
        for _ in range(KILL_TREE_TRIES):
            try:
                return kill(pid)
            except psutil.NoSuchProcess:
                continue  # a process of the tree ended mid-walk: walk what is left
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    kill_process_tree.tolerates_ended_processes = True  # type: ignore[attr-defined]
    v1_utils.kill_process_tree = kill_process_tree


def skip_unused_kernel_builds() -> None:
    """Keep vLLM's workers from starting ``humming``'s background builds (its CUDA GEMM launcher and NVRTC
    compiler), unless the user set ``HUMMING_DISABLE_PARALLEL_BUILD`` themselves.

    Importing ``humming`` (vLLM's worker does, for its quantized linear kernels) starts two Python processes that
    import torch and try to build them; our graphs compute every linear layer, so nothing would use the builds. They
    ran ~10 s beside each worker's model load (a two-rank ``vllm serve`` of a tiny model on 2 cores became healthy in
    27.6 s without them against 32-33 s). The setting is inherited by the engine core and workers started after it."""
    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")


def set_scheduler(scheduler_config: Any, qualname: str) -> None:
    """Make vLLM's engine core schedule with the class ``qualname`` (``SchedulerConfig.scheduler_cls``); a scheduler
    the user chose (``--scheduler-cls``) is refused: the plugin needs its own to finish a failed request alone."""
    chosen = scheduler_config.scheduler_cls
    if chosen is not None and chosen != qualname:
        raise IncompatibleConfigError(
            f"--scheduler-cls {chosen} is not supported by optimum-neuronx: drop it (the plugin schedules with "
            f"{qualname}, vLLM's scheduler that finishes a request the model runner cannot run with an error)."
        )
    scheduler_config.scheduler_cls = qualname


def disable_graph_capture(vllm_config: Any) -> None:
    """No torch.compile and no CUDA graphs: our graphs are already compiled."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    vllm_config.compilation_config.mode = CompilationMode.NONE
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE


def set_tensor_parallel(parallel_config: Any, degree: int) -> None:
    """Make vLLM start ``degree`` workers, one per tensor-parallel rank (``ParallelConfig``: its world size is
    derived when it is built, before the platform sees it; one process needs the multiprocess executor). CPU
    platforms bind each worker's OpenMP threads to its own NUMA node by default, which fails on a one-node host:
    unless the user chose a binding (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0|1"``), the workers are not bound."""
    import os

    parallel_config.tensor_parallel_size = degree
    parallel_config.world_size = (
        parallel_config.pipeline_parallel_size * degree * parallel_config.prefill_context_parallel_size
    )
    if degree > 1:
        if parallel_config.distributed_executor_backend in (None, "uni"):
            parallel_config.distributed_executor_backend = "mp"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def set_served_heads(model_config: Any, heads: int, kv_heads: int) -> None:
    """Tell vLLM the head counts the artifact's graphs compute (`layers.parallel.HeadLayout`: padded with zero heads
    when they do not split over the ranks). vLLM checks ``total_num_attention_heads % tensor_parallel_size`` again
    in the engine core, after the platform set the degree (``VllmConfig.__post_init__``); its own per-rank head
    counts are never used to run the model (the runner computes with the artifact's graphs)."""
    model_config.model_arch_config.total_num_attention_heads = heads
    model_config.model_arch_config.total_num_kv_heads = kv_heads


def init_worker_group(worker: Any) -> None:
    """Join vLLM's torch.distributed groups from a worker (``init_worker_distributed_environment``, the platform's
    gloo backend): the default group a tensor-parallel graph all-reduces over holds this engine's ranks."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    init_worker_distributed_environment(
        worker.vllm_config,
        worker.rank,
        worker.distributed_init_method,
        worker.local_rank,
        current_platform.dist_backend,
    )


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

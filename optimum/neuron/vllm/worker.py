"""The vLLM worker: loads the artifact into an `Engine` and hands each scheduler step to the `Runner`.

It reports the engine's paged KV cache as vLLM's KV cache spec (`compat.kv_cache_spec`: the artifact's block size,
layers, KV heads of this rank and dtype: int8 for ``--kv_cache_dtype int8``, whose float32 scales, 8 bytes per token and
KV head, count as the page's padding) with exactly the artifact's blocks, so vLLM's KV cache manager places every
request's blocks in it (prefix caching included); the engine holds the cache and takes the block ids vLLM sends.

Under async scheduling (vLLM's default, off by default for a CPU artifact) every step runs on one step thread, in
the order vLLM sends them: the worker answers at once with a pending output, and vLLM schedules step N+1 while step N
runs. The runner and the engine are touched on that thread only (`_on_step_thread`). A request that step N finishes (a
stop token) may already be in step N+1: it decodes once more, vLLM drops that token, and step N+2 releases its slot.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from ..artifact import Artifact
from ..graphs import packed_verification
from ..modeling import NeuronModelForCausalLM
from ..models.layers.kv_cache import cache_bytes, tensors_per_layer
from ..runtime.engine import Engine
from . import compat
from .drafting import DraftGate, ModelDrafter, NgramDrafter, drafter_for, gate_for
from .runner import Runner
from .scheduler import runner_output as with_failures

logger = compat.logger(__name__)
T = TypeVar("T")


class NeuronxWorker(compat.worker_base()):  # type: ignore[misc]
    """One worker process serving one artifact."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runner: Runner | None = None
        self.drafter: NgramDrafter | ModelDrafter | None = None
        """The drafter ``--speculative-config`` asks for: vLLM's n-gram proposer or a draft artifact (`drafting`)."""
        self.gate: DraftGate | None = None
        """Which of an n-gram drafter's proposals are worth verifying (`drafting.DraftGate`)."""
        self._drafts: Any = None
        """What the drafter proposed after the last step, until vLLM takes it (`take_draft_token_ids`)."""
        self._waiting: compat.Step | None = None
        """A step held back by `execute_model` until `sample_tokens` brings its grammar bitmask."""
        self._steps: ThreadPoolExecutor | None = None
        """Async scheduling: the one thread that runs steps (and reads the runner), in order."""
        if self.scheduler_config.async_scheduling:
            self._steps = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neuronx-step")

    # --- lifetime ---------------------------------------------------------------------------

    def init_device(self) -> None:
        """Join this engine's process group when it has several workers (one per tensor-parallel rank), and seed
        torch with the engine's seed as vLLM's own workers do: every rank then draws the same seeds for unseeded
        requests, so all ranks sample the same tokens. The engine places its tensors when the model loads."""
        if self.parallel_config.world_size > 1:
            compat.init_worker_group(self)
        if self.model_config.seed is not None:
            torch.manual_seed(self.model_config.seed)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """Open the artifact (``--model``), load weights, graphs and the KV cache once."""
        artifact = Artifact.open(self.model_config.model)
        engine = Engine(artifact, caller_blocks=True)
        lora = getattr(self.vllm_config, "lora_config", None)  # None without --enable-lora
        self.runner = Runner(engine, cpu_loras=(lora.max_cpu_loras or 0) if lora is not None else 0)
        self.drafter = drafter_for(self.vllm_config, engine.rank)
        self.gate = gate_for(self.vllm_config, self.drafter, packed_verification(engine.config))
        c = artifact.config
        logger.info(
            "optimum-neuronx serving %s (rank %d of %d): backend=%s device=%s graphs=%s batch_size=%d "
            "sequence_length=%d prefill_chunk_size=%d chunk_buckets=%s kv_windows=%s kv_blocks=%d block_size=%d "
            "on_device_sampling=%s",
            artifact.root,
            engine.rank,
            c.tp_degree,
            c.backend,
            c.device,
            list(engine.graphs),
            c.batch_size,
            c.sequence_length,
            c.prefill_chunk_size,
            list(c.chunk_sizes),
            list(c.kv_windows),
            c.kv_blocks,
            c.block_size,
            c.on_device_sampling,
        )

    def shutdown(self) -> None:
        """Finish the step in flight, then drop the engine (weights, graphs, cache)."""
        if self._steps is not None:
            self._steps.shutdown(wait=True)
        self.runner, self.drafter = None, None

    # --- KV cache negotiation ---------------------------------------------------------------

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """The engine's paged cache (this rank's KV heads), one spec per layer, in its K and V dtype, a page counting
        every tensor the layer's block holds (an int8 cache's scales included)."""
        assert self.runner is not None, "load_model() runs before the KV cache is negotiated"
        engine = self.runner.engine
        cache, layers = engine.kv_cache[0], len(engine.kv_cache) // tensors_per_layer(engine.config.kv_int8)
        _, kv_heads, _, head_dim = cache.shape
        page = cache_bytes(engine.kv_cache) // (layers * cache.shape[0])
        return compat.kv_cache_spec(layers, engine.block_size, kv_heads, head_dim, cache.dtype, page)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """Any layout: vLLM's cache is never allocated (the base implementation raises on our platform)."""
        return ["NHD"]

    def determine_available_memory(self) -> int:
        """The bytes of the artifact's KV cache: vLLM divides them into exactly its blocks."""
        assert self.runner is not None
        return self.runner.engine.config.kv_blocks * self.get_cache_block_size_bytes()

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """No vLLM-side cache to allocate: the engine's is the one; check vLLM plans with no more blocks than it has."""
        assert self.runner is not None
        planned, held = compat.kv_cache_blocks(kv_cache_config), self.runner.engine.config.kv_blocks
        if planned > held:
            raise RuntimeError(f"vLLM planned {planned} KV blocks, the artifact's cache holds {held}")

    def update_max_model_len(self, max_model_len: int) -> None:
        """vLLM may lower the length after profiling; the artifact's limit is already applied."""
        self.model_config.max_model_len = max_model_len

    def compile_or_warm_up_model(self) -> Any:
        """Graphs were compiled at export: nothing to do."""
        return compat.compilation_times()

    def get_cache_block_size_bytes(self) -> int:
        """Bytes of one block over every layer."""
        return compat.block_bytes(self.get_kv_cache_spec())

    # --- serving ----------------------------------------------------------------------------

    def get_supported_tasks(self) -> tuple[str, ...]:
        """Text generation only."""
        return ("generate",)

    def execute_model(self, scheduler_output: Any) -> Any:
        """One scheduler step. Without async scheduling: its ``ModelRunnerOutput``, or None when a scheduled request
        uses structured output (vLLM then computes the grammar bitmask and calls `sample_tokens`, which runs the step).
        Under async scheduling vLLM calls `sample_tokens` after every step that schedules tokens: the step waits for
        it (None); a step with none (it may still release finished requests) is queued at once."""
        step = compat.read_step(scheduler_output)
        if self._waiting is not None:
            raise RuntimeError("vLLM sent a step before sampling the previous one: the worker's order is broken")
        if self._steps is None:
            if step.structured:
                self._waiting = step
                return None
            return self._run(step, None)
        if not any(step.num_scheduled_tokens.values()):
            return compat.pending_output(self._steps.submit(self._run, step, None))
        self._waiting = step
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        """Run the step `execute_model` held back, with its grammar bitmask (``GrammarOutput`` or None); under async
        scheduling, queue it on the step thread and answer with its pending output."""
        step, self._waiting = self._waiting, None
        if step is None:
            return compat.runner_output([], {})
        if self._steps is not None:
            return compat.pending_output(self._steps.submit(self._run, step, grammar_output))
        return self._run(step, grammar_output)

    def _run(self, step: compat.Step, grammar_output: Any) -> Any:
        assert self.runner is not None, "load_model() runs before the first step"
        start = time.perf_counter()
        out = self.runner.execute(step, grammar_output)
        if self.gate is not None:
            self.gate.observe(step, out, time.perf_counter() - start)
        if self.drafter is not None:
            sampled = [r for r in out.req_ids if out.sampled[r]]
            drafts = self.drafter.draft(self.runner.engine, sampled, step.spec_budget)
            self._drafts = drafts if self.gate is None else self.gate.admit(drafts)
        output = compat.runner_output(out.req_ids, out.sampled, out.logprobs, out.prompt_logprobs)
        return with_failures(output, out.failed)

    def execute_dummy_batch(self) -> None:
        """Nothing to run. Under data parallelism vLLM keeps the replicas of an MoE model in lockstep and calls this on
        a replica with no scheduled work while another one steps (vLLM's GPU worker runs a forward pass there so its
        expert-parallel collectives match); an artifact's graphs hold no collective across replicas, so an idle replica
        has nothing to join. Without this method the call fails and that replica's engine core dies."""

    def take_draft_token_ids(self) -> Any:
        """The tokens proposed after the last step's (vLLM's ``DraftTokenIds``; None without speculative decoding):
        vLLM's scheduler schedules them next step (synchronous scheduling only: the platform refuses async with
        speculation)."""
        drafts, self._drafts = self._drafts, None
        return drafts

    # --- LoRA adapters (--enable-lora on an artifact exported with --max_loras) ---------------

    def add_lora(self, lora_request: Any) -> bool:
        """Remember vLLM's adapter; it is loaded into a slot when a request runs on it (`vllm.lora`)."""
        adapter = compat.read_lora(lora_request)
        return self._on_step_thread(lambda: self._adapters().add(adapter) if adapter else False)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget the adapter and free its slot (False while a request runs on it)."""
        return self._on_step_thread(lambda: self._adapters().remove(lora_id))

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter in its slot once loaded."""
        return self._on_step_thread(lambda: self._adapters().pin(lora_id))

    def list_loras(self) -> set[int]:
        """The adapters this worker knows."""
        return self._on_step_thread(lambda: self._adapters().ids())

    def _adapters(self) -> Any:
        assert self.runner is not None and self.runner.adapters is not None, "--enable-lora on a LoRA artifact only"
        return self.runner.adapters

    def check_health(self) -> None:
        """Healthy while loaded."""

    # --- introspection for tests and logs (reachable through ``LLM.collective_rpc``) --------

    def step_records(self) -> list[dict[str, Any]]:
        """The steps run so far as plain data (``index``, ``decodes``: request ids, ``prefills``:
        ``[req_id, start, count]``, ``started`` / ``seconds``: the engine work's start and wall time, as
        `StepRecord`), so they cross vLLM's process boundary unchanged."""
        return self._on_step_thread(lambda: [dataclasses.asdict(r) for r in self.runner.records] if self.runner else [])

    def slot_usage(self) -> dict[int, Any]:
        """Held slots and their request ids (after the step in flight, if any)."""
        return self._on_step_thread(lambda: dict(self.runner.engine.slots.used) if self.runner else {})

    def draft_slot_usage(self) -> dict[int, Any]:
        """The draft artifact's held slots and their request ids (``{}`` without a draft model)."""
        drafter = self.drafter
        engine = drafter.engine if isinstance(drafter, ModelDrafter) else None
        return self._on_step_thread(lambda: dict(engine.slots.used) if engine else {})

    def block_usage(self) -> dict[str, list[int]]:
        """The KV blocks each admitted request holds (after the step in flight, if any)."""
        return self._on_step_thread(lambda: self.runner.engine.held_blocks() if self.runner else {})

    def _on_step_thread(self, read: Callable[[], T]) -> T:
        """``read()`` where steps run: between two steps, never during one."""
        return read() if self._steps is None else self._steps.submit(read).result()

    def get_model(self) -> Any:
        """The loaded model, as ``NeuronModelForCausalLM``."""
        assert self.runner is not None
        return NeuronModelForCausalLM(self.runner.engine)

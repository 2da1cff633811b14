"""The vLLM platform: makes vLLM serve an optimum-neuronx artifact with our worker.

``check_and_update_config`` reads the artifact's ``neuron_config.json`` and sets what vLLM may
schedule: ``max_num_seqs`` = the token-generation rows (batch size), ``max_model_len`` = the compiled sequence
length, a token budget of one chunk (chunked artifacts, vLLM then feeds prompts chunk by chunk
between decodes) or of a whole prompt (context-encoding artifacts), and the paged KV cache vLLM's KV cache manager
places requests in (block size, blocks, prefix caching: `fit_kv_cache`). Asking for more than the
artifact holds is an error naming the export flag to change.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import torch

from ..artifact import read_config, served_heads
from ..config import NeuronConfig, flag
from ..errors import IncompatibleConfigError, InputError
from ..runtime.admission import Admission
from . import compat
from .sampling import check_request
from .supervision import watch_engine_cores

logger = compat.logger(__name__)
VERIFY_EVERY = "verify_every_proposal"
"""The ``--additional-config`` key that turns n-gram speculation's `drafting.DraftGate` off."""

_Platform, _PlatformEnum = compat.platform_base()


def resolve_limits(
    vllm_config: Any, neuron: NeuronConfig, asked_seqs: int | None, asked_budget: int | None = None
) -> None:
    """Set ``max_num_seqs`` / ``max_model_len`` / the token budget from the artifact, refusing more: ``asked_seqs`` is
    the ``--max-num-seqs`` the user gave (None: vLLM's default, lowered to the artifact's batch size), ``asked_budget``
    its ``--max-num-batched-tokens``, kept on a chunked artifact (the default there is one chunk: a decode waits for at
    most one chunk of another request's prompt; a larger budget runs several chunks per step, more prompt tokens per
    step at the cost of that wait), and on a context-encoding artifact when it holds a whole prompt beside every
    running request's decode (refused below that: a prompt could never be scheduled)."""
    model, sched = vllm_config.model_config, vllm_config.scheduler_config
    asked_len = model.original_max_model_len
    if asked_len is not None and asked_len > neuron.sequence_length:
        raise IncompatibleConfigError(
            f"max_model_len={asked_len} exceeds the artifact's sequence_length={neuron.sequence_length}: "
            "lower --max-model-len or re-export with a larger --sequence_length."
        )
    model.max_model_len = asked_len or neuron.sequence_length
    if sched.max_num_seqs > neuron.batch_size:
        if asked_seqs is not None:
            raise IncompatibleConfigError(
                f"max_num_seqs={sched.max_num_seqs} exceeds the artifact's batch_size={neuron.batch_size} "
                "(its KV slots): lower --max-num-seqs or re-export with a larger --batch_size."
            )
        sched.max_num_seqs = neuron.batch_size
    if neuron.prefill_chunk_size:
        sched.enable_chunked_prefill = True
        sched.max_num_batched_tokens = asked_budget or max(neuron.prefill_chunk_size, sched.max_num_seqs)
    else:
        sched.enable_chunked_prefill = False
        whole = model.max_model_len + sched.max_num_seqs  # a whole prompt beside every running request's decode
        if asked_budget is not None and asked_budget < whole:
            raise IncompatibleConfigError(
                f"--max-num-batched-tokens {asked_budget} is below {whole}: {vllm_config.model_config.model} was "
                "exported without --prefill_chunk_size, so each prompt is prefilled whole in one step (up to "
                f"max_model_len={model.max_model_len} tokens, beside {sched.max_num_seqs} decodes): pass at least "
                f"{whole}, drop the flag, or re-export with --prefill_chunk_size C."
            )
        sched.max_num_batched_tokens = asked_budget or whole
    sched.long_prefill_token_threshold = 0
    sched.verify_max_model_len(model.max_model_len)


def fit_parallelism(parallel_config: Any, neuron: NeuronConfig) -> None:
    """Run one worker per tensor-parallel rank of the artifact: the degree comes from the artifact, a different
    ``--tensor-parallel-size`` (other than vLLM's default 1) is refused, and so is pipeline parallelism."""
    asked = parallel_config.tensor_parallel_size
    if asked not in (1, neuron.tp_degree):
        raise IncompatibleConfigError(
            f"--tensor-parallel-size {asked} does not match the artifact, exported for {neuron.tp_degree} "
            f"tensor-parallel rank(s): drop --tensor-parallel-size (it is read from the artifact) or re-export with "
            f"{flag('tp_degree')} {asked}."
        )
    if parallel_config.pipeline_parallel_size != 1:
        raise IncompatibleConfigError(
            "optimum-neuronx does not implement pipeline parallelism: drop --pipeline-parallel-size (scale with "
            f"{flag('tp_degree')} at export and --data-parallel-size at serve time)."
        )
    compat.set_tensor_parallel(parallel_config, neuron.tp_degree)


def fit_kv_cache(cache_config: Any, neuron: NeuronConfig, asked_prefix_caching: bool | None) -> None:
    """vLLM's KV cache manager places requests in the artifact's paged cache: its block size, its blocks (the pool and
    the scratch block, which is vLLM's null block), and prefix caching on by default (vLLM's own default), except for
    an artifact without a chunked-prefill graph, whose context-encoding graph always starts at position 0 (an explicit
    ``--enable-prefix-caching`` is then refused). A smaller ``--num-gpu-blocks-override`` is kept; a larger one is
    refused."""
    chunked = bool(neuron.prefill_chunk_size)
    if asked_prefix_caching and not chunked:
        raise IncompatibleConfigError(
            "prefix caching needs a chunked-prefill graph (a prefill that starts after the cached blocks): drop "
            f"--enable-prefix-caching or re-export with {flag('prefill_chunk_size')} C."
        )
    cache_config.enable_prefix_caching = chunked if asked_prefix_caching is None else asked_prefix_caching
    cache_config.block_size = neuron.block_size
    asked_blocks = cache_config.num_gpu_blocks_override
    if asked_blocks is not None and asked_blocks > neuron.kv_blocks:
        raise IncompatibleConfigError(
            f"--num-gpu-blocks-override {asked_blocks} exceeds the artifact's KV cache of {neuron.kv_blocks} blocks "
            f"({neuron.cache_tokens} positions and the scratch block): lower it or re-export with a larger "
            f"{flag('kv_cache_tokens')}."
        )
    if asked_blocks is None:
        cache_config.num_gpu_blocks_override = neuron.kv_blocks


def async_scheduling(neuron: NeuronConfig, asked: bool | None, speculating: bool = False) -> bool:
    """vLLM's async scheduling, unless the user left it to its default and the artifact runs on the CPU: there the
    graphs' threads take every core, so the engine core's scheduling of step N+1 cannot overlap step N and only
    competes with it (SmolLM2 batch 8 on 2 cores, 8 x 200 -> 128 tokens through ``vllm.LLM``: 166 tok/s sync vs 116
    async; benchmark/README.md), or under speculative decoding (`check_speculation`). An explicit
    ``--async-scheduling`` / ``--no-async-scheduling`` is kept."""
    if asked is None:
        return neuron.device != "cpu" and not speculating
    return asked


def scheduler_class(scheduler_config: Any) -> str:
    """Our scheduler for the scheduling chosen (`async_scheduling`): async (step N+1 is scheduled while the worker runs
    step N) or not."""
    kind = "NeuronxAsyncScheduler" if scheduler_config.async_scheduling else "NeuronxScheduler"
    return f"optimum.neuron.vllm.scheduler.{kind}"


def check_sampling_config(model_config: Any) -> None:
    """Refuse engine-wide sampling options the plugin does not implement: logprobs other than vLLM's default raw
    logprobs, and custom logits processors."""
    if model_config.logprobs_mode != "raw_logprobs":
        raise IncompatibleConfigError(
            f"logprobs_mode={model_config.logprobs_mode!r} is not supported by optimum-neuronx: drop --logprobs-mode "
            "(logprobs are the log-softmax of the raw logits, vLLM's default raw_logprobs)."
        )
    if model_config.logits_processors:
        raise IncompatibleConfigError(
            "custom logits processors are not supported by optimum-neuronx: drop --logits-processors (min_p, "
            "min_tokens and logit_bias, vLLM's built-in ones, are)."
        )


def check_lora(vllm_config: Any, neuron: NeuronConfig) -> None:
    """``--enable-lora`` needs an artifact with adapter slots (``--max_loras``): at least as many as vLLM's
    ``--max-loras`` (the distinct adapters its scheduler runs at once), of at least its ``--max-lora-rank``."""
    lora = getattr(vllm_config, "lora_config", None)
    if lora is None:
        return
    if not neuron.max_loras:
        raise IncompatibleConfigError(
            f"--enable-lora needs adapter slots, which {vllm_config.model_config.model} was exported without: "
            "re-export it with --max_loras N --max_lora_rank R (docs/lora.md), or drop --enable-lora."
        )
    if lora.max_loras > neuron.max_loras:
        raise IncompatibleConfigError(
            f"--max-loras {lora.max_loras} is more than the artifact's {neuron.max_loras} adapter slots: pass "
            f"--max-loras {neuron.max_loras} or less, or re-export with --max_loras {lora.max_loras}."
        )
    if lora.max_lora_rank > neuron.max_lora_rank:
        raise IncompatibleConfigError(
            f"--max-lora-rank {lora.max_lora_rank} is above the artifact's adapter rank {neuron.max_lora_rank}: pass "
            f"--max-lora-rank {neuron.max_lora_rank}, or re-export with --max_lora_rank {lora.max_lora_rank}."
        )


def check_speculation(vllm_config: Any, neuron: NeuronConfig, asked_async: bool | None = None) -> None:
    """Let through vLLM's n-gram speculation (``--speculative-config '{"method": "ngram", ...}'``) and a draft artifact
    (``{"method": "draft_model", "model": DRAFT, ...}``, `check_draft_artifact`) on an artifact whose verification
    graph checks as many tokens, under synchronous scheduling; refuse every other speculative setting, saying what to
    change."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return
    if spec.method not in ("ngram", "draft_model"):
        raise IncompatibleConfigError(
            f"speculative decoding method {spec.method!r} is not supported by optimum-neuronx: use "
            '--speculative-config \'{"method": "ngram", "num_speculative_tokens": K}\' (prompt lookup) or '
            '\'{"method": "draft_model", "model": DRAFT_ARTIFACT, "num_speculative_tokens": K}\' (EAGLE/Medusa heads '
            "need trained weights: docs/speculative.md)."
        )
    most = neuron.speculation_length
    if most == 0:
        raise IncompatibleConfigError(
            f"{vllm_config.model_config.model} has no verification graph: re-export it with --speculation_length K "
            "to serve with --speculative-config, or drop --speculative-config."
        )
    if spec.num_speculative_tokens > most:
        raise IncompatibleConfigError(
            f"num_speculative_tokens={spec.num_speculative_tokens} is more than the artifact verifies per step "
            f"({most}): use num_speculative_tokens <= {most}, or re-export with --speculation_length "
            f"{spec.num_speculative_tokens}."
        )
    if asked_async:
        raise IncompatibleConfigError(
            "speculative decoding runs with synchronous scheduling only (the worker drafts after each step's tokens "
            "are known): drop --async-scheduling."
        )
    if spec.method == "draft_model":
        check_draft_artifact(spec.draft_model_config.model, neuron)


def check_additional_config(vllm_config: Any) -> None:
    """``--additional-config`` holds only what this platform reads: ``{"verify_every_proposal": true|false}`` (with
    n-gram speculation, verify every proposal instead of only where it pays, `drafting.DraftGate`)."""
    extra = vllm_config.additional_config or {}
    unknown = sorted(set(extra) - {VERIFY_EVERY})
    if unknown:
        raise IncompatibleConfigError(
            f"--additional-config keys {unknown} mean nothing to optimum-neuronx: the one it reads is "
            f'{{"{VERIFY_EVERY}": true}} (with n-gram speculation, verify every proposal).'
        )
    if not isinstance(extra.get(VERIFY_EVERY, False), bool):
        raise IncompatibleConfigError(f'--additional-config "{VERIFY_EVERY}" takes true or false.')


def check_draft_artifact(draft: str, neuron: NeuronConfig) -> None:
    """A draft model must be an artifact of this toolkit (`drafting.ModelDrafter` runs it in an engine of its own):
    one rank, a chunked-prefill graph (its sequences are rewound and resume mid-prompt) and as many slots as the
    target (vLLM itself refuses a draft whose vocabulary is not the target's)."""
    from ..errors import ArtifactError

    export = "export it with optimum-cli export neuron --model DRAFT --prefill_chunk_size C ... and pass that folder"
    try:
        config = read_config(draft)
    except ArtifactError as err:
        raise IncompatibleConfigError(f"the draft model {draft} is not an optimum-neuronx artifact: {export}.") from err
    fixes = {
        "tp_degree": (config.tp_degree == 1, "1 (the draft runs on one rank)"),
        "prefill_chunk_size": (config.prefill_chunk_size > 0, "C > 0 (a chunked-prefill graph)"),
        "batch_size": (config.batch_size >= neuron.batch_size, f">= {neuron.batch_size}, the target's"),
    }
    for name, (ok, wanted) in fixes.items():
        if not ok:
            raise IncompatibleConfigError(
                f"the draft artifact {draft} has {name}={getattr(config, name)}: re-export it with "
                f"{flag(name)} {wanted}."
            )


class NeuronxPlatform(_Platform):  # type: ignore[misc,valid-type]
    """Out-of-tree vLLM platform for optimum-neuronx artifacts (verified for CPU artifacts; it declares a CPU
    device, so serving a CUDA artifact is neither written nor run: docs/cuda.md)."""

    _enum = _PlatformEnum.OOT
    device_name = "cpu"  # vLLM's process groups place their tensors on torch.device(f"{device_name}:{rank}")
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    def __init__(self) -> None:
        self.asked: compat.Asked | None = None
        """What the ``EngineArgs`` building the config asked for (`pre_register_and_update`); None: unknown."""
        self.admission: Admission | None = None
        """What the artifact `check_and_update_config` fitted vLLM to accepts: vLLM calls both that method and
        `validate_request` on its one platform object, and the latter receives no configuration."""

    @classmethod
    def is_cpu(cls) -> bool:  # vLLM skips accelerator calls (e.g. at shutdown) for CPU platforms
        return True

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        """A human-readable device name."""
        return "optimum-neuronx"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """Host memory (the artifact's engine owns its own cache)."""
        return int(psutil.virtual_memory().total)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """Nothing to select."""

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        """Seed torch (our samplers are seeded per request anyway)."""
        torch.manual_seed(seed)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        """No pinned host buffers."""
        return False

    @classmethod
    def inference_mode(cls) -> Any:
        """``torch.no_grad`` (inference tensors cannot be passed to AOTInductor runners as mutable inputs)."""
        return torch.no_grad()

    def pre_register_and_update(self, parser: Any = None) -> None:
        """Called by vLLM when it builds its argument parser (``parser``) and first thing when ``EngineArgs`` builds
        a config (no parser): remember what the user asked for, before vLLM fills in its defaults."""
        if parser is None:
            self.asked = compat.asked_engine_args()

    def _take_asked(self, vllm_config: Any) -> compat.Asked:
        """What was asked for the config being checked (once: one config per ``EngineArgs`` call); the config's own
        values when no ``EngineArgs`` built it."""
        asked, self.asked = self.asked, None
        sched = vllm_config.scheduler_config
        return asked or compat.Asked(
            sched.max_num_seqs, sched.async_scheduling, max_num_batched_tokens=sched.max_num_batched_tokens
        )

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: Any) -> None:
        """Keep the block size chosen in `check_and_update_config` (the artifact's; there is no attention backend)."""

    def check_and_update_config(self, vllm_config: Any) -> None:
        """Fit vLLM's configuration to the artifact being served (see the module docstring)."""
        if vllm_config.model_config is None:
            return
        watch_engine_cores()  # vllm serve: exit non-zero if an engine core dies
        compat.tolerate_ended_processes()  # a shutdown's kill of what is left must not stop at one ended process
        compat.skip_unused_kernel_builds()
        neuron = read_config(vllm_config.model_config.model)
        fit_parallelism(vllm_config.parallel_config, neuron)
        if neuron.tp_degree > 1:  # the heads its graphs compute, padded where they do not split (recorded at export)
            compat.set_served_heads(vllm_config.model_config, *served_heads(neuron))
        check_sampling_config(vllm_config.model_config)
        asked = self._take_asked(vllm_config)
        check_speculation(vllm_config, neuron, asked.async_scheduling)
        check_additional_config(vllm_config)
        check_lora(vllm_config, neuron)
        vllm_config.parallel_config.worker_cls = "optimum.neuron.vllm.worker.NeuronxWorker"
        speculating = vllm_config.speculative_config is not None
        vllm_config.scheduler_config.async_scheduling = async_scheduling(neuron, asked.async_scheduling, speculating)
        compat.set_scheduler(vllm_config.scheduler_config, scheduler_class(vllm_config.scheduler_config))
        # Start the engine core by spawn, as vLLM's CPU platform does: a process forked after torch ran
        # intra-op (OpenMP) work hangs in its first parallel op (seen: allocating the KV cache).
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        fit_kv_cache(vllm_config.cache_config, neuron, asked.enable_prefix_caching)
        compat.disable_graph_capture(vllm_config)
        vllm_config.model_config.dtype = neuron.torch_dtype  # what the artifact computes in (logs, metadata)
        resolve_limits(vllm_config, neuron, asked.max_num_seqs, asked.max_num_batched_tokens)
        if neuron.image_tiles:  # an image-text artifact: vLLM's multimodal processor feeds the runner images
            compat.limit_images(vllm_config, neuron.max_images)
            compat.encoder_budget(vllm_config)
        from transformers import AutoConfig

        self.admission = Admission.of(AutoConfig.from_pretrained(vllm_config.model_config.model), neuron)
        logger.info(
            "optimum-neuronx: %s (batch_size=%d, sequence_length=%d, prefill_chunk_size=%d, tp_degree=%d, KV cache "
            "%d blocks of %d) -> max_num_seqs=%d, max_model_len=%d, max_num_batched_tokens=%d, chunked_prefill=%s, "
            "prefix_caching=%s",
            vllm_config.model_config.model,
            neuron.batch_size,
            neuron.sequence_length,
            neuron.prefill_chunk_size,
            neuron.tp_degree,
            neuron.kv_blocks,
            neuron.block_size,
            vllm_config.scheduler_config.max_num_seqs,
            vllm_config.model_config.max_model_len,
            vllm_config.scheduler_config.max_num_batched_tokens,
            vllm_config.scheduler_config.enable_chunked_prefill,
            vllm_config.cache_config.enable_prefix_caching,
        )

    def validate_request(self, processed_inputs: Any, params: Any) -> None:
        """Refuse, per request and before it is scheduled, what `Engine.admit` would refuse: a prompt, images or
        sampling parameters the artifact cannot serve (vLLM answers with HTTP 400 and the message)."""
        assert self.admission is not None, "vLLM validates requests only after check_and_update_config"
        try:
            prompt, images = compat.read_prompt(processed_inputs)
            check_request(prompt, images, params, self.admission)
        except InputError as err:  # vLLM answers its own validation error with HTTP 400, anything else 500
            raise compat.request_error(str(err)) from err

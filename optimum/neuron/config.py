"""`NeuronConfig`: the frozen description of what an artifact compiles (DESIGN.md §3.8)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ArtifactError, IncompatibleConfigError
from .version import __version__

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ("inductor", "eager", "xla", "neuron")
SYMBOLIC_SHAPE_BACKENDS = ("eager", "inductor")
"""Backends that compile the KV window and the chunk length as symbolic dimensions (one graph serves every window
and chunk bucket); the others (xla, neuron: static shapes) compile one graph per window and bucket."""
DEVICES = ("cpu", "cuda", "neuron")
CONFIG_FILE = "neuron_config.json"
AUTO_FIRST_WINDOW = 256
"""The smallest KV window of ``kv_buckets="auto"`` (unless the chunk is larger)."""
SMALLEST_CHUNK_BUCKET = 4
"""The shortest chunk-length bucket (`chunk_buckets`): ``auto`` starts from it, a list may not go below it (a symbolic
chunk dimension is traced for lengths of at least 3 tokens)."""
AUTO_CHUNK_STEP = 16
"""``chunk_buckets="auto"`` on inductor and eager: every multiple of this up to the chunk (and the powers of two from
`SMALLEST_CHUNK_BUCKET` below it), so a piece pads at most 15 tokens (SmolLM2's prefill costs about what its padded
columns need: halving buckets padded vLLM's 136-token pieces to 256)."""
AUTO_BLOCK_SIZES = (32, 16, 8, 4, 2, 1)
"""``kv_block_size=0`` picks the largest of these that divides the sequence length and every KV window."""
LINEAR_KERNELS = ("auto", "packed", "aten")
ATTENTION_KERNELS = ("auto", "paged", "sdpa")
WEIGHT_FORMATS = ("float", "int8", "int4")
LM_HEAD_FORMATS = ("float", "int8")
INT4_RANGES = ("symmetric", "full")
QUANTIZATION_METHODS = ("rtn", "gptq")
KV_CACHE_DTYPES = ("auto", "int8")
KV_INT8_BACKENDS = ("eager", "inductor")
"""Backends an int8 KV cache compiles on (its cache list holds int8 values and float32 scales)."""
CHOICES: dict[str, tuple[str, ...]] = {
    "auto_cast_type": tuple(DTYPES),
    "weight_format": WEIGHT_FORMATS,
    "lm_head_format": LM_HEAD_FORMATS,
    "int4_range": INT4_RANGES,
    "quantization_method": QUANTIZATION_METHODS,
    "backend": BACKENDS,
    "device": DEVICES,
    "linear_kernel": LINEAR_KERNELS,
    "attention_kernel": ATTENTION_KERNELS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
}
"""The allowed values of the fields that take a name (the CLI offers exactly these)."""
FLAG_NAMES = {"tp_degree": "tensor_parallel_size"}
"""Export flags named otherwise than their field (optimum-neuron's established flag names)."""


@dataclass(frozen=True)
class NeuronConfig:
    """Static shapes, dtype, sampling and backend of an exported model. Validated when built."""

    batch_size: int = 1
    """Number of KV-cache slots, i.e. sequences decoded together by the token-generation graph."""
    sequence_length: int = 1024
    """Tokens per KV slot: the longest prompt plus generated tokens a sequence can hold."""
    prefill_chunk_size: int = 0
    """0 compiles a context-encoding graph ``[1, sequence_length]``; C > 0 a chunked-prefill graph
    ``[1, C]`` that prefills long prompts C tokens at a time instead."""
    tp_degree: int = 1
    """Tensor-parallel degree: the graphs of one rank of N (Megatron layout: attention heads, KV heads and the MLP
    split over the ranks, one all-reduce after the attention and one after the MLP), the same graph for every rank,
    each rank slicing its part of the one weight set at load. Served by vLLM with one worker process per rank
    (docs/parallelism.md)."""
    auto_cast_type: str = "fp32"
    """Weights, activations and KV-cache dtype: one of ``fp32``, ``bf16``, ``fp16``."""
    on_device_sampling: bool = True
    """Token generation samples inside the graph (returns token ids) instead of returning logits."""
    decode_logits: bool = True
    """Also compile a token-generation graph that returns logits (with on_device_sampling; without it, token
    generation returns logits already): the engine runs it only on steps where a decoding sequence needs its logits on
    the host (logprobs, vLLM's host sampling for penalties, min_p, min_tokens, logit_bias, bad words, allowed token
    ids and structured output, generate()'s scores); every other step keeps the on-device sampling graph. On by
    default, so that an artifact serves every request a vLLM client sends; it costs one more compiled graph, and
    nothing on the steps that do not run it (SmolLM2-135M fp32, batch 8, S 2048, C 256, inductor: export time +28%,
    artifact size +0.8%, peak memory unchanged). --no_decode_logits gives the minimal artifact, which refuses those
    requests."""
    prompt_logprobs: bool = False
    """Also compile a prefill graph that returns the logits of every real row of a chunk (or of the whole prompt for
    context encoding), run only for the chunks of a prompt whose logprobs are asked: vLLM's prompt_logprobs and
    echo with logprobs, NeuronModelForCausalLM.score(). Off: such requests are refused. Costs one more compiled
    graph, and [chunk, vocab] fp32 logits crossing to the host per such chunk."""
    speculation_length: int = 0
    """Speculative decoding: K > 0 also compiles a verification graph taking K + 1 tokens per row (the sequence's last
    token and K proposed ones, at consecutive positions, written to the cache like any token) and returning every
    column's logits, so one call checks K proposed tokens against what the model would have picked and keeps the
    longest run that agrees, plus the model's own next token: up to K + 1 tokens for one read of the weights.
    ``generate(prompt_lookup_num_tokens=k)`` proposes tokens by matching the sequence's last n-gram against its
    earlier tokens (transformers' prompt lookup), ``k <= K``. 0 compiles no verification graph
    (docs/speculative.md)."""
    mixed_batch: bool = False
    """Also compile a mixed graph: one call for a step's decoding rows (the token-generation rows, ``[batch_size,
    1]``) and one prefill chunk (``[1, C]``), where the runtime otherwise runs the token-generation graph and then the
    chunked-prefill graph. The linear layers multiply the decode rows and the chunk's tokens in one pass over the
    weights (a decode step's cost is that pass), each part attending as its own graph does; the decode rows' logits
    come back and are sampled on the host with the graph's own rule. The engine runs it whenever a step holds both
    decodes and a prefill chunk (vLLM's steps while a prompt is fed under running requests), so such a step costs
    one chunk call and its decode rows' share instead of a chunk call plus a decode call (SmolLM2, 2-core CPU: 3-6 %
    less a step; benchmark/README.md). Chunked
    prefill on inductor or eager (symbolic shapes: one graph serves every chunk length and both KV windows); a
    text-only artifact of one rank, without adapter slots. Costs one more compiled graph (docs/chunked-prefill.md)."""
    max_loras: int = 0
    """Multi-LoRA: N > 0 compiles every graph with N adapter slots on the decoder layers' linear projections
    (`lora_target_modules`): each one adds ``scaling * B[i] (A[i] x)`` for the adapter slot ``i`` of its row (token
    generation, verification) or chunk (prefill), slot 0 being the base model (all zeros). The stacked adapter tensors
    are bound like weights, not compiled in: PEFT adapters load and unload at run time without recompiling
    (``NeuronModelForCausalLM.load_adapter``, ``generate(adapter_name=...)``; docs/lora.md). 0 compiles none."""
    max_lora_rank: int = 0
    """Multi-LoRA: the largest adapter rank R the slots hold (a smaller rank is zero-padded); required with
    `max_loras`."""
    lora_target_modules: str = "all"
    """Multi-LoRA: the projections that take adapters, comma-separated leaf names (``q_proj,v_proj``), or ``all``:
    every linear projection of the decoder layers (attention and dense MLP, Phi-3's fused ones; not MoE routers or
    experts)."""
    kv_buckets: str = "auto"
    """KV-length buckets: the cache windows ``[0, W)`` a token-generation or chunked-prefill call may attend over,
    the engine running each call in the smallest window that covers what it reads, so attention costs what the
    live context needs instead of ``sequence_length``. ``auto``: powers of two from 256 (or from
    ``prefill_chunk_size`` when larger) below ``sequence_length``, then ``sequence_length``; ``none``: one window,
    ``sequence_length``; or increasing sizes ``W1,W2,...`` (``sequence_length`` is always added). Backends with
    static shapes (xla, neuron) compile one graph per window; inductor and eager compile the window as one symbolic
    dimension, so windows cost no export time there."""
    chunk_buckets: str = "auto"
    """Chunk-length buckets: the lengths a chunked-prefill call may run at, the engine padding each chunk to the
    shortest that holds its real tokens, so a short chunk (the tail of a prompt whose start the prefix cache holds, a
    short prompt, a piece vLLM's token budget leaves) costs what its tokens need instead of ``prefill_chunk_size``.
    ``auto``: on inductor and eager, every multiple of 16 below ``prefill_chunk_size``, 4 and 8, and the chunk itself
    (256: 4, 8, 16, 32, 48, ..., 240, 256), compiled as one symbolic dimension, so buckets cost no export time and a
    piece pads at most 15 tokens; on xla and neuron (static shapes: one graph per bucket and KV window),
    ``prefill_chunk_size`` alone. ``none``: ``prefill_chunk_size``
    alone; or increasing lengths ``L1,L2,...`` of at least 4 (``prefill_chunk_size`` is always added). Context
    encoding (``prefill_chunk_size`` 0) has no buckets."""
    kv_block_size: int = 0
    """Positions per block of the paged KV cache: the unit vLLM's KV cache manager (or, under ``generate()``, the
    engine's own allocator) hands a sequence, and the unit prefix caching reuses. It must divide ``sequence_length``
    and every KV window (a window reads whole blocks). 0 picks the largest of 32, 16, 8, 4, 2, 1 that does
    (docs/architecture.md, "The paged KV cache")."""
    kv_cache_tokens: int = 0
    """Positions the paged KV cache holds for all sequences together, a multiple of the block size and at least
    ``sequence_length``: its memory is ``kv_cache_tokens x layers x 2 x kv_heads x head_dim x dtype`` bytes (plus
    one scratch block). 0 is ``batch_size x sequence_length``, room for every slot at full length; a smaller pool
    serves ``batch_size`` sequences as long as their blocks fit (vLLM admits and preempts by blocks)."""
    max_topk: int = 256
    """Candidates every sampler keeps: the largest ``top_k`` a sampled request may ask for (a larger one is
    refused), and the tokens drawn from when it sets none."""
    image_tiles: int = 0
    """Image-text models: tiles per call of the vision-encoder graph (its compile-time batch). 0 for a text-only
    model; an image-text model's export sets it to the most tiles its processor makes of one image (every image is
    then encoded in one call), unless given."""
    image_size: int = 0
    """Image-text models: pixels per side of one tile, the vision-encoder graph's static tile shape. Set by the export
    from the model's processor (``max_image_size``); 0 for a text-only model."""
    max_images: int = 0
    """Image-text models: the most images one prompt may hold (a prompt with more is refused, naming this limit). 0
    for a text-only model; an image-text model's export defaults it to as many of the largest images as fit in
    sequence_length (at least 1)."""
    linear_kernel: str = "auto"
    """How the decoder's linear layers multiply: ``packed``, the toolkit's CPU kernel (weights packed once at load into
    16-column panels that every row of a call shares: a batch-8 decode step reads its weights once, as a batch-1 step
    does; fp32, eager and inductor backends on the CPU); ``aten``, torch's default linear on the checkpoint's layout
    (for comparison, and every other dtype, backend and device); ``auto``, ``packed`` where it applies, else ``aten``.
    The artifact stores the checkpoint's layout either way (docs/architecture.md, "Linear layers on the CPU")."""
    attention_kernel: str = "auto"
    """How the graphs attend over the paged KV cache: ``paged``, the toolkit's CPU kernels, which read each row's window
    blocks where they lie (token generation: `kernels.attention.paged_attention`; prefill chunks and verification rows
    over a float cache: `kernels.attention.chunk_attention`; fp32, eager and inductor backends on the CPU); ``sdpa``, a
    gather of the window's blocks then torch's ``scaled_dot_product_attention`` (for comparison, and every other dtype,
    backend and device); ``auto``, ``paged`` where it applies, else ``sdpa``."""
    weight_format: str = "float"
    """Weights of the decoder layers' linear projections: ``float`` (``auto_cast_type``), ``int8`` (per output channel,
    symmetric) or ``int4`` (per group of ``weight_group_size`` input columns, symmetric), quantized at export and stored
    quantized; a compressed-tensors checkpoint's own format is taken as it is (left at ``float``, or the same value;
    docs/export.md, "Pre-quantized checkpoints"); activations, the KV cache, embeddings, norms, MoE routers and
    experts stay in ``auto_cast_type``, the LM head too unless ``lm_head_format`` says otherwise. On the CPU in fp32
    the packed kernel reads the quantized bytes; elsewhere the graph dequantizes (docs/export.md, "Quantized
    weights")."""
    kv_cache_dtype: str = "auto"
    """Dtype of the paged KV cache: ``auto``, ``auto_cast_type`` (what the model computes in); ``int8``, each token's
    K and V of each KV head quantized when written (symmetric, ``scale = max|x| / 127`` over the head's values, computed
    in the graph: no calibration) and stored as int8 values plus one float32 scale per token and KV head, dequantized
    when read (the CPU decode kernel dequantizes each row as it reads it). A decode step then reads ``(head_dim + 4) /
    (head_dim x dtype bytes)`` of the float cache's bytes (fp32, head_dim 64: 27 %). Eager and inductor backends;
    fp8 is not implemented (docs/export.md, "Quantized KV cache")."""
    lm_head_format: str = "float"
    """The LM head's weights: ``float`` (``auto_cast_type``, as transformers) or ``int8`` (per vocabulary row,
    symmetric: ``weight_format``'s int8 scheme), quantized at export whatever ``weight_format`` is. A tied embedding
    table is the LM head: it is then stored once, in int8, and the token lookup reads the same int8 rows times their
    scales. The head is the largest single weight of a small model (SmolLM2: 113 of the 220 MB an int8 decode step
    reads); llama.cpp's Q8_0 and OpenVINO's int8 quantize it too (docs/export.md, "Quantized weights")."""
    int4_range: str = "symmetric"
    """int4 only: ``symmetric``, 15 levels, ``scale = max|w_group| / 7``, ``q`` in [-7, 7] (the default); ``full``,
    all 16 levels as llama.cpp's Q4_0: the group's weight of largest magnitude ``m`` gives ``scale = m / -8`` and ``q``
    in [-8, 7]. The same bytes, kernels and speed; on SmolLM2 the perplexity cost of int4 g64 falls from +54 % to
    +29 % (docs/export.md, "Quantized weights")."""
    quantization_method: str = "rtn"
    """How ``weight_format`` int8 / int4 picks its integer values and scales: ``rtn``, each weight rounded to nearest
    with the scheme's scale (the default: no data, exactly the documented scheme); ``gptq``, chosen against
    calibration text (the standard library's docstrings) so that each layer's outputs change least: GPTQ with scales
    searched per group (`optimum.neuron.gptq`). The same stored form, graphs, kernels and speed; SmolLM2 in int4 (g32,
    ``--int4_range full``, int8 head) then costs +5.8 % perplexity, where rounding costs +29 % to +54 %, for minutes
    of calibration at export, kept in the cache (docs/export.md, "Calibrated values (GPTQ)")."""
    weight_group_size: int = 0
    """int4 only: input columns per scale; 0 picks the largest of 128, 64, 32 that divides every quantized layer's
    input size (the export records the size it used)."""
    backend: str = "inductor"
    """Compile backend: ``inductor`` (AOTInductor packages), ``eager`` (reference), ``xla`` (HLO modules, needs
    .venv-xla), ``neuron`` (NOT AVAILABLE in this release: it needs the AWS Neuron SDK, torch-neuronx, and refuses
    every export; for Neuron devices use ``--backend xla --device neuron``)."""
    device: str = "cpu"
    """Device the graphs run on: ``cpu``; ``cuda`` (inductor/eager: written, not yet run on a GPU, see
    docs/cuda.md); ``neuron`` (xla or neuron backend, not verified)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Metadata read from the JSON beside the fields (versions, graphs, and under ``recorded`` what the exporter
    recorded about the compiled graphs: `artifact.head_record`); never affects compilation."""

    def __post_init__(self) -> None:
        for check in (
            _check_shapes,
            _check_chunk,
            _check_speculation,
            _check_kv_cache_dtype,
            _check_dtype_and_backend,
            _check_linear_kernel,
            _check_attention_kernel,
            _check_weight_format,
            _check_sampling,
            _check_buckets,
            _check_chunk_buckets,
            _check_kv_cache,
            _check_images,
            _check_lora,
            _check_mixed_batch,
        ):
            check(self)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The projection leaf names `lora_target_modules` names (the one rule that resolves ``all``); none without
        `max_loras`."""
        if not self.max_loras:
            return ()
        spec = self.lora_target_modules.strip()
        return LORA_PROJECTIONS if spec == "all" else tuple(name.strip() for name in spec.split(","))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by `auto_cast_type`."""
        return DTYPES[self.auto_cast_type]

    @property
    def kv_windows(self) -> tuple[int, ...]:
        """The KV windows `kv_buckets` names, increasing, the last one ``sequence_length`` (the one rule that
        resolves ``auto`` / ``none`` / a list)."""
        seq, chunk, spec = self.sequence_length, self.prefill_chunk_size, self.kv_buckets.strip().lower()
        if spec == "none":
            return (seq,)
        if spec == "auto":
            windows, size = [], max(AUTO_FIRST_WINDOW, chunk)
            while size < seq:
                windows.append(size)
                size *= 2
            return (*windows, seq)
        return _listed_sizes(spec, seq)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The chunk lengths `chunk_buckets` names, increasing, the last one ``prefill_chunk_size``; none for context
        encoding (the one rule that resolves ``auto`` / ``none`` / a list)."""
        chunk, spec = self.prefill_chunk_size, self.chunk_buckets.strip().lower()
        if not chunk:
            return ()
        if spec == "none" or (spec == "auto" and self.backend not in SYMBOLIC_SHAPE_BACKENDS):
            return (chunk,)
        if spec == "auto":
            sizes, size = {chunk, *range(AUTO_CHUNK_STEP, chunk, AUTO_CHUNK_STEP)}, SMALLEST_CHUNK_BUCKET
            while size < min(chunk, AUTO_CHUNK_STEP):
                sizes.add(size)
                size *= 2
            return tuple(sorted(sizes))
        return _listed_sizes(spec, chunk)

    @property
    def block_size(self) -> int:
        """Positions per KV block: `kv_block_size`, or for 0 the largest of `AUTO_BLOCK_SIZES` dividing the sequence
        length and every KV window (the one rule that resolves it)."""
        if self.kv_block_size:
            return self.kv_block_size
        sizes = (self.sequence_length, *self.kv_windows)
        return next(b for b in AUTO_BLOCK_SIZES if all(size % b == 0 for size in sizes))

    @property
    def cache_tokens(self) -> int:
        """Positions of the KV pool: `kv_cache_tokens`, or for 0 ``batch_size x sequence_length``."""
        return self.kv_cache_tokens or self.batch_size * self.sequence_length

    @property
    def kv_blocks(self) -> int:
        """Blocks of the KV cache: the pool's, plus block 0, the scratch block that takes every write of a token that
        is not real and that no sequence owns (vLLM's null block)."""
        return self.cache_tokens // self.block_size + 1

    @property
    def kv_int8(self) -> bool:
        """True when the KV cache holds int8 values and float32 scales (`kv_cache_dtype`)."""
        return self.kv_cache_dtype == "int8"

    @property
    def paged_attention(self) -> bool:
        """True when the graphs attend with the CPU kernels (`attention_kernel` resolved)."""
        if self.attention_kernel == "auto":
            return _packed_kernel_applies(self)
        return self.attention_kernel == "paged"

    @property
    def packed_linears(self) -> bool:
        """True when the decoder's linear layers run the packed CPU kernel (`linear_kernel` resolved)."""
        if self.linear_kernel == "auto":
            return _packed_kernel_applies(self)
        return self.linear_kernel == "packed"

    @property
    def cpu_kernels(self) -> bool:
        """True when the graphs call the toolkit's CPU kernels (packed linears or paged attention): the library is
        loaded, and on-device sampling takes its candidates from its `top_candidates` too."""
        return self.packed_linears or self.paged_attention

    def derive(self, **changes: Any) -> NeuronConfig:
        """A validated copy with ``changes`` applied (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def compile_fields(self) -> dict[str, Any]:
        """The fields that determine the compiled graphs."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}

    def cache_key(self, model_fingerprint: str) -> str:
        """A hash of these fields, the model, and the toolkit/torch versions: the export cache key."""
        payload = json.dumps(
            {"config": self.compile_fields(), "model": model_fingerprint, "versions": runtime_versions(self.backend)},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_json(self, graphs: list[str], recorded: dict[str, Any] | None = None) -> str:
        """Serialize with the versions that built it, the graph list, what the exporter ``recorded`` about the
        compiled graphs (`artifact.head_record`) and a hash of the fields."""
        fields = self.compile_fields()
        body = {
            **fields,
            "graphs": graphs,
            "kv_windows": list(self.kv_windows),
            "kv_cache": {"block_size": self.block_size, "blocks": self.kv_blocks, "tokens": self.cache_tokens},
            "versions": runtime_versions(self.backend),
            "hash": _fields_hash(fields),
        }
        if recorded:
            body["recorded"] = recorded
        return json.dumps(body, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NeuronConfig:
        """Parse and check a ``neuron_config.json``; raises `ArtifactError` when it does not fit."""
        body = _parse_json(text)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        fields = {k: v for k, v in body.items() if k in names}
        if _fields_hash(fields) != body.get("hash"):
            raise ArtifactError(f"{CONFIG_FILE} was edited or is corrupt (hash mismatch); re-export the model.")
        extra = {"graphs": body.get("graphs", []), "versions": body.get("versions", {})}
        if "recorded" in body:
            extra["recorded"] = body["recorded"]
        return cls(**fields, extra=extra)


def flag(name: str) -> str:
    """The ``optimum-cli export neuron`` flag that sets field ``name`` (a boolean field's switch: `switch`)."""
    return f"--{FLAG_NAMES.get(name, name)}"


def switch(name: str) -> str:
    """The export CLI switch of boolean field ``name``, which sets it away from its default: ``--<name>`` for a field
    off by default, ``--no_<name>`` for one on by default."""
    default = NeuronConfig.__dataclass_fields__[name].default
    assert isinstance(default, bool), f"{name} is not a boolean field"
    return f"--no_{flag(name).removeprefix('--')}" if default else flag(name)


def config_fields() -> list[dataclasses.Field]:
    """The fields of `NeuronConfig` a user sets (every field but ``extra``), in declaration order."""
    return [f for f in dataclasses.fields(NeuronConfig) if f.name != "extra"]


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's docstring (the string right after it in the class body), whitespace folded: the
    single source of the fields' documentation, the CLI's help included."""
    body = ast.parse(textwrap.dedent(inspect.getsource(NeuronConfig))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(text, str):
            docs[node.target.id] = " ".join(text.split())
    return docs


def runtime_versions(backend: str | None = None) -> dict[str, str]:
    """Versions that must match between export and load (for ``backend="xla"``, torch-xla's too)."""
    versions = {"optimum-neuronx": __version__, "torch": torch.__version__.split("+")[0]}
    if backend == "xla":
        from .backends.xla_compat import installed_version  # reads metadata only: torch-xla is not imported

        versions["torch-xla"] = (installed_version() or "not installed").split("+")[0]
    return versions


def _parse_json(text: str) -> dict[str, Any]:
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{CONFIG_FILE} is not valid JSON ({err}); re-export the model.") from err
    if not isinstance(body, dict):
        raise ArtifactError(f"{CONFIG_FILE} is not a JSON object; re-export the model.")
    return body


def _fields_hash(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _positive(config: NeuronConfig, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise IncompatibleConfigError(f"{name} must be a positive integer, got {value!r}: pass {flag(name)} N, N >= 1.")


def _check_shapes(config: NeuronConfig) -> None:
    for name in ("batch_size", "sequence_length", "max_topk"):
        _positive(config, name)
    _positive(config, "tp_degree")
    if config.tp_degree > 1 and config.backend not in ("eager", "inductor"):
        why = (
            " (torch-xla 2.9 traces the all-reduce into the HLO module but cannot run it across ranks on XLA:CPU: a "
            "process is a world of one device, where the all-reduce returns its input, and CPU_NUM_DEVICES threads "
            "deadlock in XLA's rendezvous, so a tensor-parallel xla artifact cannot be checked; docs/xla.md)"
            if config.backend == "xla"
            else ""
        )
        raise IncompatibleConfigError(
            f"tensor parallelism is implemented for the eager and inductor backends, not {config.backend!r}{why}: "
            f"export with {flag('tp_degree')} 1 or --backend inductor (docs/parallelism.md)."
        )


def _check_chunk(config: NeuronConfig) -> None:
    chunk, seq = config.prefill_chunk_size, config.sequence_length
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 <= chunk <= seq:
        raise IncompatibleConfigError(
            f"prefill_chunk_size={chunk!r} must be 0 (context encoding) or between 1 and "
            f"sequence_length={seq}: lower --prefill_chunk_size or raise --sequence_length."
        )


def _check_speculation(config: NeuronConfig) -> None:
    k, seq = config.speculation_length, config.sequence_length
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < seq:
        raise IncompatibleConfigError(
            f"speculation_length={k!r} must be 0 (no verification graph) or between 1 and sequence_length - 1 "
            f"({seq - 1}): pass {flag('speculation_length')} K with a small K (2 to 8 is usual)."
        )


def _check_dtype_and_backend(config: NeuronConfig) -> None:
    for name, allowed in CHOICES.items():
        value = getattr(config, name)
        if value not in allowed:
            raise IncompatibleConfigError(
                f"{name}={value!r} is not one of {list(allowed)}: pass {flag(name)} {allowed[0]} "
                f"(or {', '.join(allowed[1:])})."
            )
    if config.backend == "xla" and config.device == "cuda":
        raise IncompatibleConfigError(
            "backend='xla' runs on --device cpu (XLA:CPU) or --device neuron (the Neuron PJRT device); for CUDA "
            "use --backend inductor --device cuda."
        )
    neuron_pair = (config.backend == "neuron") == (config.device == "neuron")
    if not neuron_pair and config.backend != "xla":
        raise IncompatibleConfigError(
            f"backend={config.backend!r} cannot run on device={config.device!r}: the neuron device needs "
            "--backend neuron (or xla), and --backend neuron needs --device neuron."
        )


def _packed_kernel_applies(config: NeuronConfig) -> bool:
    """Where the toolkit's CPU kernels run (packed linears, paged attention): fp32 graphs on the CPU, eager or
    inductor backend."""
    return config.device == "cpu" and config.backend in ("eager", "inductor") and config.auto_cast_type == "fp32"


def _check_linear_kernel(config: NeuronConfig) -> None:
    _check_cpu_kernel(config, "linear_kernel", "packed", "aten")


def _check_attention_kernel(config: NeuronConfig) -> None:
    _check_cpu_kernel(config, "attention_kernel", "paged", "sdpa")


def _check_cpu_kernel(config: NeuronConfig, field: str, kernel: str, fallback: str) -> None:
    """Refuse ``field=kernel`` (a toolkit CPU kernel) where it does not run, naming the flag and its fallback."""
    if getattr(config, field) == kernel and not _packed_kernel_applies(config):
        raise IncompatibleConfigError(
            f"{field}={kernel!r} runs fp32 graphs on the CPU with the eager or inductor backend, not "
            f"{config.auto_cast_type} on {config.device} with {config.backend}: pass {flag(field)} auto (or "
            f"{fallback}), or export fp32 for the CPU."
        )


def _check_weight_format(config: NeuronConfig) -> None:
    group = config.weight_group_size
    if not isinstance(group, int) or isinstance(group, bool) or group < 0:
        raise IncompatibleConfigError(
            f"weight_group_size must be a non-negative integer, got {group!r}: pass {flag('weight_group_size')} G "
            "(0: the largest of 128, 64, 32 that fits)."
        )
    if group and config.weight_format != "int4":
        raise IncompatibleConfigError(
            f"weight_group_size={group} applies to {flag('weight_format')} int4 only (int8 has one scale per output "
            f"channel): drop {flag('weight_group_size')} or pass {flag('weight_format')} int4."
        )
    if config.int4_range != "symmetric" and config.weight_format != "int4":
        raise IncompatibleConfigError(
            f"int4_range={config.int4_range!r} applies to {flag('weight_format')} int4 only: drop "
            f"{flag('int4_range')} or pass {flag('weight_format')} int4."
        )
    if config.quantization_method != "rtn" and config.weight_format == "float":
        raise IncompatibleConfigError(
            f"quantization_method={config.quantization_method!r} chooses quantized weights: pass "
            f"{flag('weight_format')} int8 or int4, or drop {flag('quantization_method')}."
        )
    if group % 2:
        raise IncompatibleConfigError(
            f"weight_group_size={group} must be even (two int4 values share a byte): pass {flag('weight_group_size')} "
            "32, 64 or 128."
        )


def _check_kv_cache_dtype(config: NeuronConfig) -> None:
    """fp8 is named as not implemented; an int8 KV cache compiles on the eager and inductor backends only (any other
    bad value: `_check_dtype_and_backend`)."""
    value = config.kv_cache_dtype
    if isinstance(value, str) and value.lower().startswith(("fp8", "float8")):
        raise IncompatibleConfigError(
            f"kv_cache_dtype={value!r}: an fp8 KV cache is not implemented in this release: pass "
            f"{flag('kv_cache_dtype')} int8 (half the bytes of a bf16 cache) or auto."
        )
    if value == "int8" and config.backend in BACKENDS and config.backend not in KV_INT8_BACKENDS:
        raise IncompatibleConfigError(
            f"kv_cache_dtype='int8' is implemented for the {' and '.join(KV_INT8_BACKENDS)} backends, not "
            f"{config.backend!r} (not built nor checked there): pass {flag('kv_cache_dtype')} auto, or "
            f"--backend {KV_INT8_BACKENDS[1]}."
        )


def _check_sampling(config: NeuronConfig) -> None:
    for name in ("on_device_sampling", "decode_logits", "prompt_logprobs"):
        if not isinstance(getattr(config, name), bool):
            raise IncompatibleConfigError(f"{name} must be a bool, got {getattr(config, name)!r}.")


def _check_buckets(config: NeuronConfig) -> None:
    """`kv_buckets` must be ``auto``, ``none`` or increasing window sizes in ``[max(C, 2), sequence_length]``."""
    fix = f"pass {flag('kv_buckets')} auto, none, or increasing sizes such as 256,512 (sequence_length is added)."
    sizes = _bucket_list(config, "kv_buckets", fix)
    if sizes is None:
        return
    smallest = max(config.prefill_chunk_size, 2)
    if sizes[0] < smallest or sizes[-1] > config.sequence_length:
        raise IncompatibleConfigError(
            f"kv_buckets={config.kv_buckets!r}: every window must lie between {smallest} (the prefill chunk, at least "
            f"2) and sequence_length={config.sequence_length}: {fix}"
        )


def _check_chunk_buckets(config: NeuronConfig) -> None:
    """`chunk_buckets` must be ``auto``, ``none`` or increasing lengths in ``[4, prefill_chunk_size]``, and a list needs
    a chunked-prefill artifact."""
    spec, chunk = config.chunk_buckets, config.prefill_chunk_size
    fix = f"pass {flag('chunk_buckets')} auto, none, or increasing lengths such as 64,128 (the chunk size is added)."
    sizes = _bucket_list(config, "chunk_buckets", fix)
    if sizes is None:
        return
    if not chunk:
        raise IncompatibleConfigError(
            f"chunk_buckets={spec!r} needs chunked prefill: context encoding runs the whole sequence length in one "
            f"call; pass {flag('prefill_chunk_size')} C, or leave {flag('chunk_buckets')} at auto."
        )
    if sizes[0] < SMALLEST_CHUNK_BUCKET or sizes[-1] > chunk:
        raise IncompatibleConfigError(
            f"chunk_buckets={spec!r}: every length must lie between {SMALLEST_CHUNK_BUCKET} and prefill_chunk_size="
            f"{chunk}: {fix}"
        )


def _bucket_list(config: NeuronConfig, name: str, fix: str) -> tuple[int, ...] | None:
    """The sizes the bucket field ``name`` (`kv_buckets`, `chunk_buckets`) lists, checked to be a string of strictly
    increasing integers; None for ``auto`` or ``none``. The caller checks their range."""
    spec = getattr(config, name)
    if not isinstance(spec, str):
        raise IncompatibleConfigError(f"{name} must be a string, got {spec!r}: {fix}")
    if spec.strip().lower() in ("auto", "none"):
        return None
    try:
        sizes = _parsed_sizes(spec)
    except ValueError:
        raise IncompatibleConfigError(f"{name}={spec!r} is not auto, none or a list of integers: {fix}") from None
    if any(b <= a for a, b in itertools.pairwise(sizes)):
        raise IncompatibleConfigError(f"{name}={spec!r} must be strictly increasing: {fix}")
    return sizes


def _parsed_sizes(spec: str) -> tuple[int, ...]:
    """The integers of a bucket list ``A,B,...`` (`ValueError` when one is not)."""
    return tuple(int(part) for part in spec.split(","))


def _listed_sizes(spec: str, top: int) -> tuple[int, ...]:
    """The sizes a checked bucket list names, ``top`` (the sequence length, the chunk size) appended unless it is the
    last (the one rule that resolves a list for `NeuronConfig.kv_windows` and `NeuronConfig.chunk_sizes`)."""
    sizes = _parsed_sizes(spec)
    return sizes if sizes[-1] == top else (*sizes, top)


def _check_kv_cache(config: NeuronConfig) -> None:
    """`kv_block_size` divides the sequence length and every KV window; `kv_cache_tokens` is whole blocks and holds one
    sequence of ``sequence_length``."""
    for name in ("kv_block_size", "kv_cache_tokens"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise IncompatibleConfigError(
                f"{name} must be a non-negative integer, got {value!r}: pass {flag(name)} N (0: the default)."
            )
    block, sizes = config.kv_block_size, (config.sequence_length, *config.kv_windows)
    if block and any(size % block for size in sizes):
        raise IncompatibleConfigError(
            f"kv_block_size={block} must divide sequence_length={config.sequence_length} and every KV window "
            f"{list(config.kv_windows)} (a window reads whole blocks): pass {flag('kv_block_size')} with a divisor of "
            f"them, e.g. {_largest_divisor(sizes, block)}, or 0 for the default."
        )
    tokens, block = config.kv_cache_tokens, config.block_size
    if tokens and (tokens % block or tokens < config.sequence_length):
        raise IncompatibleConfigError(
            f"kv_cache_tokens={tokens} must be a multiple of the block size {block} and at least sequence_length="
            f"{config.sequence_length} (one sequence at full length fits): pass {flag('kv_cache_tokens')} "
            f"{max(config.sequence_length, -(-tokens // block) * block)}, or 0 for batch_size x sequence_length."
        )


def _largest_divisor(sizes: tuple[int, ...], below: int) -> int:
    """The largest block size up to ``below`` dividing every one of ``sizes`` (1 at worst)."""
    return next(b for b in range(below, 0, -1) if all(size % b == 0 for size in sizes))


def _check_images(config: NeuronConfig) -> None:
    for name in ("image_tiles", "image_size", "max_images"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise IncompatibleConfigError(
                f"{name} must be a non-negative integer, got {value!r}: pass {flag(name)} N >= 0 (0: from the model)."
            )


def load_config_file(text: str) -> NeuronConfig:
    """Parse ``neuron_config.json`` and refuse an artifact made by other toolkit/torch versions (checked
    first: another version may have other fields, which is not corruption)."""
    body = _parse_json(text)
    found, expected = body.get("versions", {}), runtime_versions(body.get("backend"))
    if found != expected:
        where = " or load it in .venv-xla (make install-xla)" if "torch-xla" in found else ""
        raise ArtifactError(
            f"artifact was exported with {found}, this environment has {expected}: re-export the model "
            f"with this environment (optimum-cli export neuron ...){where}."
        )
    return NeuronConfig.from_json(text)


LORA_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
)
"""The linear projections of a decoder layer that can take adapters (``all``): attention, dense MLP, fused Phi-3."""


def _check_lora(config: NeuronConfig) -> None:
    """`max_loras` and `max_lora_rank` are both 0 or both positive, the targets are known projections, and what
    multi-LoRA does not cover is refused."""
    n, r = config.max_loras, config.max_lora_rank
    for name, value in (("max_loras", n), ("max_lora_rank", r)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise IncompatibleConfigError(f"{name}={value!r} must be a whole number >= 0: pass {flag(name)} N.")
    if bool(n) != bool(r):
        raise IncompatibleConfigError(
            f"max_loras={n} and max_lora_rank={r}: multi-LoRA needs both, e.g. {flag('max_loras')} 4 "
            f"{flag('max_lora_rank')} 16 (or neither)."
        )
    unknown = [t for t in config.lora_targets if t not in LORA_PROJECTIONS]
    if unknown or (n and not config.lora_targets):
        raise IncompatibleConfigError(
            f"lora_target_modules={config.lora_target_modules!r} names {unknown or 'nothing'}: pass "
            f"{flag('lora_target_modules')} all, or some of {', '.join(LORA_PROJECTIONS)}."
        )


def _check_mixed_batch(config: NeuronConfig) -> None:
    """`mixed_batch` is a bool, and what the mixed graph does not cover is refused, naming the flag to change."""
    if not isinstance(config.mixed_batch, bool):
        raise IncompatibleConfigError(f"mixed_batch must be a bool, got {config.mixed_batch!r}.")
    if not config.mixed_batch:
        return
    why = None
    if not config.prefill_chunk_size:
        why = "it joins decode rows with a prefill chunk: export with --prefill_chunk_size C"
    elif config.backend not in SYMBOLIC_SHAPE_BACKENDS:
        why = (
            f"on {config.backend!r} (static shapes) it would be compiled once per chunk length and pair of KV windows: "
            "export with --backend inductor or eager"
        )
    elif config.image_tiles:
        why = "an image-text artifact's chunks splice image rows, which the mixed graph does not take"
    elif config.max_loras:
        why = "adapter slots select a LoRA adapter per row, and the mixed graph's chunk tokens share one row"
    elif config.tp_degree > 1:
        why = f"it is not verified on tensor-parallel ranks yet: export with {flag('tp_degree')} 1"
    if why is not None:
        raise IncompatibleConfigError(f"{switch('mixed_batch')} is not available here: {why} (or leave it out).")

"""Graph kinds and their static signatures: the single source of what each compiled graph takes.

A graph is always named explicitly by its `GraphKind`; nothing infers the kind from a tensor shape.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .config import SMALLEST_CHUNK_BUCKET, SYMBOLIC_SHAPE_BACKENDS, NeuronConfig


class GraphKind(str, enum.Enum):
    """The compiled graphs of an artifact (DESIGN.md §2)."""

    CONTEXT_ENCODING = "context_encoding"
    """``[1, sequence_length]`` tokens of one sequence from position 0; returns last-token logits."""
    CHUNKED_PREFILL = "chunked_prefill"
    """``[1, prefill_chunk_size]`` tokens of one sequence at any offset; returns last-token logits."""
    TOKEN_GENERATION = "token_generation"
    """``[batch_size, 1]``: one token per KV slot; returns sampled tokens or logits."""
    VERIFICATION = "verification"
    """``[batch_size, speculation_length + 1]``: per KV slot its last token and the tokens proposed after it, at
    consecutive positions; returns the logits of every column ``[B, K + 1, V]`` (speculative decoding). On the CPU
    kernels of a symbolic-shape backend its columns are packed instead (`GraphSpec.packed`): ``[1, N]``, each
    decoding sequence's last token and proposals one after another, ``N`` a symbolic dimension; ``[1, N, V]``."""
    MIXED = "mixed"
    """``--mixed_batch``: the token-generation rows ``[batch_size, 1]`` and one sequence's prefill chunk ``[1, C]`` in
    one call, the decode rows as token generation reads and writes them, the chunk as chunked prefill does; returns the
    logits of every decode row and of the chunk's last real token ``[batch_size + 1, V]``."""
    VISION_ENCODER = "vision_encoder"
    """Image-text artifacts: ``[image_tiles, 3, image_size, image_size]`` pixels -> the image rows the prefill graphs
    splice in, ``[image_tiles * rows_per_tile, hidden]``. Never touches the KV cache."""

    @property
    def is_prefill(self) -> bool:
        """True for the graphs that feed one sequence's prompt tokens."""
        return self in (GraphKind.CONTEXT_ENCODING, GraphKind.CHUNKED_PREFILL)


@dataclass(frozen=True)
class GraphSpec:
    """One compiled graph of an artifact: its kind and static shape contract, derived from a `NeuronConfig`.
    An artifact may hold several graphs of one kind (variants); `name` tells them apart."""

    kind: GraphKind
    batch: int
    """Rows of ``input_ids``: 1 for prefill graphs, the cache's ``batch_size`` for token generation and verification."""
    tokens: int
    """Columns of ``input_ids``: chunk or sequence length for prefill, 1 for token generation, ``speculation_length +
    1`` for verification."""
    samples_on_device: bool
    """True when the graph returns sampled token ids instead of logits."""
    all_rows: bool = False
    """Prefill graphs: True when the graph returns the logits of every column ``[tokens, V]`` (the runtime keeps
    the real rows, told by the actual-tokens mask) instead of the last real token's ``[1, V]``: prompt logprobs."""
    windows: tuple[int, ...] = ()
    """The KV windows the graph can attend over (a sequence's positions ``[0, W)`` written by earlier calls, read
    through the first ``W / block_size`` columns of its block table): one for a graph compiled per window, every window
    of the artifact for a graph whose window is a symbolic dimension, none for a graph that reads no earlier cache
    (context encoding)."""
    sequence_length: int = 0
    """The artifact's ``sequence_length``: the window that needs no suffix in the name."""
    images: bool = False
    """Prefill graphs of an image-text artifact: they also take ``image_embeds [1, tokens, hidden]`` and
    ``image_mask [1, tokens]`` and splice those rows over the token embeddings (`models.layers.splice`)."""
    image_size: int = 0
    """The vision encoder: pixels per side of a tile (``batch`` is the tiles per call)."""
    block_size: int = 1
    """Positions per block of the paged KV cache: a graph reading the cache in window ``W`` takes a block table of
    ``W / block_size`` columns."""
    chunks: tuple[int, ...] = ()
    """Chunked prefill: the chunk lengths (chunk-length buckets) the graph runs at, ``tokens`` being the longest: one
    for a graph compiled per length, several for a graph whose token columns are a symbolic dimension; verification:
    the columns per row it runs at (`verification_widths`); none for the other kinds (their ``tokens`` is fixed)."""
    chunk_size: int = 0
    """Chunked prefill: the artifact's ``prefill_chunk_size``, the length that needs no suffix in the name
    (verification: ``speculation_length + 1``)."""
    adapters: bool = False
    """Multi-LoRA (``--max_loras``): the graph also takes ``adapter_ids [batch]``, each row's adapter slot (last)."""
    packed: bool = False
    """Verification with its columns packed in one row (`packed_verification`): ``input_ids``, ``position_ids`` and
    ``slot_mapping`` ``[1, N]`` hold each decoding sequence's last token and proposed tokens one after another, and
    ``block_table [N, W / block_size]`` gives each column its sequence's blocks, so a call computes the columns its
    sequences fill (a sequence proposing nothing: one; a free slot: none), not ``batch_size`` rows as wide as the
    longest proposal. ``tokens`` is the most columns a call can hold, ``batch_size * (K + 1)``."""

    @property
    def name(self) -> str:
        """The graph's name in its artifact (file name, manifest key, engine table, logs): the kind, then what a
        variant returns (``_all_rows``: every row's logits; ``_logits``: token generation returning logits), then
        ``_c<L>`` for a chunked-prefill graph compiled for one chunk length ``L`` shorter than the chunk size, and
        ``_w<W>`` for a graph compiled for one window ``W`` smaller than the sequence length."""
        name = self.kind.value
        if self.all_rows:
            name += "_all_rows"
        elif self.kind is GraphKind.TOKEN_GENERATION and not self.samples_on_device:
            name += "_logits"
        if len(self.chunks) == 1 and self.chunks[0] != self.chunk_size:
            name += f"_c{self.chunks[0]}"
        if len(self.windows) == 1 and self.windows[0] != self.sequence_length:
            name += f"_w{self.windows[0]}"
        return name

    @property
    def takes_logits_flag(self) -> bool:
        """True for a chunked-prefill graph returning the last real token's logits: it also takes ``wants_logits
        [1]`` (bool, its last input), False for a chunk before its prompt's last, whose logits the runtime drops;
        there the LM head is skipped and the graph returns zeros (`StaticDecoder._logits_when`)."""
        return self.kind is GraphKind.CHUNKED_PREFILL and not self.all_rows

    @property
    def symbolic_window(self) -> bool:
        """True when one compiled graph serves several windows (the window is a symbolic dimension)."""
        return len(self.windows) > 1

    @property
    def symbolic_chunk(self) -> bool:
        """True when one compiled graph serves several chunk lengths (the token columns are a symbolic dimension)."""
        return len(self.chunks) > 1


def graph_specs(config: NeuronConfig) -> tuple[GraphSpec, ...]:
    """Every graph of an artifact built from ``config``, prefill first: the prefill graph (and its all-rows
    variant with ``prompt_logprobs``), the token-generation graph (and, when it samples on device, its
    logits-returning variant with ``decode_logits``), the verification graph with ``speculation_length``; on a
    static-shape backend each once per KV window and chunk bucket (the variants run only for requests that ask for
    logits: in the full window and chunk only)."""
    prefill = dataclasses.replace(graph_spec(config, prefill_kind(config)), images=config.image_tiles > 0)
    token_generation = graph_spec(config, GraphKind.TOKEN_GENERATION)
    specs = [*_as_compiled(prefill, config)]
    if config.prompt_logprobs:
        specs.extend(_as_compiled(dataclasses.replace(prefill, all_rows=True), config, full_only=True))
    specs.extend(_as_compiled(token_generation, config))
    if token_generation.samples_on_device and config.decode_logits:
        logits = dataclasses.replace(token_generation, samples_on_device=False)
        specs.extend(_as_compiled(logits, config, full_only=True))
    if config.speculation_length:
        specs.extend(_as_compiled(graph_spec(config, GraphKind.VERIFICATION), config))
    if config.mixed_batch:
        specs.extend(_as_compiled(graph_spec(config, GraphKind.MIXED), config))
    if config.max_loras:
        specs = [dataclasses.replace(spec, adapters=True) for spec in specs]
    if config.image_tiles:
        specs.append(GraphSpec(GraphKind.VISION_ENCODER, config.image_tiles, 0, False, image_size=config.image_size))
    return tuple(specs)


SPEC_FIELDS = (
    "prefill_chunk_size",
    "kv_buckets",
    "chunk_buckets",
    "on_device_sampling",
    "decode_logits",
    "prompt_logprobs",
    "speculation_length",
    "mixed_batch",
    "image_tiles",
    "image_size",
    "max_images",
    "quantization_method",
)
"""The `NeuronConfig` fields that reach a compiled graph only through its `GraphSpec` (which graphs exist, their
tokens, KV windows, outputs and image shape) or not at all (``quantization_method`` picks weight values, which every
backend binds at load): `graph_fields` leaves them out."""


def graph_fields(config: NeuronConfig) -> dict[str, object]:
    """The fields of ``config`` that shape every one of its graphs beyond the graph's `GraphSpec` (the cache rows, the
    sequence length, dtype, tensor parallelism, linear kernel, backend, device...): with the spec, the config part of
    a graph's cache key. A field not named in `SPEC_FIELDS` is in, so a new field can cost cache hits, never reuse a
    graph compiled for another value."""
    return {name: value for name, value in config.compile_fields().items() if name not in SPEC_FIELDS}


def _as_compiled(spec: GraphSpec, config: NeuronConfig, full_only: bool = False) -> list[GraphSpec]:
    """``spec`` as compiled: one graph for all windows and chunk lengths on a symbolic-shape backend, else one graph
    per window and chunk length (only the full ones with ``full_only``)."""
    if config.backend in SYMBOLIC_SHAPE_BACKENDS:
        return [spec]
    windows: list[tuple[int, ...]] = [(w,) for w in (spec.windows[-1:] if full_only else spec.windows)] or [()]
    chunks: list[tuple[int, ...]] = [(c,) for c in (spec.chunks[-1:] if full_only else spec.chunks)] or [()]
    replace = dataclasses.replace
    return [replace(spec, windows=w, chunks=c, tokens=c[0] if c else spec.tokens) for c in chunks for w in windows]


def compiled_form(spec: GraphSpec) -> GraphSpec:
    """The graph compiled (and keyed in the per-graph cache) for ``spec``: a symbolic dimension spans every size the
    sequence length allows, not only the artifact's own buckets, so that artifacts differing only in
    ``prefill_chunk_size``, ``chunk_buckets`` or ``kv_buckets`` share their graphs (each runtime pads its calls to
    its own artifact's buckets). Symbolic token columns span `SMALLEST_CHUNK_BUCKET` to the sequence length, a
    symbolic window two blocks (one when the artifact's smallest window is one) to the sequence length; both are
    traced at the sequence length. (Traced at 256 or 2,048 tokens, SmolLM2's prefill of 100, 256 and 1,024 tokens ran
    within 1 % of the graph traced at its 256-token chunk.) The name is the spec's: the artifact's graph file is this
    graph."""
    form, top = spec, spec.sequence_length
    if spec.symbolic_chunk and spec.kind is GraphKind.VERIFICATION:  # traced at its widest, K + 1
        form = dataclasses.replace(form, chunks=(spec.chunks[0], spec.chunks[-1]))
    elif spec.symbolic_chunk:
        form = dataclasses.replace(form, chunks=(SMALLEST_CHUNK_BUCKET, top), tokens=top, chunk_size=top)
    if spec.symbolic_window:
        form = dataclasses.replace(form, windows=(min(2 * spec.block_size, spec.windows[0]), top))
    assert form.name == spec.name, (form.name, spec.name)
    return form


class GraphCall(NamedTuple):
    """How one call runs: the graph, the KV window it reads (0 for a graph reading no earlier cache) and the token
    columns its inputs are padded to (a chunk-length bucket for chunked prefill, the graph's fixed ``tokens`` for the
    other kinds)."""

    spec: GraphSpec
    window: int
    tokens: int


def select_graph(
    specs: Iterable[GraphSpec],
    kind: GraphKind,
    *,
    logits: bool = False,
    all_rows: bool = False,
    reach: int = 0,
    tokens: int = 0,
) -> GraphCall | None:
    """The graph of ``kind`` among ``specs`` that serves a call reading cache positions ``[0, reach)`` with ``tokens``
    real tokens per row, the window to run it in (the smallest that covers ``reach``) and the columns to pad to (the
    shortest chunk bucket that holds ``tokens``); None when there is none. With ``all_rows`` the prefill graph
    returning every row's logits; with ``logits`` a token-generation graph returning logits; otherwise the default
    graph (for token generation, the one sampling on device when there is one)."""
    found = [s for s in specs if s.kind is kind and s.all_rows == all_rows and not (logits and s.samples_on_device)]
    if not found:
        return None
    best = max(s.samples_on_device for s in found)
    options = [
        GraphCall(s, w, c)
        for s in found
        if s.samples_on_device == best
        for w in s.windows or (0,)
        if w >= reach
        for c in s.chunks or (s.tokens,)
        if c >= tokens
    ]
    return min(options, key=lambda call: (call.window, call.tokens)) if options else None


def window_spans(specs: Iterable[GraphSpec]) -> dict[str, tuple[int, int]]:
    """The KV windows each graph of ``specs`` whose window is a symbolic dimension is compiled for (its
    `compiled_form`'s lowest and highest), by name: what an artifact's manifest records."""
    forms = {spec.name: compiled_form(spec) for spec in specs if spec.symbolic_window}
    return {name: (form.windows[0], form.windows[-1]) for name, form in forms.items()}


def exact_window(call: GraphCall, span: tuple[int, int] | None, reach: int) -> GraphCall:
    """``call`` in the fewest whole blocks that cover cache positions ``[0, reach)`` when its graph's window is a
    symbolic dimension compiled over the windows ``span`` (`compiled_form`, recorded in the artifact's manifest), never
    below the span nor above ``call``'s bucket: keys past the reach are masked, reading them only costs time (a prompt's
    first chunk attended its whole smallest bucket of masked keys). Unchanged for a static window or an artifact that
    records no span."""
    if span is None or not call.spec.symbolic_window:
        return call
    block = call.spec.block_size
    return call._replace(window=min(call.window, max(span[0], -(-reach // block) * block)))


def graph_kinds(config: NeuronConfig) -> tuple[GraphKind, ...]:
    """The graphs an artifact built from ``config`` contains: exactly one prefill graph, plus TG."""
    prefill = GraphKind.CHUNKED_PREFILL if config.prefill_chunk_size else GraphKind.CONTEXT_ENCODING
    return (prefill, GraphKind.TOKEN_GENERATION)


def prefill_kind(config: NeuronConfig) -> GraphKind:
    """The prefill graph kind of ``config``."""
    return graph_kinds(config)[0]


def graph_spec(config: NeuronConfig, kind: GraphKind) -> GraphSpec:
    """The signature of graph ``kind`` under ``config``, serving every KV window (and chunk length) of the artifact."""
    seq, windows, block = config.sequence_length, config.kv_windows, config.block_size
    if kind is GraphKind.TOKEN_GENERATION:
        return GraphSpec(kind, config.batch_size, 1, config.on_device_sampling, False, windows, seq, block_size=block)
    if kind is GraphKind.VERIFICATION and packed_verification(config):
        most = config.batch_size * (config.speculation_length + 1)
        return GraphSpec(
            kind, 1, most, False, False, windows, seq, block_size=block,
            chunks=tuple(range(SMALLEST_VERIFICATION, most + 1)), chunk_size=most, packed=True,
        )  # fmt: skip
    if kind is GraphKind.VERIFICATION:
        return GraphSpec(
            kind, config.batch_size, config.speculation_length + 1, False, False, windows, seq, block_size=block,
            chunks=verification_widths(config), chunk_size=config.speculation_length + 1,
        )  # fmt: skip
    if kind in (GraphKind.CHUNKED_PREFILL, GraphKind.MIXED):  # mixed: `batch` decode rows beside the chunk
        chunks, chunk = config.chunk_sizes, config.prefill_chunk_size
        rows = config.batch_size if kind is GraphKind.MIXED else 1
        return GraphSpec(
            kind, rows, chunk, False, False, windows, seq, block_size=block, chunks=chunks, chunk_size=chunk
        )  # fmt: skip
    return GraphSpec(kind, 1, seq, False, False, (), seq, block_size=block)


def verification_widths(config: NeuronConfig) -> tuple[int, ...]:
    """The columns per row a verification call runs at: on a symbolic-shape backend every width from
    `SMALLEST_VERIFICATION` to ``speculation_length + 1`` (one graph, its columns a symbolic dimension), so a call whose
    rows propose at most k tokens computes k + 1 columns, not K + 1; on a static-shape backend K + 1 alone."""
    most = config.speculation_length + 1
    if config.backend not in SYMBOLIC_SHAPE_BACKENDS or most <= SMALLEST_VERIFICATION:
        return (most,)
    return tuple(range(SMALLEST_VERIFICATION, most + 1))


SMALLEST_VERIFICATION = 2
"""The narrowest verification call: a sequence's last token and one proposed token."""


def packed_verification(config: NeuronConfig) -> bool:
    """Whether the verification graph packs its columns (`GraphSpec.packed`): on a symbolic-shape backend attending
    with the CPU kernels, where every column already attends on its own (`VerifyContext`), without adapter slots (a
    LoRA adapter is chosen per row). At batch 8 on SmolLM2, rows padded to the longest proposal computed up to 3x the
    columns the sequences filled, in linear layers bound by their multiply-adds at that size (docs/speculative.md)."""
    return config.backend in SYMBOLIC_SHAPE_BACKENDS and config.paged_attention and not config.max_loras


def example_inputs(spec: GraphSpec) -> dict[str, torch.Tensor]:
    """Per-call inputs of graph ``spec`` (the KV cache is passed separately), valid for tracing: every token writes
    to the scratch block; a graph that reads the cache gets a block table of its largest window (all scratch); the
    image rows of an image-text prefill graph come from `image_row_inputs`."""
    if spec.kind is GraphKind.VISION_ENCODER:
        return {"pixel_values": torch.zeros(spec.batch, 3, spec.image_size, spec.image_size)}
    if spec.kind is GraphKind.MIXED:
        return mixed_example_inputs(spec)
    ids = torch.zeros(spec.batch, spec.tokens, dtype=torch.long)
    positions = torch.arange(spec.tokens, dtype=torch.long).expand(spec.batch, -1).contiguous()
    inputs = {"input_ids": ids, "position_ids": positions, "slot_mapping": torch.zeros_like(ids)}
    if spec.windows:  # a packed verification graph: one table row per column
        tables = spec.tokens if spec.packed else spec.batch
        inputs["block_table"] = torch.zeros(tables, max(spec.windows) // spec.block_size, dtype=torch.long)
    if spec.samples_on_device:
        inputs.update(sampling_inputs(spec.batch))
    if spec.adapters:
        inputs["adapter_ids"] = torch.zeros(spec.batch, dtype=torch.long)
    if spec.takes_logits_flag:
        inputs["wants_logits"] = torch.ones(1, dtype=torch.bool)
    return inputs


MIXED_DECODE_INPUTS = ("input_ids", "position_ids", "slot_mapping", "block_table")
"""The mixed graph's decode rows: token generation's inputs, ``[batch_size, 1]`` and ``[batch_size, W / block]``."""
MIXED_CHUNK_INPUTS = ("chunk_ids", "chunk_positions", "chunk_slots", "chunk_table")
"""The mixed graph's chunk: chunked prefill's inputs, ``[1, T]`` and ``[1, W' / block]`` (its own KV window)."""


def mixed_example_inputs(spec: GraphSpec) -> dict[str, torch.Tensor]:
    """The mixed graph's per-call inputs, valid for tracing: its decode rows' and its chunk's, every token writing to
    the scratch block, both block tables of the largest window (all scratch)."""
    rows = example_inputs(dataclasses.replace(spec, kind=GraphKind.TOKEN_GENERATION, tokens=1, chunks=()))
    chunk = example_inputs(dataclasses.replace(spec, kind=GraphKind.CHUNKED_PREFILL, batch=1))
    return {**rows, **dict(zip(MIXED_CHUNK_INPUTS, (chunk[name] for name in MIXED_DECODE_INPUTS), strict=True))}


def symbolic_dims(spec: GraphSpec) -> dict[str, object] | None:
    """`torch.export` dynamic shapes of graph ``spec``'s per-call inputs by name: the window (the columns of
    ``block_table``, whole blocks) when the graph serves several, the token columns of a chunk (and of its image rows)
    when it serves several chunk lengths; None when every shape is static."""
    dims: dict[str, object] = {}
    table: dict[int, object] = {}  # block_table's: its window, and a packed verification graph's row per column
    mixed = spec.kind is GraphKind.MIXED
    if spec.symbolic_window:
        low, high = (min(spec.windows) // spec.block_size, max(spec.windows) // spec.block_size)
        table[1] = torch.export.Dim("kv_blocks", min=low, max=high)
        if mixed:  # the chunk's window, apart from the decode rows'
            dims["chunk_table"] = {1: torch.export.Dim("chunk_kv_blocks", min=low, max=high)}
    if spec.symbolic_chunk:
        chunk = torch.export.Dim("chunk", min=min(spec.chunks), max=max(spec.chunks))
        names = ("input_ids", "position_ids", "slot_mapping") + (("image_embeds", "image_mask") if spec.images else ())
        dims.update({name: {1: chunk} for name in (MIXED_CHUNK_INPUTS[:3] if mixed else names)})
        if spec.packed:
            table[0] = chunk
    if table:
        dims["block_table"] = table
    return dims or None


def image_row_inputs(spec: GraphSpec, hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The image inputs of an image-text prefill graph ``spec`` carrying no image row: ``image_embeds [1, T, hidden]``
    (``dtype``) and ``image_mask [1, T]`` (True where a column takes its image row instead of its token's embedding)."""
    return {
        "image_embeds": torch.zeros(1, spec.tokens, hidden, dtype=dtype),
        "image_mask": torch.zeros(1, spec.tokens, dtype=torch.bool),
    }


def sampling_inputs(batch: int) -> dict[str, torch.Tensor]:
    """Greedy sampling parameters for ``batch`` rows, in the order the TG graph takes them."""
    return {
        "temperature": torch.ones(batch, dtype=torch.float32),
        "top_k": torch.ones(batch, dtype=torch.long),
        "top_p": torch.ones(batch, dtype=torch.float32),
        "uniforms": torch.full((batch,), 0.5, dtype=torch.float32),
    }


def graph_args(kind: GraphKind, inputs: dict[str, torch.Tensor], kv_cache: list[torch.Tensor]) -> tuple:
    """The positional arguments of graph ``kind``, in the order its module's forward takes them: the tokens, their
    positions and cache slots, (image rows), the KV cache, the block table of a graph reading the cache (its window),
    (sampling inputs), (each row's adapter slot), (a chunked-prefill graph's ``wants_logits``: last); an optional
    argument left out before one given is passed as None."""
    if kind is GraphKind.VISION_ENCODER:
        return (inputs["pixel_values"],)
    if kind is GraphKind.MIXED:  # the decode rows' inputs, the chunk's, the cache, then the two block tables
        rows, chunk = (inputs[k] for k in MIXED_DECODE_INPUTS[:3]), (inputs[k] for k in MIXED_CHUNK_INPUTS[:3])
        return (*rows, *chunk, kv_cache, inputs["block_table"], inputs["chunk_table"])
    tokens = (inputs["input_ids"], inputs["position_ids"], inputs["slot_mapping"])
    if kind.is_prefill:  # an image-text prefill graph takes its image rows before the cache (`ImagePrefillGraph`)
        images = tuple(inputs[k] for k in ("image_embeds", "image_mask") if k in inputs)
        return (*tokens, *images, kv_cache, *_given(inputs, ("block_table", "adapter_ids", "wants_logits")))
    if kind is GraphKind.VERIFICATION:
        return (*tokens, kv_cache, *_given(inputs, ("block_table", "adapter_ids")))
    sampling = ("temperature", "top_k", "top_p", "uniforms")
    return (*tokens, kv_cache, *_given(inputs, ("block_table", *sampling, "adapter_ids")))


def _given(inputs: dict[str, torch.Tensor], names: tuple[str, ...]) -> tuple[torch.Tensor | None, ...]:
    """The optional arguments ``names`` in order, up to the last one ``inputs`` gives; those left out before it as
    None."""
    given = [inputs.get(name) for name in names]
    while given and given[-1] is None:
        given.pop()
    return tuple(given)

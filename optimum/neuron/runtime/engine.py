"""The engine: owns the one weight set, the one KV cache and the loaded graphs of an artifact.

It offers the two primitive calls every caller (``generate()``, the vLLM runner) builds on:
`prefill` / `prefill_chunk` for one sequence's prompt tokens, and `decode` for one token of every
decoding slot at once. Padding comes from `padding`; sampling from `sampling`.
"""

from __future__ import annotations

from functools import partial

import torch

from ..backends import get_backend
from ..errors import IncompatibleConfigError, InputError
from ..graphs import GraphKind, graph_args, graph_kinds, graph_spec, prefill_kind
from ..models.base import StaticDecoder, attention_dims, graph_module
from ..models.layers.kv_cache import allocate_kv_cache
from ..models.registry import build_decoder
from ..weights import bind_weights
from .artifacts import Artifact
from .padding import decode_rows, pad_chunk, split_chunks
from .sampling import SequenceSampler, sample_on_host, sampling_tensors
from .slots import SlotTable


class Engine:
    """Runs an artifact's graphs over a shared KV cache with ``batch_size`` slots."""

    def __init__(self, artifact: Artifact) -> None:
        self.artifact = artifact
        self.config = artifact.config
        self.hf_config = artifact.hf_config()
        backend = get_backend(self.config.backend)
        self.device = backend.placement(self.config.device)
        self.weights = artifact.load_weights(self.device)
        self.kv_cache = self._allocate_cache()
        self.slots = SlotTable(self.config.batch_size)
        self.next_free = [0] * self.config.batch_size
        """Per slot, the first cache position not yet written by this slot's sequence."""
        self._decoder: StaticDecoder | None = None
        self.graphs = {
            kind: backend.load(artifact.graph_path(kind), self.weights, partial(self._module, kind))
            for kind in graph_kinds(self.config)
        }

    def _allocate_cache(self) -> list[torch.Tensor]:
        dims = attention_dims(self.hf_config)
        c = self.config
        layers = self.hf_config.num_hidden_layers
        return allocate_kv_cache(
            layers, c.batch_size, dims.kv_heads, c.sequence_length, dims.head_dim, c.torch_dtype, self.device
        )

    def _module(self, kind: GraphKind) -> torch.nn.Module:
        """The eager module of graph ``kind`` bound to the shared weights (eager backend only)."""
        if self._decoder is None:
            with torch.device("meta"):
                decoder = build_decoder(self.hf_config, self.config.sequence_length, self.config.max_topk)
            bind_weights(decoder, self.weights)
            self._decoder = decoder
        return graph_module(self._decoder, graph_spec(self.config, kind)).eval()

    @property
    def prefill_kind(self) -> GraphKind:
        """The artifact's prefill graph."""
        return prefill_kind(self.config)

    @property
    def chunk_size(self) -> int:
        """Tokens per prefill call: the chunk size, or the whole sequence length for context encoding."""
        return self.config.prefill_chunk_size or self.config.sequence_length

    def _check_slot(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.config.batch_size:
            raise InputError(f"seq_id {seq_id} is not a KV slot of this artifact (0..{self.config.batch_size - 1}).")

    def check_prompt_length(self, length: int) -> None:
        """`InputError` unless a prompt of ``length`` tokens fits the compiled sequence length."""
        limit = self.config.sequence_length
        if not 1 <= length <= limit:
            raise InputError(
                f"prompt of {length} tokens does not fit: this artifact holds 1 to {limit} tokens per sequence; "
                "shorten the prompt or re-export with a larger --sequence_length."
            )

    def prefill_chunk(self, input_ids: list[int], position_ids: list[int], seq_id: int) -> torch.Tensor:
        """Run the chunked-prefill graph on up to C real tokens of slot ``seq_id``; returns the logits
        ``[V]`` of the last real token. ``position_ids`` must be consecutive."""
        if self.prefill_kind is not GraphKind.CHUNKED_PREFILL:
            raise IncompatibleConfigError(
                "this artifact was exported without chunked prefill (prefill_chunk_size=0): call prefill(), "
                "or re-export with --prefill_chunk_size C."
            )
        return self._run_prefill(input_ids, position_ids, seq_id)

    def _run_prefill(self, input_ids: list[int], position_ids: list[int], seq_id: int) -> torch.Tensor:
        self._check_slot(seq_id)
        start = position_ids[0] if position_ids else 0
        if list(position_ids) != list(range(start, start + len(input_ids))):
            raise InputError("position_ids of a prefill call must be consecutive and match input_ids in length.")
        if start + len(input_ids) > self.config.sequence_length:
            self.check_prompt_length(start + len(input_ids))
        ids, positions = pad_chunk(list(input_ids), start, self.chunk_size)
        inputs = {"input_ids": ids, "position_ids": positions, "seq_ids": torch.tensor([seq_id])}
        logits = self.graphs[self.prefill_kind](*graph_args(self.prefill_kind, self._to_device(inputs), self.kv_cache))
        self.next_free[seq_id] = start + len(input_ids)
        return logits[0].float().cpu()

    def prefill(self, token_ids: list[int], seq_id: int, start: int = 0) -> torch.Tensor:
        """Prefill ``token_ids`` (from cache position ``start``) into slot ``seq_id``, chunk by chunk
        or in one context-encoding call; returns the last token's logits ``[V]``."""
        self.check_prompt_length(start + len(token_ids))
        if self.prefill_kind is GraphKind.CONTEXT_ENCODING and start != 0:
            raise InputError("a context-encoding artifact prefills whole prompts from position 0.")
        logits = torch.empty(0)
        for chunk, chunk_start in split_chunks(list(token_ids), start, self.chunk_size):
            logits = self._run_prefill(chunk, list(range(chunk_start, chunk_start + len(chunk))), seq_id)
        return logits

    def decode(self, active: dict[int, tuple[int, int]], samplers: dict[int, SequenceSampler]) -> dict[int, int]:
        """One token-generation step. ``active`` maps slot -> (last token, its position); returns
        slot -> sampled next token. Other rows write only where nothing live reads (invariant 9)."""
        for slot, (_, position) in active.items():
            self._check_slot(slot)
            if position >= self.config.sequence_length:
                raise InputError(f"slot {slot} is full ({self.config.sequence_length} tokens); finish it first.")
        ids, positions = decode_rows(
            self.config.batch_size, active, dict(enumerate(self.next_free)), self.config.sequence_length
        )
        rows: list[SequenceSampler | None] = [
            samplers.get(s) if s in active else None for s in range(self.config.batch_size)
        ]
        inputs = {"input_ids": ids, "position_ids": positions}
        if self.config.on_device_sampling:
            inputs.update(sampling_tensors(rows, self.config.max_topk))
        out = self.graphs[GraphKind.TOKEN_GENERATION](
            *graph_args(GraphKind.TOKEN_GENERATION, self._to_device(inputs), self.kv_cache)
        )
        tokens = out.cpu() if self.config.on_device_sampling else sample_on_host(out, rows, self.config.max_topk)
        for slot, (_, position) in active.items():
            self.next_free[slot] = position + 1
        return {slot: int(tokens[slot]) for slot in active}

    def reset_slot(self, seq_id: int) -> None:
        """Forget slot ``seq_id``'s sequence (its stale cache rows are never read again)."""
        self._check_slot(seq_id)
        self.next_free[seq_id] = 0

    def _to_device(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in inputs.items()}

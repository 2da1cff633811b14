"""The engine: owns an artifact's weights, its one KV cache, its loaded graphs, and every sequence.

Its whole API is what ``generate()`` and the vLLM runner need:

* `Engine.admit` a prompt under a caller's id (a KV slot is taken, the prompt and sampling checked);
* `Engine.step` with how many pending tokens of which sequences to feed: the engine runs the
  token-generation graph once for every sequence that is decoding, then the prefill graph for each
  prefill range (split into chunks, the last one padded), samples, and says what it produced;
* `Engine.release` a sequence (or `preempt` / `resume` it, as vLLM does under memory pressure).

Positions, padding, chunking, graph choice and sampling are decided here (with `padding` and
`sampling`), never by a caller.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from functools import partial
from typing import Any

import torch

from ..artifact import Artifact, allocate_cache, assemble
from ..backends import get_backend
from ..errors import InputError
from ..graphs import GraphKind, GraphSpec, graph_args, graph_specs, prefill_kind
from ..models.base import StaticDecoder, graph_module
from .padding import decode_rows, pad_chunk, split_chunks
from .sampling import SamplingParams, SequenceSampler, sample_on_host, sampling_tensors
from .sequence import SeqId, Sequence, StepResult
from .slots import SlotTable


class Engine:
    """Runs an artifact's graphs for up to ``batch_size`` sequences over one shared KV cache."""

    def __init__(self, artifact: Artifact) -> None:
        self.artifact = artifact
        self.config = artifact.config
        self.hf_config = artifact.hf_config()
        backend = get_backend(self.config.backend)
        self.device = backend.placement(self.config.device)
        self.weights = artifact.load_weights(self.device)
        self.kv_cache = allocate_cache(self.hf_config, self.config, self.device)
        self.slots = SlotTable(self.config.batch_size)
        self._sequences: dict[SeqId, Sequence] = {}
        self._decoder: StaticDecoder | None = None
        self.specs = {spec.name: spec for spec in graph_specs(self.config)}
        """Every graph of the artifact, by name."""
        self.graphs = {
            name: backend.load(artifact.graph_path(name), self.weights, partial(self._module, spec))
            for name, spec in self.specs.items()
        }

    def _module(self, spec: GraphSpec) -> torch.nn.Module:
        """The eager module of graph ``spec`` bound to the shared weights (backends that run model code)."""
        if self._decoder is None:
            self._decoder = assemble(self.hf_config, self.config, self.weights)
        return graph_module(self._decoder, spec).eval()

    def _graph(self, kind: GraphKind) -> GraphSpec:
        """The graph of ``kind`` that runs this call (an artifact has one per kind)."""
        return next(spec for spec in self.specs.values() if spec.kind is kind)

    @property
    def prefill_kind(self) -> GraphKind:
        """The artifact's prefill graph."""
        return prefill_kind(self.config)

    @property
    def chunk_size(self) -> int:
        """Tokens per prefill call: the chunk size, or the whole sequence length for context encoding."""
        return self.config.prefill_chunk_size or self.config.sequence_length

    # --- sequence lifetime ----------------------------------------------------------------------

    def admit(self, seq_id: SeqId, prompt: Seq[int], params: SamplingParams) -> Sequence:
        """Take a KV slot for a new sequence. `InputError` for a prompt or sampling the artifact cannot
        serve, `SlotError` when every slot is taken; nothing is held after an error."""
        if seq_id in self._sequences:
            raise InputError(f"sequence {seq_id!r} is already admitted: release it first, or use another id.")
        tokens = self._checked_prompt(prompt)
        params.check(self.config.max_topk)
        slot = self.slots.acquire(seq_id)
        sequence = Sequence(seq_id, slot, tokens, len(tokens), self.config.sequence_length, SequenceSampler(params))
        self._sequences[seq_id] = sequence
        return sequence

    def sequence(self, seq_id: SeqId) -> Sequence:
        """The admitted sequence ``seq_id`` (read it; only the engine changes it)."""
        if seq_id not in self._sequences:
            raise InputError(f"no sequence {seq_id!r} is admitted: admit() it first.")
        return self._sequences[seq_id]

    def release(self, seq_id: SeqId) -> None:
        """Forget ``seq_id`` and free its slot; its stale cache rows are never read again. Releasing an
        unknown id does nothing (vLLM reports aborts of requests that never reached the model)."""
        sequence = self._sequences.pop(seq_id, None)
        if sequence is not None and sequence.slot is not None:
            self.slots.release(sequence.slot)

    def preempt(self, seq_id: SeqId) -> None:
        """Free the slot of ``seq_id`` but keep its tokens and sampler; `resume` recomputes its cache."""
        sequence = self._sequences.get(seq_id)
        if sequence is not None and sequence.slot is not None:
            self.slots.release(sequence.slot)
            sequence.slot, sequence.computed = None, 0

    def resume(self, seq_id: SeqId, tokens: Seq[int] | None = None) -> Sequence:
        """Give a preempted sequence a slot again, from cache position 0; ``tokens`` replaces its token
        list when given (vLLM sends every token so far)."""
        sequence = self.sequence(seq_id)
        if sequence.slot is not None:
            raise InputError(f"sequence {seq_id!r} was not preempted: it still holds KV slot {sequence.slot}.")
        if tokens is not None:
            sequence.tokens = list(tokens)
        sequence.slot, sequence.computed = self.slots.acquire(seq_id), 0
        return sequence

    # --- one step -------------------------------------------------------------------------------

    def step(self, work: Mapping[Any, int]) -> StepResult:
        """Feed ``work[seq_id]`` pending tokens of each sequence: one token-generation call for every
        sequence that is decoding, then the prefill graph for every other range. Returns the tokens
        sampled (and the prefill logits they were sampled from)."""
        decodes, prefills = self._plan(work)
        result = StepResult()
        if decodes:
            self._decode(decodes, result)
        for sequence, count in prefills:
            self._prefill(sequence, count, result)
        return result

    def _plan(self, work: Mapping[Any, int]) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """Split ``work`` into decodes and prefill ranges, refusing any that the graphs cannot run."""
        decodes, prefills = [], []
        for seq_id, count in work.items():
            sequence = self.sequence(seq_id)
            self._check_work(sequence, count)
            if sequence.decoding and count == 1:
                decodes.append(sequence)
            else:
                prefills.append((sequence, count))
        return decodes, prefills

    def _check_work(self, sequence: Sequence, count: int) -> None:
        name, limit = sequence.seq_id, self.config.sequence_length
        if sequence.slot is None:
            raise InputError(f"sequence {name!r} is preempted: resume() it before scheduling its tokens.")
        if not 1 <= count <= sequence.pending:
            raise InputError(f"sequence {name!r} has {sequence.pending} pending tokens; {count} were scheduled.")
        if sequence.computed + count > limit:
            raise InputError(
                f"sequence {name!r} is full ({limit} tokens): finish it, or re-export with a larger --sequence_length."
            )
        whole = sequence.computed == 0 and count == sequence.pending
        if self.prefill_kind is GraphKind.CONTEXT_ENCODING and not sequence.decoding and not whole:
            raise InputError(
                f"this artifact has no chunked-prefill graph: sequence {name!r} must be prefilled whole from position "
                f"0 ({sequence.pending} tokens), or re-export with --prefill_chunk_size C."
            )

    def _decode(self, decodes: list[Sequence], result: StepResult) -> None:
        """One token-generation call: row b is KV slot b; rows without a decoding sequence write to their
        slot's scratch row, which nothing reads (invariant 9)."""
        by_slot = {_held(s): s for s in decodes}
        active = {slot: (s.tokens[-1], s.computed) for slot, s in by_slot.items()}
        ids, positions = decode_rows(self.config.batch_size, active, self.config.sequence_length)
        rows = [by_slot[slot].sampler if slot in by_slot else None for slot in range(self.config.batch_size)]
        inputs = {"input_ids": ids, "position_ids": positions}
        if self.config.on_device_sampling:
            inputs.update(sampling_tensors(rows, self.config.max_topk))
        out = self._call(self._graph(GraphKind.TOKEN_GENERATION), inputs)
        tokens = out.cpu() if self.config.on_device_sampling else sample_on_host(out, rows, self.config.max_topk)
        for slot, sequence in by_slot.items():
            self._append(sequence, int(tokens[slot]), result)
            sequence.computed += 1
            result.decodes.append(sequence.seq_id)

    def _prefill(self, sequence: Sequence, count: int, result: StepResult) -> None:
        """Prefill ``count`` pending tokens chunk by chunk; sample when the last pending one is in the cache."""
        start = sequence.computed
        logits = torch.empty(0)
        for chunk, chunk_start in split_chunks(sequence.tokens[start : start + count], start, self.chunk_size):
            logits = self._run_prefill(chunk, chunk_start, _held(sequence))
            sequence.computed = chunk_start + len(chunk)
        result.prefills.append((sequence.seq_id, start, count))
        if sequence.pending == 0:
            result.logits[sequence.seq_id] = logits
            token = sample_on_host(logits[None], [sequence.sampler], self.config.max_topk)[0]
            self._append(sequence, int(token), result)

    def _run_prefill(self, token_ids: list[int], start: int, slot: int) -> torch.Tensor:
        """One prefill-graph call on up to one chunk of real tokens; the last real token's logits ``[V]``."""
        ids, positions = pad_chunk(token_ids, start, self.chunk_size)
        inputs = {"input_ids": ids, "position_ids": positions, "seq_ids": torch.tensor([slot])}
        return self._call(self._graph(self.prefill_kind), inputs)[0].float().cpu()

    def _call(self, spec: GraphSpec, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        placed = {k: v.to(self.device) for k, v in inputs.items()}
        return self.graphs[spec.name](*graph_args(spec.kind, placed, self.kv_cache))

    @staticmethod
    def _append(sequence: Sequence, token: int, result: StepResult) -> None:
        sequence.tokens.append(token)
        result.tokens[sequence.seq_id] = token

    def _checked_prompt(self, prompt: Seq[int]) -> list[int]:
        """``prompt`` as a list of ints; `InputError` unless it fits a slot and holds only vocabulary ids (an
        out-of-range id would make a compiled embedding read outside its table)."""
        limit, vocab = self.config.sequence_length, self.hf_config.vocab_size
        if not 1 <= len(prompt) <= limit:
            raise InputError(
                f"prompt of {len(prompt)} tokens does not fit: this artifact holds 1 to {limit} tokens per sequence; "
                "shorten the prompt or re-export with a larger --sequence_length."
            )
        try:
            tokens = [operator.index(t) for t in prompt]
        except TypeError as err:
            raise InputError(f"prompt token ids must be integers ({err}).") from err
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InputError(f"prompt token ids {bad[:5]} are not ids of this model's vocabulary (0..{vocab - 1}).")
        return tokens


def _held(sequence: Sequence) -> int:
    """The slot of a scheduled sequence (`Engine._check_work` refused preempted ones)."""
    assert sequence.slot is not None, f"sequence {sequence.seq_id!r} holds no slot"
    return sequence.slot

"""The engine: owns an artifact's weights, its one KV cache, its loaded graphs, and every sequence.

Its whole API is what ``generate()`` and the vLLM runner need:

* `Engine.admit` a prompt under a caller's id (the prompt and sampling checked, then its KV blocks and a slot taken,
  last): the engine places it in blocks of its own pool, reusing cached blocks of an earlier prompt with the same
  prefix, or in the blocks the caller gives (vLLM's KV cache manager, `add_blocks` as it grows);
* `Engine.step` with how many pending tokens of which sequences to feed: the engine runs the
  token-generation graph once for every sequence that is decoding, then the prefill graph for each
  prefill range (split into chunks, the last one padded), samples, and says what it produced (tokens,
  and the logits, logprobs and prompt logprobs its sequences ask for), atomically: a step that raises leaves every
  sequence as it was;
* `Engine.release` a sequence (or `preempt` / `resume` it, as vLLM does under memory pressure).

Positions, padding, chunking, graph choice and sampling are decided here (with `padding`, `sampling` and
`logprobs`), never by a caller; a caller may only pass a `HostSampler` for the sequences that carry its parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from ..artifact import Artifact, allocate_cache, assemble
from ..backends import get_backend
from ..errors import InputError
from ..graphs import (
    MIXED_CHUNK_INPUTS,
    MIXED_DECODE_INPUTS,
    GraphCall,
    GraphKind,
    GraphSpec,
    exact_window,
    graph_args,
    graph_specs,
    packed_verification,
    prefill_kind,
    select_graph,
)
from ..models.base import StaticDecoder, graph_module
from ..models.layers.masks import actual_tokens_mask
from ..models.layers.parallel import lora_rank_part
from ..models.registry import language_config
from .adapters import AdapterParts, AdapterSlots
from .admission import Admission
from .blocks import BlockPool
from .images import ImageInput, SequenceImages
from .logprobs import PromptScorer
from .padding import (
    DecodeRow,
    VerifyRow,
    chunk_slots,
    decode_rows,
    packed_verify_rows,
    pad_chunk,
    pad_image_rows,
    pad_tiles,
    split_chunks,
    table_rows,
    verify_rows,
)
from .parallel import tensor_parallel_rank
from .placement import CallerPlacement, Placement, PooledPlacement, place, placement_for
from .sampling import HostSampler, SamplingParams, SequenceSampler, sample_on_host, sampling_tensors
from .sequence import Checkpoint, SeqId, Sequence, StepResult, common_prefix
from .slots import SlotTable
from .speculation import accept

HostRows = dict[int, tuple[Sequence, torch.Tensor]]
"""Slot -> (sequence, logits row) of the tokens a `HostSampler` picks at the end of a step."""
Drafts = dict[SeqId, list[int]]
"""Sequence -> the tokens proposed after its last one (speculative decoding), as `Admission.check_drafts` kept them."""


class Engine:
    """Runs an artifact's graphs for up to ``batch_size`` sequences over one shared KV cache."""

    def __init__(self, artifact: Artifact, *, caller_blocks: bool = False, prefix_cache: bool = True) -> None:
        """Load ``artifact``. Sequences are placed in the KV cache by the engine's own block pool, with prefix caching
        unless ``prefix_cache`` is off (an artifact without a chunked-prefill graph has none); with ``caller_blocks``
        the caller gives every sequence its blocks instead (vLLM)."""
        self.artifact = artifact
        self.config = artifact.config
        self.model_config = artifact.hf_config()
        """The model's transformers config (an image-text model's whole config)."""
        self.hf_config = language_config(self.model_config)
        """The language decoder's transformers config (vocabulary, layers)."""
        self.rank = tensor_parallel_rank(self.config)
        """This process's tensor-parallel rank (0 for a single-rank artifact): the weights and KV heads it holds."""
        backend = get_backend(self.config.backend)
        self.device = backend.placement(self.config.device)
        self.weights = artifact.load_weights(self.model_config, self.device, self.rank)
        self.kv_cache = allocate_cache(self.hf_config, self.config, self.device)
        self.slots = SlotTable(self.config.batch_size)
        self.block_size = self.config.block_size
        self.placement: Placement = placement_for(self.config, caller_blocks, prefix_cache)
        """Where sequences' blocks come from (`runtime.placement`)."""
        self._sequences: dict[SeqId, Sequence] = {}
        self._decoder: StaticDecoder | None = None
        self.specs = {spec.name: spec for spec in graph_specs(self.config)}
        """Every graph of the artifact, by name."""
        self.window_spans = {name: artifact.window_span(name) for name in self.specs}
        """The KV windows each graph was compiled for when its window is symbolic (`graphs.exact_window`)."""
        self.graphs = {
            name: backend.load(artifact.graph_path(name), self.weights, partial(self._module, spec))
            for name, spec in self.specs.items()
        }
        rank_part = (
            lora_rank_part(self.hf_config, self.config.tp_degree, self.rank) if self.config.tp_degree > 1 else None
        )
        self.adapters = AdapterSlots(self.config, self.weights, rank_part)
        """Multi-LoRA: the PEFT adapters loaded in the artifact's adapter slots (`load_adapter`)."""
        self.admission = Admission.of(self.model_config, self.config)
        """What the artifact accepts as a new sequence (prompt, images, sampling): `admit`'s refusals."""
        self.image_limits = self.admission.images
        """What the artifact accepts as images; None for a text-only artifact."""

    def _module(self, spec: GraphSpec) -> torch.nn.Module:
        """The eager module of graph ``spec`` bound to the shared weights (backends that run model code)."""
        if self._decoder is None:
            self._decoder = assemble(self.model_config, self.config, self.weights)
        return graph_module(self._decoder, spec).eval()

    def _graph(
        self, kind: GraphKind, reach: int, *, logits: bool = False, all_rows: bool = False, tokens: int = 0
    ) -> GraphCall:
        """The graph of ``kind`` that runs a call reading cache positions ``[0, reach)`` with ``tokens`` real tokens
        per row, its KV window (`graphs.select_graph`, then `graphs.exact_window`) and its padded columns: ``logits``
        for a token-generation graph returning logits, ``all_rows`` for a prefill graph returning every row's logits
        (`admit` refused the sequences that need a graph the artifact lacks; the full window and chunk cover every
        call)."""
        found = select_graph(self.specs.values(), kind, logits=logits, all_rows=all_rows, reach=reach, tokens=tokens)
        assert found is not None, f"the artifact has no {kind.value} graph with logits={logits} all_rows={all_rows}"
        return exact_window(found, self.window_spans[found.spec.name], reach)

    @property
    def prefill_kind(self) -> GraphKind:
        """The artifact's prefill graph."""
        return prefill_kind(self.config)

    @property
    def chunk_size(self) -> int:
        """The most tokens one prefill call takes: the chunk size, or the whole sequence length for context encoding
        (a call pads its real tokens to the shortest chunk bucket that holds them: `graphs.select_graph`)."""
        return self.config.prefill_chunk_size or self.config.sequence_length

    # --- sequence lifetime ----------------------------------------------------------------------

    def admit(
        self,
        seq_id: SeqId,
        prompt: Seq[int],
        params: SamplingParams,
        images: Seq[ImageInput] = (),
        *,
        blocks: Seq[int] | None = None,
        computed: int = 0,
        reserve: int = 0,
        reuse: bool = True,
        adapter: str | None = None,
    ) -> Sequence:
        """Take a slot and KV blocks for a new sequence (with the ``images`` whose rows its prompt's placeholders take,
        for an image-text artifact; on the loaded LoRA ``adapter``, or the base model). The engine's own placement takes
        the cached blocks of the prompt's longest cached prefix (unless ``reuse`` is off) and new blocks for ``reserve``
        positions (at least the prompt); a caller that places blocks gives them, ``blocks``, with the ``computed``
        tokens already in them. `InputError` for a prompt, images, sampling or placement the artifact cannot serve,
        `SlotError` when every slot is taken or the pool is full. Everything that can fail runs before the slot is
        taken, last: nothing is held after an error."""
        if seq_id in self._sequences:
            raise InputError(f"sequence {seq_id!r} is already admitted: release it first, or use another id.")
        tokens = self.admission.check(prompt, params, images)
        adapter_slot, adapter_key = self.adapters.slot(adapter)
        sampler = SequenceSampler(params)
        scorer = None if params.prompt_logprobs is None else PromptScorer(list(tokens), params.prompt_logprobs)
        pictures = None if self.image_limits is None else SequenceImages(list(images))
        capacity = self.config.sequence_length
        sequence = Sequence(seq_id, None, tokens, len(tokens), capacity, sampler, scorer=scorer, images=pictures)
        sequence.adapter, sequence.adapter_key = adapter_slot, adapter_key
        place(self.placement, sequence, blocks, computed, reserve, reuse)
        sequence.slot = self._take_slot(sequence)
        self._sequences[seq_id] = sequence
        return sequence

    @property
    def pool(self) -> BlockPool | None:
        """The engine's own block pool (None when the caller places the blocks)."""
        return self.placement.pool if isinstance(self.placement, PooledPlacement) else None

    def _take_slot(self, sequence: Sequence) -> int:
        """A slot for ``sequence``, placed already; its blocks are given back when no slot is free."""
        try:
            return self.slots.acquire(sequence.seq_id)
        except Exception:
            self.placement.free(sequence)
            raise

    def add_blocks(self, seq_id: SeqId, blocks: Seq[int]) -> None:
        """Append ``blocks`` to the blocks of ``seq_id`` (a caller that places blocks: vLLM allocated them)."""
        if not isinstance(self.placement, CallerPlacement):
            raise InputError("this engine places sequences itself: add_blocks is for a caller that places blocks.")
        self.placement.extend(self.sequence(seq_id), blocks)

    def sequence(self, seq_id: SeqId) -> Sequence:
        """The admitted sequence ``seq_id`` (read it; only the engine changes it)."""
        if seq_id not in self._sequences:
            raise InputError(f"no sequence {seq_id!r} is admitted: admit() it first.")
        return self._sequences[seq_id]

    def release(self, seq_id: SeqId) -> None:
        """Forget ``seq_id`` and free its slot and blocks (the engine's own pool keeps their registered contents for
        reuse). Releasing an unknown id does nothing (vLLM reports aborts of requests that never reached the model)."""
        sequence = self._sequences.pop(seq_id, None)
        if sequence is not None and sequence.images is not None:
            sequence.images.drop()
        if sequence is not None and sequence.slot is not None:
            self.slots.release(sequence.slot)
            self.placement.free(sequence)

    def load_adapter(self, name: str, path: str | Path | AdapterParts) -> None:
        """Load the PEFT LoRA adapter at ``path`` (or as `AdapterSlots.read` read it) into a free adapter slot under
        ``name`` (`runtime.adapters`): the sequences admitted with ``adapter=name`` then run on it, beside others on
        other adapters or none. `InputError` when the artifact has no slots, every slot is taken, or the adapter does
        not fit what was compiled."""
        if not self.config.max_loras:
            raise InputError(
                "this artifact has no adapter slots: re-export with --max_loras N --max_lora_rank R to load adapters."
            )
        self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Free adapter ``name``'s slot; `InputError` while an admitted sequence runs on it."""
        slot, _ = self.adapters.slot(name)
        users = [s.seq_id for s in self._sequences.values() if s.adapter == slot]
        if users:
            raise InputError(f"adapter {name!r} is in use by {users[:3]}: release them before unloading it.")
        self.adapters.unload(name)

    def __contains__(self, seq_id: object) -> bool:
        """Whether ``seq_id`` is admitted (preempted or not)."""
        return seq_id in self._sequences

    def rewind(self, seq_id: SeqId, tokens: Seq[int]) -> Sequence:
        """Make ``tokens`` the token list of ``seq_id``: the cache keeps the rows of their longest common prefix with
        the tokens it had, the next steps compute the rest (a drafter's engine follows the target's accepted tokens
        this way, dropping the proposals the target rejected). Only for an engine placing its own blocks without
        prefix caching (``Engine(..., prefix_cache=False)``): a rewound block's rows are written again, so no other
        sequence may share it. `InputError` for tokens the artifact refuses or shorter than the prompt, a preempted
        sequence, one with images or prompt logprobs; nothing changes then."""
        sequence = self.sequence(seq_id)
        pool = self.placement
        if not isinstance(pool, PooledPlacement) or pool.reuse:
            raise InputError(
                "rewind() needs an engine placing its own blocks without prefix caching: "
                "Engine(artifact, prefix_cache=False)."
            )
        if sequence.slot is None or sequence.images is not None or sequence.scorer is not None:
            raise InputError(f"sequence {seq_id!r} cannot be rewound: it is preempted, has images or prompt logprobs.")
        checked = self.admission.checked_prompt(tokens)
        if len(checked) < sequence.prompt_len:
            raise InputError(
                f"sequence {seq_id!r} is rewound to {len(checked)} tokens, fewer than its {sequence.prompt_len}-token "
                "prompt: admit it again instead."
            )
        kept = common_prefix(sequence.tokens, checked)
        sequence.tokens = checked
        sequence.computed = min(sequence.computed, kept, len(checked) - 1)
        del sequence.block_hashes[sequence.computed // self.block_size :]
        return sequence

    def held_blocks(self) -> dict[str, list[int]]:
        """The KV blocks each admitted sequence holds (empty while preempted), by its id as a string."""
        return {str(seq_id): list(s.blocks) for seq_id, s in self._sequences.items()}

    @property
    def cached_images(self) -> int:
        """Images whose encoded rows are cached, over every sequence (rows still to be spliced into a chunk)."""
        return sum(len(s.images.cache) for s in self._sequences.values() if s.images is not None)

    def preempt(self, seq_id: SeqId) -> None:
        """Free the slot and blocks of ``seq_id`` but keep its tokens and sampler; `resume` recomputes its cache."""
        sequence = self._sequences.get(seq_id)
        if sequence is not None and sequence.slot is not None:
            self.slots.release(sequence.slot)
            self.placement.free(sequence)
            sequence.slot, sequence.computed = None, 0
            if sequence.images is not None:  # recomputed from position 0: its images are encoded again
                sequence.images.drop()
            if sequence.scorer is not None:  # its prompt rows are computed again from position 0
                sequence.scorer.reset()

    def resume(
        self, seq_id: SeqId, tokens: Seq[int] | None = None, *, blocks: Seq[int] | None = None, computed: int = 0
    ) -> Sequence:
        """Give a preempted sequence a slot and blocks again (as `admit` places them: cached blocks of its prefix, or
        the caller's ``blocks`` with ``computed`` tokens in them); ``tokens`` replaces its token list when given (vLLM
        sends every token so far: they pass `admit`'s prompt checks and hold at least the prompt). Nothing changes
        after an error."""
        sequence = self.sequence(seq_id)
        if sequence.slot is not None:
            raise InputError(f"sequence {seq_id!r} was not preempted: it still holds slot {sequence.slot}.")
        checked = None if tokens is None else self.admission.checked_prompt(tokens)
        if checked is not None and len(checked) < sequence.prompt_len:
            raise InputError(
                f"sequence {seq_id!r} resumes with {len(checked)} tokens, fewer than its {sequence.prompt_len}-token "
                "prompt: pass every token so far (the prompt, then the tokens it sampled)."
            )
        kept = sequence.tokens
        if checked is not None:
            sequence.tokens = checked
        try:
            place(self.placement, sequence, blocks, computed, 0, True)
            sequence.slot = self._take_slot(sequence)
        except Exception:
            sequence.tokens, sequence.computed = kept, 0
            raise
        return sequence

    # --- one step -------------------------------------------------------------------------------

    def step(
        self,
        work: Mapping[Any, int],
        sampler: HostSampler | None = None,
        drafts: Mapping[Any, Seq[int]] | None = None,
    ) -> StepResult:
        """Feed ``work[seq_id]`` pending tokens of each sequence: one token-generation call for every
        sequence that is decoding, then the prefill graph for every other range. Returns the tokens
        sampled, and the logits, logprobs and prompt logprobs asked for. ``sampler`` picks the tokens of the
        sequences whose parameters carry its own (vLLM's sampler), all of them in one call at the end. ``drafts``
        gives decoding sequences tokens proposed after their last one (speculative decoding): the decodes then run
        as one verification call instead, each sequence keeping the proposed tokens the model agrees with and one
        token of its own (`runtime.speculation`).

        Atomic: it returns, or raises leaving every sequence exactly as before the call (tokens, ``computed``,
        generator state, prompt scorer, cached image rows: a `Checkpoint` of each scheduled sequence is restored), so
        the same step can be retried. Cache rows a failed step wrote lie at or past each sequence's restored
        ``computed``, where nothing reads before the retry writes them again; blocks the step gave a sequence stay
        with it (the retry uses them). After a step, the blocks it filled are registered for prefix caching."""
        decodes, prefills, proposed = self._plan(work, sampler, drafts or {})
        stepped = [*decodes, *(s for s, _ in prefills)]
        saved = [Checkpoint.of(s) for s in stepped]
        try:
            result = self._run(decodes, prefills, sampler, proposed)
        except BaseException:
            for checkpoint in saved:
                checkpoint.restore()
            raise
        for sequence in stepped:
            self.placement.commit(sequence)
        return result

    def _run(
        self,
        decodes: list[Sequence],
        prefills: list[tuple[Sequence, int]],
        sampler: HostSampler | None,
        proposed: Drafts,
    ) -> StepResult:
        """The body of `step`, on the work `_plan` accepted."""
        result = StepResult()
        host: HostRows = {}
        mixing = self._mixable(prefills) if decodes and prefills and not proposed else None
        if decodes and proposed:
            self._verify(decodes, proposed, result, host)
        elif decodes and mixing is None:
            self._decode(decodes, result, host)
        for index, (sequence, count) in enumerate(prefills):
            self._prefill(sequence, count, result, host, decodes if index == mixing else None)
        if host:
            assert sampler is not None, "_plan refused host-sampled sequences without a sampler"
            self._sample_on_host(sampler, host, result)
        return result

    def _plan(
        self, work: Mapping[Any, int], sampler: HostSampler | None, drafts: Mapping[Any, Seq[int]]
    ) -> tuple[list[Sequence], list[tuple[Sequence, int]], Drafts]:
        """Split ``work`` into decodes and prefill ranges, and keep the proposed tokens of the decodes (only the
        non-empty lists), refusing any that the graphs cannot run; give each sequence the blocks its positions
        need."""
        decodes, prefills, proposed = [], [], {}
        unscheduled = [seq_id for seq_id in drafts if seq_id not in work]
        if unscheduled:
            raise InputError(f"tokens were proposed for {unscheduled!r}, which this step does not schedule.")
        for seq_id, count in work.items():
            sequence = self.sequence(seq_id)
            self.admission.check_work(sequence, count)
            kept = self.admission.check_drafts(sequence, count, drafts[seq_id]) if drafts.get(seq_id) else []
            if kept:
                proposed[seq_id] = kept
            self.placement.ensure(sequence, sequence.computed + count + len(kept))
            if sampler is None and sequence.sampler.params.host is not None:
                raise InputError(f"sequence {seq_id!r} is sampled by a HostSampler: pass one to step().")
            if sequence.decoding and count == 1:
                decodes.append(sequence)
            else:
                prefills.append((sequence, count))
        return decodes, prefills, proposed

    def _decode(self, decodes: list[Sequence], result: StepResult, host: HostRows) -> None:
        """One token-generation call: row b is the sequence holding slot b; rows without a decoding sequence write to
        the scratch block, which nothing reads (invariant 9). The graph sampling on device runs unless a decoding
        sequence needs its logits on the host: then the graph returning logits runs and its rows are sampled on the
        host with the same rule and uniforms (or, for rows put in ``host``, by the HostSampler)."""
        by_slot = {_held(s): s for s in decodes}
        logits_graph = any(s.sampler.params.needs_logits for s in decodes)
        spec, window, _ = self._graph(GraphKind.TOKEN_GENERATION, _decode_reach(decodes), logits=logits_graph)
        inputs = self._decode_inputs(by_slot, window)
        if spec.samples_on_device:
            inputs.update(sampling_tensors(self._row_samplers(by_slot), self.config.max_topk))
        if spec.adapters:
            inputs["adapter_ids"] = self._adapter_ids(by_slot)
        out = self._call(spec, inputs)
        if spec.samples_on_device:
            self._decoded(by_slot, result, host, tokens=out.cpu())
        else:
            self._decoded(by_slot, result, host, logits=out.float().cpu())

    def _decode_inputs(self, by_slot: dict[int, Sequence], window: int) -> dict[str, torch.Tensor]:
        """The token-generation rows' inputs (`padding.decode_rows`) in KV window ``window``: row b the sequence
        holding slot b."""
        active = {slot: DecodeRow(s.tokens[-1], s.computed, s.blocks) for slot, s in by_slot.items()}
        return decode_rows(self.config.batch_size, active, window // self.block_size, self.block_size)

    def _row_samplers(self, by_slot: dict[int, Sequence]) -> list[SequenceSampler | None]:
        """Each token-generation row's sampler: the sequence's own, None for a row without one or sampled by a
        `HostSampler`."""
        return [
            s.sampler if (s := by_slot.get(slot)) is not None and s.sampler.params.host is None else None
            for slot in range(self.config.batch_size)
        ]

    def _decoded(
        self,
        by_slot: dict[int, Sequence],
        result: StepResult,
        host: HostRows,
        *,
        logits: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """Take each decoding row's token: from ``tokens [B]`` (sampled on device), or from ``logits [B, V]`` (on the
        host) with the graph's rule and uniforms (rows put in ``host`` for the HostSampler); each sequence one position
        further."""
        ours = {slot for slot, s in by_slot.items() if s.sampler.params.host is None}
        if logits is not None:
            tokens = sample_on_host(logits, self._row_samplers(by_slot), *self._candidate_rule)
        assert tokens is not None, "a decode call returns tokens or logits"
        for slot, sequence in by_slot.items():
            if slot in ours:
                result.append(sequence, int(tokens[slot]), None if logits is None else logits[slot])
            else:
                assert logits is not None, "a host-sampled sequence always runs the graph returning logits"
                host[slot] = (sequence, logits[slot])
            sequence.computed += 1
            result.decodes.append(sequence.seq_id)

    def _verify(self, decodes: list[Sequence], proposed: Drafts, result: StepResult, host: HostRows) -> None:
        """One verification call for every decoding sequence: its last token and the tokens proposed after it (none for
        some), each sequence in its row of the graph padded to the narrowest width the graph runs at that holds the
        longest proposal (`graphs.verification_widths`), or with a packed graph (`GraphSpec.packed`) its columns one
        after another, padded to the call's columns (`padding.packed_verify_rows`); then keeps what
        `speculation.accept` keeps. A row without a decoding sequence writes to the scratch block (invariant 9); a
        host-sampled sequence (never given drafts) has its first column's logits, the ones the token-generation graph
        would return, sampled by the HostSampler."""
        by_slot = {_held(s): s for s in decodes}
        reach = max(s.computed + len(proposed.get(s.seq_id, ())) + 1 for s in decodes)
        active = {
            slot: VerifyRow([s.tokens[-1], *proposed.get(s.seq_id, ())], s.computed, s.blocks)
            for slot, s in by_slot.items()
        }
        filled, widest = sum(len(r.tokens) for r in active.values()), max(len(r.tokens) for r in active.values())
        packed = packed_verification(self.config)
        result.width = filled / len(active) if packed else widest
        spec, window, columns = self._graph(GraphKind.VERIFICATION, reach, tokens=filled if packed else widest)
        width = window // self.block_size
        if packed:
            inputs = packed_verify_rows(list(active.values()), columns, width, self.block_size)
        else:
            inputs = verify_rows(self.config.batch_size, active, columns, width, self.block_size)
        if spec.adapters:
            inputs["adapter_ids"] = self._adapter_ids(by_slot)
        out = self._call(spec, inputs).float().cpu()
        starts = list(accumulate((len(row.tokens) for row in active.values()), initial=0))
        for (slot, sequence), start in zip(by_slot.items(), starts, strict=False):
            logits = out[0, start : start + len(active[slot].tokens)] if packed else out[slot]
            result.decodes.append(sequence.seq_id)
            if sequence.sampler.params.host is not None:
                host[slot] = (sequence, logits[0])
                sequence.computed += 1
                continue
            drafts = proposed.get(sequence.seq_id, [])
            kept = accept(logits, drafts, sequence.sampler, *self._candidate_rule)
            for token, row in kept:
                result.append(sequence, token, row)
            sequence.computed += len(kept)
            if drafts:
                result.accepted[sequence.seq_id] = len(kept) - 1

    def _prefill(
        self, sequence: Sequence, count: int, result: StepResult, host: HostRows, decodes: list[Sequence] | None = None
    ) -> None:
        """Prefill ``count`` pending tokens chunk by chunk (a chunk holding prompt rows to score runs the graph
        returning every row's logits; with ``decodes``, the first chunk runs in the mixed graph beside those decoding
        sequences: `_mixable` chose it); sample when the last pending one is in the cache."""
        start, scorer = sequence.computed, sequence.scorer
        logits = torch.empty(0)
        for chunk, chunk_start in split_chunks(sequence.tokens[start : start + count], start, self.chunk_size):
            scoring = scorer is not None and scorer.wants(chunk_start)
            if decodes:
                rows, decodes = self._run_mixed(decodes, chunk, chunk_start, sequence, result, host), None
            else:
                last = chunk_start + len(chunk) == len(sequence.tokens)  # the chunk whose logits are sampled
                rows = self._run_prefill(chunk, chunk_start, sequence, result, all_rows=scoring, wanted=last)
            if scorer is not None and scoring:
                scorer.add(chunk_start, rows)
            logits = rows[-1]  # the last real token's (invariant 5)
            sequence.computed = chunk_start + len(chunk)
        result.prefills.append((sequence.seq_id, start, count))
        if sequence.pending > 0:
            return
        if scorer is not None:
            result.prompt_logprobs[sequence.seq_id] = scorer.result()
            sequence.scorer = None
        if sequence.sampler.params.host is not None:
            host[_held(sequence)] = (sequence, logits)
            return
        token = sample_on_host(logits[None], [sequence.sampler], *self._candidate_rule)[0]
        result.append(sequence, int(token), logits)

    def _run_prefill(
        self, token_ids: list[int], start: int, sequence: Sequence, result: StepResult, all_rows: bool, wanted: bool
    ) -> torch.Tensor:
        """One prefill-graph call on up to one chunk of real tokens of ``sequence``: the last real token's logits
        ``[1, V]``, or with ``all_rows`` those of every real row ``[n, V]`` (the actual-tokens mask drops the padded
        ones). Unless ``wanted``, its caller drops the last token's logits, and a chunked-prefill graph may return
        zeros instead (`GraphSpec.takes_logits_flag`). An image-text artifact's call also takes the chunk's image
        rows."""
        count = len(token_ids)  # the call reads positions [0, start), its own K/V come from the chunk
        spec, window, size = self._graph(self.prefill_kind, start, all_rows=all_rows, tokens=count)
        inputs = self._chunk_inputs(token_ids, start, size, window, sequence)
        if sequence.images is not None:
            inputs.update(self._image_rows(sequence, start, count, size, result))
        if spec.adapters:
            inputs["adapter_ids"] = torch.tensor([sequence.adapter], dtype=torch.long)
        if spec.takes_logits_flag:
            inputs["wants_logits"] = torch.tensor([wanted])
        out = self._call(spec, inputs).float().cpu()
        return out[actual_tokens_mask(inputs["position_ids"])[0]] if all_rows else out

    def _chunk_inputs(
        self, token_ids: list[int], start: int, size: int, window: int, sequence: Sequence
    ) -> dict[str, torch.Tensor]:
        """A prefill chunk's inputs: ``input_ids``, ``position_ids`` and ``slot_mapping`` ``[1, size]`` of the real
        tokens ``token_ids`` at cache position ``start`` (`padding.pad_chunk`, `padding.chunk_slots`), and the
        ``block_table`` of ``sequence``'s blocks in KV window ``window`` (none for a window of 0)."""
        ids, positions = pad_chunk(token_ids, start, size)
        slots = chunk_slots(sequence.blocks, start, len(token_ids), size, self.block_size)
        inputs = {"input_ids": ids, "position_ids": positions, "slot_mapping": slots}
        if window:
            inputs["block_table"] = table_rows([sequence.blocks], window // self.block_size)
        return inputs

    def _mixable(self, prefills: list[tuple[Sequence, int]]) -> int | None:
        """Which prefill range's first chunk runs in the mixed graph beside a step's decodes (``--mixed_batch``): the
        first whose chunk the mixed graph takes (no image rows, no prompt rows to score); None without a mixed graph
        or such a range."""
        if not any(spec.kind is GraphKind.MIXED for spec in self.specs.values()):
            return None
        for index, (sequence, _) in enumerate(prefills):
            scoring = sequence.scorer is not None and sequence.scorer.wants(sequence.computed)
            if sequence.images is None and not scoring:
                return index
        return None

    def _run_mixed(
        self, decodes: list[Sequence], token_ids: list[int], start: int, sequence: Sequence, result: StepResult,
        host: HostRows,
    ) -> torch.Tensor:  # fmt: skip
        """One mixed-graph call: the token-generation rows of ``decodes`` (each in the KV window its reach needs, as
        `_decode` runs them) and one chunk of ``sequence``'s real tokens at ``start`` (in its own window, padded as
        `_run_prefill` pads it). The decode rows' logits are sampled on the host with the graph's rule (`_decoded`);
        returns the chunk's last real token's logits ``[1, V]``."""
        by_slot, reach = {_held(s): s for s in decodes}, _decode_reach(decodes)
        found = select_graph(self.specs.values(), GraphKind.MIXED, reach=max(reach, start), tokens=len(token_ids))
        assert found is not None, "the mixed graph covers every window and chunk length"
        span = self.window_spans[found.spec.name]
        inputs = self._decode_inputs(by_slot, exact_window(found, span, reach).window)
        chunk = self._chunk_inputs(token_ids, start, found.tokens, exact_window(found, span, start).window, sequence)
        inputs |= {name: chunk[own] for name, own in zip(MIXED_CHUNK_INPUTS, MIXED_DECODE_INPUTS, strict=True)}
        out = self._call(found.spec, inputs).float().cpu()
        rows = self.config.batch_size
        self._decoded(by_slot, result, host, logits=out[:rows])
        result.mixed = True
        return out[rows:]

    def _image_rows(
        self, sequence: Sequence, start: int, count: int, size: int, result: StepResult
    ) -> dict[str, torch.Tensor]:
        """The image inputs of ``sequence``'s chunk of ``count`` real tokens at ``start`` (images it intersects are
        encoded first if not cached, `SequenceImages.chunk_rows`), padded to ``size`` columns
        (`padding.pad_image_rows`)."""
        assert sequence.images is not None
        found = sequence.images.chunk_rows(start, count, self._encode)
        if found is None:
            hidden = self.hf_config.hidden_size
            rows, mask = torch.zeros(count, hidden, dtype=self.config.torch_dtype), torch.zeros(count, dtype=torch.bool)
        else:
            encoded, rows, mask = found
            result.encoded.extend((sequence.seq_id, index) for index in encoded)
        embeds, image_mask = pad_image_rows(rows, mask, size)
        return {"image_embeds": embeds, "image_mask": image_mask}

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's rows ``[t * rows_per_tile, H]``: its tiles through the vision-encoder graph, in batches of the
        graph's tiles (`padding.pad_tiles`), the rows of filler tiles dropped."""
        spec, _, _ = self._graph(GraphKind.VISION_ENCODER, 0)
        batches = pad_tiles(pixels.to(self.config.torch_dtype), spec.batch)
        rows = torch.cat([self._call(spec, {"pixel_values": batch}) for batch in batches])
        return rows[: pixels.shape[0] * rows.shape[0] // (spec.batch * len(batches))]

    def _sample_on_host(self, sampler: HostSampler, host: HostRows, result: StepResult) -> None:
        """The tokens of the sequences a `HostSampler` samples, in one call (row b of its logits: slot b)."""
        vocab = next(iter(host.values()))[1].shape[-1]
        logits = torch.zeros(self.config.batch_size, vocab)
        for slot, (_, row) in host.items():
            logits[slot] = row
        tokens, scored = sampler.sample(logits, {slot: sequence for slot, (sequence, _) in host.items()})
        for slot, (sequence, row) in host.items():
            result.append(sequence, int(tokens[slot]), row, scored[slot])

    def _adapter_ids(self, by_slot: dict[int, Sequence]) -> torch.Tensor:
        """Each token-generation row's adapter slot (0, the base model, for rows without a sequence)."""
        ids = torch.zeros(self.config.batch_size, dtype=torch.long)
        for slot, sequence in by_slot.items():
            ids[slot] = sequence.adapter
        return ids

    @property
    def _candidate_rule(self) -> tuple[int, bool]:
        """How host sampling takes its candidates, as this artifact's graphs do: ``(max_topk, kernel)``."""
        return self.config.max_topk, self.config.cpu_kernels

    def _call(self, spec: GraphSpec, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run graph ``spec`` on ``inputs`` (a graph reading the cache: in the KV window of its ``block_table``)."""
        placed = {k: v.to(self.device) for k, v in inputs.items()}
        return self.graphs[spec.name](*graph_args(spec.kind, placed, self.kv_cache))


def _decode_reach(decodes: list[Sequence]) -> int:
    """The cache positions a token-generation call reads: each row up to its own new position."""
    return max(s.computed for s in decodes) + 1


def _held(sequence: Sequence) -> int:
    """The slot of a scheduled sequence (`Engine._check_work` refused preempted ones)."""
    assert sequence.slot is not None, f"sequence {sequence.seq_id!r} holds no slot"
    return sequence.slot

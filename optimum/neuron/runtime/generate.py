"""HF-style generation as a thin adapter over the `Engine`: admit every prompt, prefill them all in one
step, then one decode step at a time until each sequence stops (an EOS id, ``max_new_tokens``, or a
full KV slot); with prompt lookup, a decode step verifies the tokens `speculation.propose_lookup` proposes when
`lookup_policy.LookupPolicy` finds that it pays.
Row ``i`` samples with ``seed + i`` (modulo ``2**63``) when a seed is given. Every argument is
checked before a slot is taken. `score_prompts` scores texts with
the same engine path (prompt logprobs)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..graphs import packed_verification
from .engine import Engine
from .images import ImageInput
from .logprobs import Logprobs
from .lookup_policy import LookupPolicy
from .sampling import SEED_LIMIT, SamplingParams, checked_count
from .sequence import Sequence, StepResult
from .speculation import propose_lookup


@dataclass
class Generation:
    """What `generate` produced for each row."""

    tokens: list[list[int]]
    """The new tokens of each row."""
    logits: list[list[torch.Tensor]] = field(default_factory=list)
    """With ``params.return_logits``: the logits ``[V]`` each new token of each row was sampled from."""


def generate(
    engine: Engine,
    prompts: Seq[Seq[int]],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: set[int],
    images: Seq[Seq[ImageInput]] | None = None,
    use_prefix_cache: bool = True,
    prompt_lookup: int = 0,
    adapter: str | None = None,
) -> Generation:
    """New tokens (and, with ``params.return_logits``, their logits) for each prompt (``images[i]``: the images of
    prompt i, image-text artifacts). Each sequence takes, when admitted, the KV blocks of its whole run (prompt and
    ``max_new_tokens``), so a full pool is refused before anything runs; the blocks of a prompt prefix an earlier call
    computed are reused unless ``use_prefix_cache`` is off. With ``prompt_lookup`` k > 0 (an artifact exported with
    ``--speculation_length`` K >= k), a decode step verifies up to k tokens per sequence proposed by prompt lookup when
    this call's measured step times say it pays (`lookup_policy.LookupPolicy`): the same tokens, in fewer steps or as
    many. Every row runs on the loaded LoRA ``adapter`` (None: the base model). Every slot and block
    taken is given back, whatever happens."""
    _check_batch(engine, prompts, max_new_tokens)
    _check_lookup(engine, prompt_lookup)
    call = object()  # this call's sequence ids cannot clash with anyone else's
    ids = [(call, row) for row in range(len(prompts))]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        sequences = [
            engine.admit(
                ids[row],
                p,
                _row_params(params, row),
                images[row] if images else (),
                reserve=len(p) + max_new_tokens,
                reuse=use_prefix_cache,
                adapter=adapter,
            )
            for row, p in enumerate(prompts)
        ]
        work = {s.seq_id: s.pending for s in sequences}
        lookup = _Lookup(prompt_lookup, _lookup_policy(engine)) if prompt_lookup else None
        while work:
            start = time.perf_counter()
            result = engine.step(work, drafts=lookup.drafts if lookup else {})
            if lookup:
                lookup.observe(len(work), result, time.perf_counter() - start, sequences)
            for row, seq_id in enumerate(ids):
                if params.return_logits:
                    logits[row].extend(result.token_logits.get(seq_id, []))
            going = [s for s in sequences if not _stopped(s, max_new_tokens, eos_token_ids)]
            work = {s.seq_id: 1 for s in going}
            if lookup:
                lookup.propose(going, max_new_tokens, eos_token_ids)
    finally:
        for seq_id in ids:
            engine.release(seq_id)
    return Generation([s.generated for s in sequences], logits if params.return_logits else [])


@dataclass
class _Lookup:
    """`generate`'s prompt lookup: each step's proposals of at most ``most`` tokens per sequence, verified at the next
    step when ``policy`` finds that it pays, and what the policy learns from each step."""

    most: int
    policy: LookupPolicy
    drafts: dict[Hashable, list[int]] = field(default_factory=dict)
    """The proposals the next step verifies."""
    generated: dict[Hashable, int] = field(default_factory=dict)
    """How many tokens each going sequence had generated when the last proposals were made."""

    def observe(self, rows: int, result: StepResult, seconds: float, sequences: Seq[Sequence]) -> None:
        """Record a step of ``rows`` sequences that took ``seconds`` (a decode step's time and kept tokens), and the
        tokens each sequence generated since the last proposals (what an unverified proposal would have kept)."""
        if not result.prefills:  # a decode step (the first one prefills)
            self.policy.record(rows, result.width, seconds, result.accepted)
        for s in sequences:
            if s.seq_id in self.generated:
                self.policy.generated(s.seq_id, s.generated[self.generated[s.seq_id] :])

    def propose(self, going: list[Sequence], max_new_tokens: int, eos_token_ids: set[int]) -> None:
        """Prompt lookup's proposals after each of ``going``, for the next step to verify or not."""
        proposals = {s.seq_id: _proposal(s, self.most, max_new_tokens, eos_token_ids) for s in going}
        self.generated = {s.seq_id: len(s.generated) for s in going}
        if self.policy.verifies(len(going), proposals, _furthest_from_done(going)):
            self.drafts = proposals
        else:
            self.drafts = {}
            for seq_id, proposed in proposals.items():
                self.policy.withhold(seq_id, proposed)


def generate_tokens(
    engine: Engine,
    prompts: Seq[Seq[int]],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: set[int],
) -> list[list[int]]:
    """The new tokens of `generate`."""
    return generate(engine, prompts, max_new_tokens, params, eos_token_ids).tokens


def score_prompts(engine: Engine, prompts: Seq[Seq[int]], top: int = 0) -> list[Logprobs]:
    """The logprobs of every token of each prompt but the first (with its ``top`` most likely alternatives), from
    the prefill graph returning every row's logits; prompts are scored as many at a time as slots are free."""
    if not prompts:
        raise InputError("score() needs at least one prompt.")
    if engine.slots.free_count == 0:
        raise InputError("every KV slot is in use: release a sequence before scoring.")
    scored: list[Logprobs] = []
    params = SamplingParams(prompt_logprobs=top)
    for first in range(0, len(prompts), engine.slots.free_count):
        group = prompts[first : first + engine.slots.free_count]
        call = object()
        ids = [(call, row) for row in range(len(group))]
        try:
            sequences = [engine.admit(seq_id, p, params) for seq_id, p in zip(ids, group, strict=True)]
            result = engine.step({s.seq_id: s.pending for s in sequences})
        finally:
            for seq_id in ids:
                engine.release(seq_id)
        scored.extend(result.prompt_logprobs[seq_id] for seq_id in ids)
    return scored


def _check_batch(engine: Engine, prompts: Seq[Seq[int]], max_new_tokens: int) -> None:
    if not prompts:
        raise InputError("generate() needs at least one prompt.")
    if len(prompts) > engine.slots.free_count:
        raise InputError(
            f"{len(prompts)} prompts but only {engine.slots.free_count} free KV slots (batch_size="
            f"{engine.config.batch_size}): pass fewer prompts or re-export with a larger --batch_size."
        )
    checked_count("max_new_tokens", max_new_tokens, note=" (transformers' generate refuses 0 too)")


def _lookup_policy(engine: Engine) -> LookupPolicy:
    """The rule that picks which proposals a step verifies, for this engine's verification graph: packed as the graph
    packs its columns; timed on one process only (tensor-parallel ranks run this loop in lockstep and must call the same
    graphs, which decisions from each rank's own clock would not guarantee: they verify every proposal)."""
    return LookupPolicy(timed=engine.config.tp_degree == 1, packed=packed_verification(engine.config))


def _check_lookup(engine: Engine, prompt_lookup: int) -> None:
    if not prompt_lookup:
        return
    checked_count("prompt_lookup_num_tokens", prompt_lookup)
    most = engine.config.speculation_length
    if prompt_lookup > most:
        raise InputError(
            f"prompt_lookup_num_tokens={prompt_lookup}, but the artifact verifies at most {most} proposed tokens per "
            f"step: pass at most {most}, or re-export with --speculation_length {prompt_lookup}."
        )


def _proposal(sequence: Sequence, most: int, max_new_tokens: int, eos_token_ids: set[int]) -> list[int]:
    """Prompt lookup's proposal of at most ``most`` tokens for ``sequence``, cut so that every proposed token, then the
    model's own one, fits in ``max_new_tokens``."""
    room = min(most, max_new_tokens - len(sequence.generated) - 1)
    return propose_lookup(sequence.tokens, room, eos_token_ids)


def _furthest_from_done(going: list[Sequence]) -> list[Hashable]:
    """The sequences with the fewest new tokens: the call ends with them, unless an EOS stops them first."""
    fewest = min((len(s.generated) for s in going), default=0)
    return [s.seq_id for s in going if len(s.generated) == fewest]


def _row_params(params: SamplingParams, row: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=(params.seed + row) % SEED_LIMIT)


def _stopped(sequence: Sequence, max_new_tokens: int, eos_token_ids: set[int]) -> bool:
    new = sequence.generated
    return new[-1] in eos_token_ids or len(new) >= max_new_tokens or sequence.full

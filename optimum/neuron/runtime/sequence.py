"""What the engine knows about one sequence, and what one engine step produced.

A `Sequence` is owned by the `Engine`: callers read it, only the engine changes it. Its fields are the
whole bookkeeping of a sequence (there is no second copy anywhere): its slot and KV blocks, its tokens (prompt,
then every token sampled), how many of them are in the cache, its seeded sampler, and (when its prompt logprobs
are asked) the prompt rows scored so far. A `Checkpoint` is what an engine step may change in it, taken before the
step runs and put back if the step fails (`Engine.step` is atomic).
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from .images import SequenceImages
from .logprobs import Logprobs, PromptScorer, token_logprobs
from .sampling import SequenceSampler

SeqId = Hashable
"""A caller's name for a sequence: a vLLM request id, or a key chosen by ``generate()``."""


@dataclass
class Sequence:
    """One sequence of the engine: tokens, cache progress, slot and sampler."""

    seq_id: SeqId
    slot: int | None
    """Its slot: its row of the token-generation graph (at most ``batch_size`` sequences are admitted at once); None
    while preempted (it then holds no blocks either)."""
    tokens: list[int]
    """The prompt, then every token sampled so far."""
    prompt_len: int
    capacity: int
    """Positions a sequence can hold (the artifact's ``sequence_length``)."""
    sampler: SequenceSampler
    computed: int = 0
    """Tokens whose K/V are in its blocks: also the position the next token is written at."""
    scorer: PromptScorer | None = None
    """Its prompt logprobs while they are gathered (None when not asked, or once returned)."""
    images: SequenceImages | None = None
    """Its images and their cached rows (image-text artifacts; None for a text-only one)."""
    blocks: list[int] = field(default_factory=list)
    """Its blocks of the paged KV cache, in position order: block ``i`` holds positions ``[i * block_size, (i + 1) *
    block_size)`` (`runtime.placement`); empty while preempted."""
    block_hashes: list[bytes] = field(default_factory=list)
    """The prefix-cache hashes of its first full, computed blocks, in order (the engine's own placement only)."""
    adapter: int = 0
    """Its multi-LoRA adapter slot (0: the base model; `runtime.adapters`)."""
    adapter_key: str = ""
    """A key unique to the load of its adapter ("" for the base model): its blocks are cached apart from others'."""

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (the last sampled token is always pending)."""
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        """True when the prompt is in the cache and only the last sampled token is pending: the next
        step feeds that token through the token-generation graph."""
        return self.computed >= self.prompt_len and self.pending == 1

    @property
    def full(self) -> bool:
        """True when the token to feed next has no cache row left: the sequence cannot go on."""
        return len(self.tokens) > self.capacity

    @property
    def generated(self) -> list[int]:
        """The tokens sampled after the prompt."""
        return self.tokens[self.prompt_len :]


@dataclass
class StepResult:
    """What one `Engine.step` ran and produced."""

    tokens: dict[SeqId, int] = field(default_factory=dict)
    """The token each sequence sampled this step: every decode, and every prefill that reached the end
    of its pending tokens. A prefill that stops short of it samples nothing."""
    logits: dict[SeqId, torch.Tensor] = field(default_factory=dict)
    """The logits ``[V]`` (fp32, host) each token above was sampled from, when they reached the host: every prefill
    that reached its end (its last token's logits), and the decodes of a step that ran the token-generation graph
    returning logits (some sequence needed them)."""
    logprobs: dict[SeqId, Logprobs] = field(default_factory=dict)
    """For each token above whose sequence asks logprobs: one row, the token's and its most likely alternatives'."""
    prompt_logprobs: dict[SeqId, Logprobs] = field(default_factory=dict)
    """For each sequence that asks prompt logprobs, at the step its prompt is all in the cache (the step that samples
    its first token): one row per prompt token but the first."""
    token_logits: dict[SeqId, list[torch.Tensor]] = field(default_factory=dict)
    """The logits of every token above and before it that this step appended to a sequence, in order, when they
    reached the host: one row per token (several when a verification call kept proposed tokens)."""
    accepted: dict[SeqId, int] = field(default_factory=dict)
    """For each sequence whose proposed tokens a verification call checked: how many it kept (its new tokens this
    step are those, then the one in ``tokens``)."""
    decodes: list[SeqId] = field(default_factory=list)
    """Sequences fed through the token-generation (or verification) graph, in row order."""
    width: float = 1
    """Columns per decoding sequence of the decode call: 1 + the longest proposal it verified (with a packed
    verification graph, `GraphSpec.packed`: the columns the sequences filled over their count), 1 for token
    generation."""
    mixed: bool = False
    """Whether the decodes ran in the mixed graph, beside the first chunk of the first prefill range
    (``--mixed_batch``), instead of a token-generation call of their own."""
    prefills: list[tuple[SeqId, int, int]] = field(default_factory=list)
    """``(seq_id, start, count)`` of every prefill range, in the order they ran."""
    encoded: list[tuple[SeqId, int]] = field(default_factory=list)
    """``(seq_id, image index)`` of every image encoded by the vision-encoder graph, in the order they ran."""

    def append(
        self, sequence: Sequence, token: int, logits: torch.Tensor | None = None, scored: torch.Tensor | None = None
    ) -> None:
        """Append ``token`` to ``sequence`` and report it, with the ``logits [V]`` it was sampled from when they reached
        the host and, when asked, its logprobs (computed from ``scored``, the logits as the sampler saw them; default
        ``logits``)."""
        sequence.tokens.append(token)
        self.tokens[sequence.seq_id] = token
        if logits is None:
            return
        self.logits[sequence.seq_id] = logits
        self.token_logits.setdefault(sequence.seq_id, []).append(logits)
        top = sequence.sampler.params.logprobs
        if top is not None:
            basis = logits if scored is None else scored
            self.logprobs[sequence.seq_id] = token_logprobs(basis[None], torch.tensor([token]), top)


@dataclass(frozen=True)
class Checkpoint:
    """What one `Engine.step` may change in a sequence, taken before the step: its length, cache progress, generator
    state (a few KB), prompt scorer and its progress, and which image rows are cached. Cheap: no logits, cache or
    image tensor is copied (the step only appends tokens, adds scorer parts and adds or drops cached rows)."""

    sequence: Sequence
    length: int
    computed: int
    generator: torch.Tensor
    scorer: PromptScorer | None
    scored: tuple[int, int]
    """The scorer's ``(len(parts), scored)``."""
    images: dict[int, torch.Tensor] | None

    @classmethod
    def of(cls, sequence: Sequence) -> Checkpoint:
        """The state of ``sequence`` now."""
        scorer, images = sequence.scorer, sequence.images
        return cls(
            sequence,
            len(sequence.tokens),
            sequence.computed,
            sequence.sampler.generator.get_state(),
            scorer,
            (0, 0) if scorer is None else (len(scorer.parts), scorer.scored),
            None if images is None else dict(images.cache),
        )

    def restore(self) -> None:
        """Put the sequence back as it was when the checkpoint was taken."""
        sequence, scorer, images = self.sequence, self.scorer, self.sequence.images
        del sequence.tokens[self.length :]
        sequence.computed = self.computed
        sequence.sampler.generator.set_state(self.generator)
        sequence.scorer = scorer
        if scorer is not None:
            del scorer.parts[self.scored[0] :]
            scorer.scored = self.scored[1]
        if images is not None and self.images is not None:
            images.cache.clear()
            images.cache.update(self.images)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (a rewind keeps them; a withheld proposal would have kept them)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))

"""What an artifact accepts as a new sequence: the one place a request is refused before anything is held.

`Admission` is built from the artifact's configs alone (no engine, no weights, no graphs), so the same checks run in
`Engine.admit` and, before a request is scheduled, in the vLLM platform (`Platform.validate_request`, HTTP 400): a
prompt that fits a slot and holds only vocabulary ids, images that fit the artifact and the prompt (or none for a
text-only artifact), sampling within the artifact's ``max_topk``, and the graphs the sampling needs. Also what one
step may feed an admitted sequence (`Admission.check_work`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config import NeuronConfig
from ..errors import InputError
from ..models.registry import image_text_family, language_config
from .images import ImageInput, ImageLimits, check_images
from .sampling import SamplingParams
from .sequence import Sequence as Seq
from .speculation import unverifiable


@dataclass(frozen=True)
class Admission:
    """The limits of one artifact that every new sequence is checked against."""

    config: NeuronConfig
    vocab_size: int
    """The language decoder's vocabulary: a prompt id outside it would make a compiled embedding read outside its
    table."""
    images: ImageLimits | None
    """What the artifact accepts as images; None for a text-only artifact."""

    @classmethod
    def of(cls, model_config: Any, config: NeuronConfig) -> Admission:
        """The admission of the artifact with transformers config ``model_config`` (an image-text model's whole
        config) and `NeuronConfig` ``config``."""
        return cls(config, int(language_config(model_config).vocab_size), image_limits(model_config, config))

    def check(self, prompt: Sequence[int], params: SamplingParams, images: Sequence[ImageInput] = ()) -> list[int]:
        """``prompt`` as a list of ints; `InputError` for a prompt, images or sampling the artifact cannot serve."""
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, got {type(params).__name__}.")
        tokens = self.checked_prompt(prompt)
        if self.images is not None:
            check_images(tokens, images, self.images)
        elif images:
            raise InputError("this artifact is text-only: export an image-text model to send images.")
        params.check(self.config.max_topk, self.vocab_size)
        params.check_graphs(self.config)
        return tokens

    def check_work(self, sequence: Seq, count: int) -> None:
        """`InputError` unless the graphs can feed ``count`` pending tokens of admitted ``sequence`` in one step: it
        holds a slot, has that many pending, room for them, has not reached its ``max_tokens``, and (an artifact
        without a chunked-prefill graph) its prompt goes in whole from position 0."""
        name, limit = sequence.seq_id, self.config.sequence_length
        if sequence.slot is None:
            raise InputError(f"sequence {name!r} is preempted: resume() it before scheduling its tokens.")
        if not 1 <= count <= sequence.pending:
            raise InputError(f"sequence {name!r} has {sequence.pending} pending tokens; {count} were scheduled.")
        if sequence.computed + count > limit:
            raise InputError(
                f"sequence {name!r} is full ({limit} tokens): finish it, or re-export with a larger --sequence_length."
            )
        most = sequence.sampler.params.max_tokens
        if sequence.decoding and most is not None and len(sequence.generated) >= most:
            raise InputError(f"sequence {name!r} already sampled its max_tokens={most} tokens: release it.")
        whole = sequence.computed == 0 and count == sequence.pending
        if not self.config.prefill_chunk_size and not sequence.decoding and not whole:
            raise InputError(
                f"this artifact has no chunked-prefill graph: sequence {name!r} must be prefilled whole from position "
                f"0 ({sequence.pending} tokens), or re-export with --prefill_chunk_size C."
            )

    def check_drafts(self, sequence: Seq, count: int, drafts: Sequence[int]) -> list[int]:
        """``drafts``, tokens proposed after decoding ``sequence``'s last one (``count``: its scheduled tokens, 1), as
        a list of ints cut to the positions the sequence has left and to its ``max_tokens`` (a proposed token past
        either could never be kept); `InputError` unless the artifact's verification graph can check them."""
        name, most = sequence.seq_id, self.config.speculation_length
        if not most:
            raise InputError(
                "this artifact has no verification graph: re-export with --speculation_length K to verify proposed "
                "tokens (speculative decoding)."
            )
        if len(drafts) > most:
            raise InputError(
                f"{len(drafts)} tokens proposed for sequence {name!r}, but the artifact verifies at most {most} per "
                f"step: propose at most {most}, or re-export with a larger --speculation_length."
            )
        why = unverifiable(sequence) or (None if count == 1 else "is not decoding one token")
        if why:
            raise InputError(f"sequence {name!r} {why}: tokens proposed after it cannot be verified.")
        ids = self._vocabulary_ids(drafts, "proposed")
        return ids[: self.draft_room(sequence)]

    def draft_room(self, sequence: Seq) -> int:
        """How many tokens proposed after decoding ``sequence``'s last one it could keep: a verification call keeps
        them and samples one of its own, all within the artifact's sequence length and the sequence's ``max_tokens``."""
        room = self.config.sequence_length - sequence.computed - 1
        cap = sequence.sampler.params.max_tokens
        return max(room if cap is None else min(room, cap - len(sequence.generated) - 1), 0)

    def checked_prompt(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` as a list of ints; `InputError` unless it fits a slot and holds only vocabulary ids."""
        limit = self.config.sequence_length
        if not 1 <= len(prompt) <= limit:
            raise InputError(
                f"prompt of {len(prompt)} tokens does not fit: this artifact holds 1 to {limit} tokens per sequence; "
                "shorten the prompt or re-export with a larger --sequence_length."
            )
        return self._vocabulary_ids(prompt, "prompt")

    def _vocabulary_ids(self, ids: Sequence[int], what: str) -> list[int]:
        """``ids`` as a list of ints; `InputError` (about the ``what`` token ids) unless each is a vocabulary id."""
        try:
            tokens = [operator.index(t) for t in ids]
        except TypeError as err:
            raise InputError(f"{what} token ids must be integers ({err}).") from err
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError(
                f"{what} token ids {bad[:5]} are not ids of this model's vocabulary (0..{self.vocab_size - 1})."
            )
        return tokens


def image_limits(model_config: Any, config: NeuronConfig) -> ImageLimits | None:
    """The image limits of an image-text artifact (None for a text-only one)."""
    family = image_text_family(model_config)
    if family is None or not config.image_tiles:
        return None
    rows = family.rows_per_tile(model_config, config.image_size)
    return ImageLimits(config.max_images, config.image_size, rows, int(model_config.image_token_id))

"""Speculative decoding through vLLM: the worker drafts, the engine verifies.

After each step the worker proposes up to k tokens after every request that sampled a token and can be verified
(`runtime.speculation.unverifiable`: decoding, sampled by the engine's own sampler, without logprobs); vLLM's scheduler
takes them (``take_draft_token_ids``) and schedules them after the request's next token; the runner hands them to
`Engine.step`, whose verification graph keeps those the model's own sampler agrees with (`runtime.speculation.accept`)
and returns them with one token of its own. vLLM counts the rest as rejected (its spec-decode metrics) and rolls its
computed count back by them, which leaves it equal to the engine's.

Two drafters, as ``--speculative-config`` asks: `NgramDrafter` (``"method": "ngram"``) runs vLLM's own
``NgramProposer`` over the request's tokens; `ModelDrafter` (``"method": "draft_model"``) runs a second exported
artifact, greedy, in an `Engine` of its own (its own KV cache and slots), which follows each request's accepted tokens
with `Engine.rewind`. Both propose deterministic tokens, so keeping a draft exactly when the target's sampler draws it
is vLLM's rejection sampling for a point-mass draft distribution: outputs are distributed as without speculation.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from ..artifact import Artifact
from ..errors import InputError, SlotError
from ..runtime.engine import Engine
from ..runtime.lookup_policy import LookupPolicy
from ..runtime.sampling import SamplingParams
from ..runtime.speculation import unverifiable
from . import compat
from .platform import VERIFY_EVERY
from .runner import StepOutput

logger = compat.logger(__name__)


def draftable(engine: Engine, req_id: str, k: int) -> tuple[list[int], int]:
    """The tokens of ``req_id`` (it sampled one this step, so it is admitted) and how many of at most ``k`` tokens
    proposed after them it could keep (`Admission.draft_room`); ``([], 0)`` when the engine cannot verify any."""
    sequence = engine.sequence(req_id)
    most = 0 if k <= 0 or unverifiable(sequence) else min(k, engine.admission.draft_room(sequence))
    return (list(sequence.tokens), most) if most else ([], 0)


def gate_for(vllm_config: Any, drafter: NgramDrafter | ModelDrafter | None, packed: bool = False) -> DraftGate | None:
    """The gate of an n-gram drafter (`DraftGate`; ``packed``: the artifact's verification graph packs its columns),
    unless ``--additional-config '{"verify_every_proposal": true}'`` asks for every proposal to be verified (a draft
    model's always are)."""
    every = (vllm_config.additional_config or {}).get(VERIFY_EVERY, False)
    return DraftGate(packed) if isinstance(drafter, NgramDrafter) and not every else None


def drafter_for(vllm_config: Any, rank: int) -> NgramDrafter | ModelDrafter | None:
    """The drafter ``--speculative-config`` asks for (the platform let only ``ngram`` and ``draft_model`` through), or
    None. A draft model runs on rank 0 only: vLLM takes the drafts of that rank, and the others verify what it sends."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    if spec.method == "draft_model":
        return ModelDrafter.of(vllm_config) if rank == 0 else None
    return NgramDrafter.of(vllm_config)


class NgramDrafter:
    """vLLM's n-gram proposer over the engine's sequences."""

    def __init__(self, proposer: Any, k: int, max_model_len: int) -> None:
        self.proposer = proposer
        self.k = k
        self.max_model_len = max_model_len

    @classmethod
    def of(cls, vllm_config: Any) -> NgramDrafter | None:
        """The drafter ``--speculative-config`` asks for (the platform let only ``ngram`` through), or None."""
        spec = vllm_config.speculative_config
        if spec is None:
            return None
        proposer = compat.ngram_proposer(vllm_config)
        return cls(proposer, spec.num_speculative_tokens, vllm_config.model_config.max_model_len)

    def draft(self, engine: Engine, req_ids: list[str], budget: int | None = None) -> Any:
        """vLLM's ``DraftTokenIds`` for ``req_ids`` (the requests that sampled a token this step): up to ``budget``
        (default k; vLLM's scheduler lowers it by batch size under ``num_speculative_tokens_per_batch_size``) of the
        proposer's tokens for each one the engine can verify, ``[]`` for the others."""
        k = self.k if budget is None else min(self.k, budget)
        rows = [draftable(engine, r, k) for r in req_ids]
        if not any(most for _, most in rows):  # nothing to propose for: no [requests, max_model_len] history to build
            return compat.draft_token_ids(list(req_ids), [[] for _ in req_ids])
        lengths = np.array([len(tokens) for tokens, _ in rows], dtype=np.int32)
        history = np.zeros((len(rows), self.max_model_len), dtype=np.int32)
        for i, (tokens, _) in enumerate(rows):
            history[i, : len(tokens)] = tokens
        wanted = [[1] if most else [] for _, most in rows]  # the proposer skips a request that sampled nothing
        drafts = self.proposer.propose(k, wanted, lengths, history)
        kept = [list(map(int, d))[:most] for d, (_, most) in zip(drafts, rows, strict=True)]
        return compat.draft_token_ids(list(req_ids), kept)


class DraftGate:
    """Which of the n-gram drafter's proposals vLLM is given: those `LookupPolicy` finds worth verifying, by its
    throughput rule (vLLM's steps serve every running request, none waits for another), on the decode steps this
    worker timed; a withheld proposal costs nothing (vLLM schedules a plain token-generation step) and teaches the
    policy what it would have kept, by the tokens its request samples next (`LookupPolicy.generated`). Prompt lookup's
    own cost is small; a draft model's is not, and it is not gated: its proposals are always verified."""

    def __init__(self, packed: bool = False) -> None:
        """``packed``: the verification graph packs its columns (`graphs.packed_verification`)."""
        self.policy = LookupPolicy(packed=packed)
        self.withheld: dict[str, list[int]] = {}
        """The proposals held back from the next step."""

    def observe(self, step: compat.Step, out: StepOutput, seconds: float) -> None:
        """Learn from ``step``, which took ``seconds``: a decode-only step's time at its width, each verification's kept
        tokens, each withheld proposal's counterfactual."""
        self.policy.forget(step.finished)
        kept: dict[Hashable, int] = {r: n for r, n in out.accepted.items()}
        if out.decodes and not out.prefilled:
            self.policy.record(out.decodes, out.width, seconds, kept)
        else:
            self.policy.record_kept(kept)
        for req_id, proposed in self.withheld.items():
            self.policy.withhold(req_id, proposed)
        for req_id, tokens in out.sampled.items():
            self.policy.generated(req_id, tokens)
        self.withheld = {}

    def admit(self, drafts: Any) -> Any:
        """``drafts`` (vLLM's ``DraftTokenIds``) with the proposals the policy verifies (`LookupPolicy.chosen`: all or
        none, or with packed columns those worth their columns); the others are withheld."""
        proposals = dict(zip(drafts.req_ids, drafts.draft_token_ids, strict=True))
        chosen = self.policy.chosen(len(proposals), proposals)
        self.withheld = {r: list(p) for r, p in proposals.items() if p and r not in chosen}
        if not self.withheld:
            return drafts
        return compat.draft_token_ids(
            list(drafts.req_ids), [list(p) if r in chosen else [] for r, p in proposals.items()]
        )


GREEDY = SamplingParams()


class ModelDrafter:
    """A second artifact proposing its greedy continuation of each request, in an `Engine` of its own."""

    def __init__(self, engine: Engine, k: int) -> None:
        self.engine = engine
        self.k = k

    @classmethod
    def of(cls, vllm_config: Any) -> ModelDrafter:
        """The drafter of ``"method": "draft_model"``: the artifact ``"model"`` names (checked by the platform), loaded
        without prefix caching (its sequences are rewound, `Engine.rewind`)."""
        spec = vllm_config.speculative_config
        engine = Engine(Artifact.open(spec.draft_model_config.model), prefix_cache=False)
        return cls(engine, spec.num_speculative_tokens)

    def draft(self, engine: Engine, req_ids: list[str], budget: int | None = None) -> Any:
        """vLLM's ``DraftTokenIds`` for ``req_ids`` (the requests that sampled a token this step): up to ``budget``
        (default k) of the draft model's greedy tokens after each one the target ``engine`` can verify, ``[]`` for the
        others. Draft sequences of requests the target no longer holds are released first."""
        self._forget(engine)
        k = self.k if budget is None else min(self.k, budget)
        wanted = {r: row for r in req_ids if (row := draftable(engine, r, k))[1]}
        try:
            proposed = self.propose(wanted) if wanted else {}
        except Exception as err:  # a drafter's failure costs the proposals, never the step's tokens
            logger.error("the draft model failed (%s: %s); no tokens proposed this step", type(err).__name__, err)
            for req_id in wanted:
                self.engine.release(req_id)
            proposed = {}
        return compat.draft_token_ids(list(req_ids), [proposed.get(r, []) for r in req_ids])

    def propose(self, requests: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
        """For each request's ``(tokens, most)``, up to ``most`` greedy tokens of the draft model after ``tokens``
        (fewer where the draft's cache ends): the draft sequence is rewound to the tokens (or admitted), then one step
        feeds what it has not computed and samples the first token, and each further step decodes one more, for every
        request at once."""
        most = {r: n for r, (tokens, k) in requests.items() if (n := self._follow(r, tokens, k)) > 0}
        drafts: dict[str, list[int]] = {r: [] for r in most}
        while work := {r: self.engine.sequence(r).pending for r in most if len(drafts[r]) < most[r]}:
            result = self.engine.step(work)
            for r in work:
                drafts[r].append(result.tokens[r])
        return drafts

    def _follow(self, req_id: str, tokens: list[int], k: int) -> int:
        """Bring the draft sequence of ``req_id`` to ``tokens``; how many tokens it can propose after them (0 when the
        draft artifact cannot hold them: no proposal then)."""
        room = min(k, self.engine.config.sequence_length + 1 - len(tokens))
        if room <= 0:
            self.engine.release(req_id)
            return 0
        try:
            if req_id in self.engine:
                self.engine.rewind(req_id, tokens)
            else:
                self.engine.admit(req_id, tokens, GREEDY, reuse=False)
        except (InputError, SlotError) as err:
            logger.warning("the draft model proposes nothing for request %s: %s", req_id, err)
            self.engine.release(req_id)
            return 0
        return room

    def _forget(self, target: Engine) -> None:
        """Release the draft sequences of requests the target engine finished or preempted."""
        for req_id in self.engine.held_blocks():
            if req_id not in target or target.sequence(req_id).slot is None:
                self.engine.release(req_id)

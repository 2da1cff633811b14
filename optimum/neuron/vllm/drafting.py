"""Speculative decoding through vLLM: the worker drafts with vLLM's n-gram proposer, the engine verifies.

After each step the worker asks vLLM's ``NgramProposer`` (`compat.ngram_proposer`) for up to k tokens after every
request that sampled a token and can be verified (sampled by the engine's own sampler, without logprobs: the
verification call returns one token's logprobs and a HostSampler samples one row); vLLM's scheduler takes them
(``take_draft_token_ids``) and schedules them after the request's next token; the runner hands them to `Engine.step`,
whose verification graph keeps those the model's own sampler agrees with (`runtime.speculation.accept`) and returns
them with one token of its own. vLLM counts the rest as rejected (its spec-decode metrics) and rolls its computed
count back by them, which leaves it equal to the engine's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime.engine import Engine
from . import compat


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
        rows = [self._tokens(engine, r) if k > 0 else [] for r in req_ids]
        if not any(rows):  # nothing to propose for: no [requests, max_model_len] history to build
            return compat.draft_token_ids(list(req_ids), [[] for _ in req_ids])
        lengths = np.array([len(t) for t in rows], dtype=np.int32)
        history = np.zeros((len(rows), self.max_model_len), dtype=np.int32)
        for i, tokens in enumerate(rows):
            history[i, : len(tokens)] = tokens
        wanted = [[1] if tokens else [] for tokens in rows]  # the proposer skips a request that sampled nothing
        drafts = self.proposer.propose(k, wanted, lengths, history)
        return compat.draft_token_ids(list(req_ids), [list(map(int, d)) for d in drafts])

    @staticmethod
    def _tokens(engine: Engine, req_id: str) -> list[int]:
        """The request's tokens (it sampled one this step, so it is admitted) when the engine can verify tokens
        proposed after them, else ``[]``."""
        sequence = engine.sequence(req_id)
        params = sequence.sampler.params
        if not sequence.decoding or params.host is not None or params.logprobs is not None:
            return []
        return list(sequence.tokens)

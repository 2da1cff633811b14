"""vLLM 0.32's own sampler for the requests that need more than temperature / top-k / top-p: the host-sampling
adapter, the second and last module of the plugin that touches vLLM internals (with `compat`).

`needs_vllm_sampler` says which requests; `HostSampling` keeps vLLM's logits processors' persistent batch (a batch
index is a KV slot), builds ``SamplingMetadata``, applies the grammar bitmask and runs ``Sampler`` on the CPU, as
vLLM's GPU model runner does; `HostSampling.for_step` binds it to one step's bitmask as the engine's `HostSampler`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch


def needs_vllm_sampler(params: Any) -> bool:
    """True when a vLLM ``SamplingParams`` asks for more than temperature / top-k / top-p: penalties, ``min_p``,
    ``min_tokens``, ``logit_bias``, allowed token ids, bad words or structured output."""
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}
    return (
        any(getattr(params, name) != value for name, value in neutral.items())
        or params.min_tokens > 0
        or bool(params.logit_bias or params.allowed_token_ids or params.bad_words)
        or params.structured_outputs is not None
    )


class HostSampling:
    """vLLM's own sampling for the sequences whose parameters carry a vLLM ``SamplingParams`` (``host``): the part
    of vLLM's GPU model runner that builds ``SamplingMetadata``, keeps the logits processors' persistent batch
    (``BatchUpdate``s; a batch index is a KV slot), applies the grammar bitmask and runs ``Sampler``."""

    def __init__(self, batch_size: int, vocab_size: int) -> None:
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, BatchUpdateBuilder, LogitsProcessors

        view = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=batch_size))
        cpu = torch.device("cpu")
        self.processors = LogitsProcessors(cls(view, cpu, False) for cls in BUILTIN_LOGITS_PROCESSORS)  # type: ignore[arg-type]
        self.updates = BatchUpdateBuilder()
        self.sampler = _cpu_sampler()
        self.batch_size, self.vocab_size = batch_size, vocab_size
        self.batch: dict[int, tuple[Any, list[int]]] = {}
        """Slot -> (request id, its output tokens: the list the logits processors read)."""

    def for_step(self, grammar_output: Any) -> _StepSampler:
        """The `HostSampler` of one engine step, with the step's ``GrammarOutput`` (None without one)."""
        return _StepSampler(self, grammar_output)

    def sample(self, logits: torch.Tensor, rows: Mapping[int, Any], grammar: Any) -> tuple[dict[int, int], Any]:
        """Tokens of ``rows`` (slot -> engine sequence) from ``logits [batch_size, V]``, as vLLM samples them; also
        the logits vLLM computes raw logprobs from (after the grammar bitmask)."""
        update = self._sync(rows)
        for processor in self.processors.all:
            processor.update_state(update)
        if grammar is not None:
            _apply_grammar(logits, rows, grammar)
        scored = logits.clone()
        out = self.sampler(logits, self._metadata(rows))
        tokens = out.sampled_token_ids[:, 0].tolist()
        return {slot: tokens[slot] for slot in rows}, scored

    def _sync(self, rows: Mapping[int, Any]) -> Any:
        """The ``BatchUpdate`` that makes the processors' batch the rows sampled this step."""
        for slot in [s for s, (req_id, _) in self.batch.items() if s not in rows or rows[s].seq_id != req_id]:
            if slot not in rows:
                self.updates.removed_append(slot)
            del self.batch[slot]
        for slot, sequence in rows.items():
            if slot in self.batch:
                self.batch[slot][1][:] = sequence.generated
                continue
            output = list(sequence.generated)
            self.batch[slot] = (sequence.seq_id, output)
            prompt = sequence.tokens[: sequence.prompt_len]
            self.updates.added.append((slot, sequence.sampler.params.host, prompt, output))
        return self.updates.get_and_reset(self.batch_size)

    def _metadata(self, rows: Mapping[int, Any]) -> Any:
        """``SamplingMetadata`` over the whole batch; rows not sampled this step are greedy and neutral."""
        from vllm.sampling_params import SamplingType
        from vllm.v1.sample.metadata import SamplingMetadata

        size, vocab = self.batch_size, self.vocab_size
        params = {slot: s.sampler.params.host for slot, s in rows.items()}
        random = {slot for slot, p in params.items() if p.sampling_type != SamplingType.GREEDY}
        temperature, top_p, top_k = torch.zeros(size), torch.ones(size), torch.full((size,), vocab, dtype=torch.int32)
        penalties = {name: torch.full((size,), neutral) for name, neutral in _PENALTIES.items()}
        for slot, p in params.items():
            temperature[slot] = p.temperature if slot in random else 0.0
            top_p[slot], top_k[slot] = p.top_p, p.top_k if 0 < p.top_k < vocab else vocab
            for name in _PENALTIES:
                penalties[name][slot] = getattr(p, name)
        no_penalties = all(bool((penalties[n] == v).all()) for n, v in _PENALTIES.items())
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=not random,
            all_random=len(random) == size,
            top_p=None if bool((top_p == 1.0).all()) else top_p,
            top_k=None if bool((top_k == vocab).all()) else top_k,
            generators={slot: rows[slot].sampler.generator for slot in random},
            max_num_logprobs=None,
            no_penalties=no_penalties,
            prompt_token_ids=None if no_penalties else self._prompts(rows),
            frequency_penalties=penalties["frequency_penalty"],
            presence_penalties=penalties["presence_penalty"],
            repetition_penalties=penalties["repetition_penalty"],
            output_token_ids=[self.batch[slot][1] if slot in self.batch else [] for slot in range(size)],
            allowed_token_ids_mask=self._allowed(params),
            bad_words_token_ids={s: p.bad_words_token_ids for s, p in params.items() if p.bad_words_token_ids},
            logitsprocs=self.processors,
        )

    def _prompts(self, rows: Mapping[int, Any]) -> torch.Tensor:
        """The prompts of the batch, padded with ``vocab_size`` (vLLM's penalties read them)."""
        prompts = {slot: s.tokens[: s.prompt_len] for slot, s in rows.items()}
        out = torch.full((self.batch_size, max(len(p) for p in prompts.values())), self.vocab_size, dtype=torch.long)
        for slot, prompt in prompts.items():
            out[slot, : len(prompt)] = torch.tensor(prompt)
        return out

    def _allowed(self, params: Mapping[int, Any]) -> torch.Tensor | None:
        """vLLM's ``allowed_token_ids_mask``: True for the tokens a row may not sample."""
        limited = {slot: p.allowed_token_ids for slot, p in params.items() if p.allowed_token_ids}
        if not limited:
            return None
        mask = torch.zeros(self.batch_size, self.vocab_size, dtype=torch.bool)
        for slot, allowed in limited.items():
            mask[slot] = True
            mask[slot, allowed] = False
        return mask


_PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class _StepSampler:
    """`HostSampling` bound to one step's grammar bitmask: the `runtime.sampling.HostSampler` the engine calls."""

    owner: HostSampling
    grammar: Any

    def sample(self, logits: torch.Tensor, rows: Mapping[int, Any]) -> tuple[dict[int, int], Any]:
        return self.owner.sample(logits, rows, self.grammar)


def _apply_grammar(logits: torch.Tensor, rows: Mapping[int, Any], grammar: Any) -> None:
    """vLLM's ``apply_grammar_bitmask`` on the batch: its request order is the slot order (free slots get ids
    no request has)."""
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    order = [rows[slot].seq_id if slot in rows else f"<free slot {slot}>" for slot in range(logits.shape[0])]
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={})
    apply_grammar_bitmask(scheduled, grammar, SimpleNamespace(req_ids=order), logits)  # type: ignore[arg-type]


def _cpu_sampler() -> Any:
    """vLLM's ``Sampler`` on its PyTorch-native paths: for a CPU platform vLLM picks CPU kernels
    (``torch.ops._C.greedy_argmax``, ``fused_gumbel_argmax``) that its CUDA wheel does not ship."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch, random_sample
    from vllm.v1.sample.sampler import Sampler

    def native(logits: torch.Tensor, generators: dict, k: Any, p: Any) -> tuple[torch.Tensor, None]:
        logits = apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
        return random_sample(logits.softmax(dim=-1, dtype=torch.float32), generators), None

    class CpuSampler(Sampler):
        @staticmethod
        def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
            return logits.argmax(dim=-1).view(-1)

    sampler = CpuSampler(logprobs_mode="raw_logprobs")
    sampler.topk_topp_sampler.forward = native
    return sampler

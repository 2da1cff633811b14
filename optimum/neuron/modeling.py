"""`NeuronModelForCausalLM`: load an exported artifact and generate like transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .artifact import Artifact
from .errors import InputError
from .runtime.engine import Engine
from .runtime.generate import generate, score_prompts
from .runtime.images import ImageInput
from .runtime.sampling import SamplingParams, checked_count, normalized_top_k


class NeuronModelForCausalLM:
    """A causal LM running an artifact's compiled graphs over one shared KV cache."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.config = engine.hf_config
        self.neuron_config = engine.config
        self.generation_config = _generation_config(engine.artifact.root)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> NeuronModelForCausalLM:
        """Load the artifact exported to ``path`` (see ``optimum-cli export neuron``)."""
        return cls(Engine(Artifact.open(path)))

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        num_return_sequences: int = 1,
        output_scores: bool = False,
        output_logits: bool = False,
        return_dict_in_generate: bool = False,
        images: list[list[ImageInput]] | None = None,
        use_prefix_cache: bool = True,
        prompt_lookup_num_tokens: int | None = None,
        adapter_name: str | None = None,
        **unsupported: Any,
    ) -> Any:
        """Generate like ``transformers``' ``generate``: returns ``[N, L + new]``, the input ids followed
        by the new tokens, rows that stopped early filled with ``pad_token_id``. ``max_new_tokens`` (default 20) must be
        >= 1, as transformers requires. Every argument is checked before anything is held (`InputError`, naming it).
        ``input_ids`` may be
        left- or right-padded when ``attention_mask`` marks the real tokens. ``seed`` makes sampling
        reproducible (row i uses ``seed + i``). ``num_return_sequences`` generates that many rows per prompt,
        each a sequence of its own (consecutive rows). With ``return_dict_in_generate`` it returns transformers'
        ``GenerateDecoderOnlyOutput``: ``sequences``, and per new token ``[N, V]`` fp32 ``scores`` (what the
        sampler drew from: the logits when greedy, else temperature, top-k and top-p applied) with
        ``output_scores``, raw ``logits`` with ``output_logits``; a row that already stopped puts all its
        mass on ``pad_token_id`` there (score 0, others -inf). ``images[i]`` are the images of row i (image-text
        artifacts: `NeuronModelForImageTextToText` builds them from the processor's ``pixel_values``). A prompt whose
        first blocks of tokens (and images) an earlier call computed reuses their KV blocks and prefills only the rest,
        unless ``use_prefix_cache`` is False (docs/architecture.md, "The paged KV cache"). ``prompt_lookup_num_tokens``
        k (transformers' prompt lookup decoding) proposes up to k tokens per step by matching the sequence's last
        n-gram against its earlier tokens and verifies them in one call of the verification graph (an artifact
        exported with ``--speculation_length`` K >= k) at the steps where the call's measured times say verifying
        pays: the tokens are those generation picks without it, in fewer steps when the output repeats its input
        (docs/speculative.md). ``adapter_name`` runs every row on a LoRA
        adapter loaded with `load_adapter` (an artifact exported with ``--max_loras``; docs/lora.md)."""
        if unsupported:
            raise InputError(f"generate() does not support {sorted(unsupported)} on compiled graphs.")
        gen = self.generation_config
        params = SamplingParams(  # it refuses, naming the parameter, any value of the wrong type or range
            do_sample=_pick(do_sample, gen, "do_sample", False),
            temperature=_pick(temperature, gen, "temperature", 1.0),
            top_k=normalized_top_k(_pick(top_k, gen, "top_k", None)),
            top_p=_pick(top_p, gen, "top_p", 1.0),
            seed=seed,
            return_logits=bool(return_dict_in_generate and (output_scores or output_logits)),
        )
        num_return_sequences = checked_count("num_return_sequences", num_return_sequences)
        eos = _id_set(_pick(eos_token_id, gen, "eos_token_id", None))
        pad = _pick(pad_token_id, gen, "pad_token_id", None)
        pad = int(pad if pad is not None else (min(eos) if eos else 0))
        prompts = [p for p in _real_tokens(input_ids, attention_mask) for _ in range(num_return_sequences)]
        rows = [i for i in images for _ in range(num_return_sequences)] if images is not None else None
        new = 20 if max_new_tokens is None else max_new_tokens
        lookup = prompt_lookup_num_tokens or 0
        out = generate(self.engine, prompts, new, params, eos, rows, use_prefix_cache, lookup, adapter_name)
        width = max(len(t) for t in out.tokens)
        tail = torch.full((len(prompts), width), pad, dtype=torch.long)
        for row, tokens in enumerate(out.tokens):
            tail[row, : len(tokens)] = torch.tensor(tokens)
        sequences = torch.cat((input_ids.to(torch.long).cpu().repeat_interleave(num_return_sequences, 0), tail), 1)
        if not return_dict_in_generate:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        max_topk, kernel = self.neuron_config.max_topk, self.neuron_config.cpu_kernels
        fields: dict[str, Any] = {
            "sequences": sequences,
            "scores": _per_step(out.logits, width, pad, lambda x: params.scores(x, max_topk, kernel))
            if output_scores
            else None,
            "logits": _per_step(out.logits, width, pad, lambda x: x) if output_logits else None,
        }
        return GenerateDecoderOnlyOutput(**fields)

    def load_adapter(self, path: str | Path, adapter_name: str) -> None:
        """Load the PEFT LoRA adapter saved at ``path`` (``adapter_config.json`` and its weights) under
        ``adapter_name``, into one of the artifact's adapter slots (``--max_loras``): ``generate(...,
        adapter_name=...)`` then runs on it. Nothing is recompiled; `InputError` when it does not fit the slots."""
        self.engine.load_adapter(adapter_name, path)

    def delete_adapter(self, adapter_name: str) -> None:
        """Unload adapter ``adapter_name``, freeing its slot."""
        self.engine.unload_adapter(adapter_name)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The log-probability of each token of each row given the tokens before it, as the model's prefill graphs
        compute it: row i gives a ``[len_i - 1]`` fp32 tensor (the first token has none; ``attention_mask`` marks
        the real tokens of padded rows). Needs an artifact exported with ``--prompt_logprobs``."""
        prompts = _real_tokens(input_ids, attention_mask)
        return [logprobs.scores for logprobs in score_prompts(self.engine, prompts)]


def _per_step(
    logits: list[list[torch.Tensor]], steps: int, pad: int, transform: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """transformers' per-step ``[N, V]`` tensors from each row's list of logits; rows that stopped put all their mass
    on ``pad`` (0 there, -inf elsewhere)."""
    vocab = logits[0][0].shape[-1]
    stopped = torch.full((vocab,), -torch.inf)
    stopped[pad] = 0.0
    return tuple(
        torch.stack([transform(row[step][None])[0] if step < len(row) else stopped for row in logits])
        for step in range(steps)
    )


def _real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}.")
    if attention_mask is None:
        return [row.tolist() for row in input_ids]
    if attention_mask.shape != input_ids.shape:
        raise InputError("attention_mask must have the shape of input_ids.")
    return [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]


def _pick(value: Any, gen: Any, name: str, default: Any) -> Any:
    if value is not None:
        return value
    found = getattr(gen, name, None) if gen is not None else None
    return default if found is None else found


def _id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _generation_config(root: Path) -> Any:
    from transformers import GenerationConfig

    if (root / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(root)
    return None

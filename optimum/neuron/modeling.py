"""`NeuronModelForCausalLM`: load an exported artifact and generate like transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .artifact import Artifact
from .errors import InputError
from .runtime.engine import Engine
from .runtime.generate import generate_tokens
from .runtime.sampling import SamplingParams


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
        **unsupported: Any,
    ) -> torch.Tensor:
        """Generate like ``transformers``' ``generate``: returns ``[N, L + new]``, the input ids followed
        by the new tokens, rows that stopped early filled with ``pad_token_id``. ``input_ids`` may be
        left- or right-padded when ``attention_mask`` marks the real tokens. ``seed`` makes sampling
        reproducible (row i uses ``seed + i``)."""
        if unsupported:
            raise InputError(f"generate() does not support {sorted(unsupported)} on compiled graphs.")
        gen = self.generation_config
        params = SamplingParams(
            do_sample=_pick(do_sample, gen, "do_sample", False),
            temperature=float(_pick(temperature, gen, "temperature", 1.0)),
            top_k=int(_pick(top_k, gen, "top_k", 0) or 0),
            top_p=float(_pick(top_p, gen, "top_p", 1.0)),
            seed=seed,
        )
        eos = _id_set(_pick(eos_token_id, gen, "eos_token_id", None))
        pad = _pick(pad_token_id, gen, "pad_token_id", None)
        pad = pad if pad is not None else (min(eos) if eos else 0)
        prompts = _real_tokens(input_ids, attention_mask)
        new_tokens = generate_tokens(self.engine, prompts, int(max_new_tokens or 20), params, eos)
        width = max(len(t) for t in new_tokens)
        tail = torch.full((len(prompts), width), int(pad), dtype=torch.long)
        for row, tokens in enumerate(new_tokens):
            tail[row, : len(tokens)] = torch.tensor(tokens)
        return torch.cat((input_ids.to(torch.long).cpu(), tail), dim=1)


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

"""Config checks shared by families: what a config asks that the static decoder does not implement is
refused at export with `UnsupportedModelError`, naming the config field and the way out."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModelError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rope types whose frequencies transformers fixes at init: taken from its rotary module as they are."""


def check_rope_parameters(params: Any, hf_config: Any, sequence_length: int, field: str = "rope_parameters") -> None:
    """Refuse a rope type whose frequencies would change inside the compiled length (transformers recomputes
    ``dynamic`` past ``max_position_embeddings`` and switches ``longrope`` to its long factors past
    ``original_max_position_embeddings``) or that this toolkit does not know."""
    if not isinstance(params, dict):
        return
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in STATIC_ROPE_TYPES:
        return
    if rope_type == "dynamic":
        limit = hf_config.max_position_embeddings
        if sequence_length <= limit:
            return
        raise UnsupportedModelError(
            f"config field {field}.rope_type 'dynamic' recomputes its frequencies past max_position_embeddings "
            f"({limit}), which a static graph cannot: export with --sequence_length <= {limit}."
        )
    if rope_type == "longrope":
        limit = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None
        )
        if limit and sequence_length <= limit:
            return
        raise UnsupportedModelError(
            f"config field {field}.rope_type 'longrope' switches to its long_factor past "
            f"original_max_position_embeddings ({limit}) depending on the whole sequence's length, which a static "
            f"graph cannot reproduce: export with --sequence_length <= {limit} (the short factors are then exact)."
        )
    raise UnsupportedModelError(
        f"config field {field}.rope_type is {rope_type!r}, which the static decoder does not implement "
        f"(supported: {', '.join(STATIC_ROPE_TYPES)}, dynamic, longrope)."
    )


def check_rope(hf_config: Any, sequence_length: int) -> None:
    """`check_rope_parameters` on the config's ``rope_parameters`` (one dict, or one per layer type)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        for layer_type, sub in params.items():
            check_rope_parameters(sub, hf_config, sequence_length, f"rope_parameters.{layer_type}")
        return
    check_rope_parameters(params, hf_config, sequence_length)


def refuse_set(hf_config: Any, fields: dict[str, str]) -> None:
    """`UnsupportedModelError` for the first config field of ``fields`` (name -> what to do) that is set
    (not ``None``, ``False`` or ``0``)."""
    for name, fix in fields.items():
        value = getattr(hf_config, name, None)
        if value:
            raise UnsupportedModelError(
                f"config field {name}={value!r} is not implemented by the static {hf_config.model_type} decoder: {fix}"
            )

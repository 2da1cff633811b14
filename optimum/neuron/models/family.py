"""`Family`: what distinguishes one model family's static decoder from the common one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


def no_config_check(hf_config: Any, sequence_length: int) -> None:
    """Families with nothing to refuse."""


@dataclass(frozen=True)
class Family:
    """A registered model family: a small delta over the common decoder."""

    name: str
    model_types: tuple[str, ...]
    rotary: Callable[[Any], nn.Module]
    """Builds transformers' rotary module for a config (source of the exact ``inv_freq``)."""
    qkv_bias: Callable[[Any], bool]
    """Whether q/k/v projections carry a bias."""
    o_bias: Callable[[Any], bool] = lambda cfg: False
    """Whether the attention output projection carries a bias."""
    qk_norm: bool = False
    """RMSNorm on q and k per head before rope (qwen3)."""
    check: Callable[[Any, int], None] = no_config_check
    """Refuses configs the static decoder would compute differently from transformers."""

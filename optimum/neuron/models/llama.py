"""Llama family (Llama 2/3 incl. Llama-3 rope scaling, SmolLM2): the reference decoder."""

from __future__ import annotations

from .family import Family

LLAMA = Family(name="llama", model_types=("llama",))

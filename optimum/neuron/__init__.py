"""optimum-neuronx: serve Hugging Face LLMs as static compiled graphs with chunked prefill.

Heavy modules load lazily: ``from optimum.neuron import NeuronModelForCausalLM, NeuronConfig``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from .config import NeuronConfig
    from .modeling import NeuronModelForCausalLM
    from .modeling_image_text import NeuronModelForImageTextToText

_LAZY = {
    "NeuronConfig": "config",
    "NeuronModelForCausalLM": "modeling",
    "NeuronModelForImageTextToText": "modeling_image_text",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)


__all__ = ["NeuronConfig", "NeuronModelForCausalLM", "NeuronModelForImageTextToText", "__version__"]

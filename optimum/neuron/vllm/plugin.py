"""vLLM platform-plugin entry point (group ``vllm.platform_plugins``, name ``optimum_neuron``)."""

from __future__ import annotations

import os


def register() -> str | None:
    """The platform class path, unless ``OPTIMUM_NEURON_VLLM_PLUGIN=0`` turns the plugin off.

    vLLM calls every registered platform plugin and refuses to start when two activate; ours has no
    hardware to detect, so it activates whenever it is installed (the artifact check happens when
    vLLM builds its config, with an error naming the fix for a folder that is not an artifact).
    """
    if os.environ.get("OPTIMUM_NEURON_VLLM_PLUGIN", "1") == "0":
        return None
    return "optimum.neuron.vllm.platform.NeuronxPlatform"

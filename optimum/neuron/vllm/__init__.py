"""Serve optimum-neuronx artifacts with vLLM 0.32: platform plugin, worker and model runner."""

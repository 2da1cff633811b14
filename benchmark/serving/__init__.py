"""The serving benchmark's parts: configurations and workloads, the `vllm serve` process, the load
generator (`vllm bench serve`), the peers (transformers, llama.cpp) and the report (markdown + plots).
The entry point is ``python -m benchmark.serve``."""

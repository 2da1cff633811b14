"""Runtime: load an artifact, own its weights and KV cache, prefill and decode, generate."""

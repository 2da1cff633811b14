"""The toolkit's own compute kernels (C++ sources in ``csrc/``, built on first use and cached)."""

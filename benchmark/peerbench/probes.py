"""The machine's limits, measured in the same run as the figures they bound (the machines here differ from one
day to the next: a floor is never quoted from another run). Run in a fresh process with 2 threads:

    python -m benchmark.peerbench.probes MODEL_DIR     # prints one JSON line

- read bandwidth: the best of a 2-thread fp32 ``sum`` over 512 MiB and a 2-thread GEMV streaming matrices of
  SmolLM2's MLP shape that add up to the model's weight bytes (what a decode step at batch 1 can reach);
- peak: a 2-thread fp32 GEMM (2048^3), the better of torch's (``torch.mm``) and the toolkit's packed kernel (the
  one our linear layers run: about twice torch's rate on an AVX-512 machine, so torch's alone is no peak), the best
  of several runs of each;
- the model's weight bytes (tied embeddings once) and FLOPs per token, from its config.

Beside them, `core_rates` runs before every measurement of a run (in the benchmark's own process, a fraction of a
second): how many cores' worth of multiply-adds the machine gives at that moment. On a VM whose two vCPUs at times
share one physical core, the two-thread rate falls toward the one-thread one; when the host slows both vCPUs, both
rates fall.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmark.machine import read_bandwidth

THREADS = 2


def gemv_bandwidth(total_bytes: int, shape: tuple[int, int] = (1536, 576), repeats: int = 5) -> float:
    """Bytes per second a chain of fp32 matrix-vector products reads from matrices of ``shape`` adding up to
    ``total_bytes`` (each read once per pass, far more than any cache holds), best of ``repeats`` passes."""
    count = max(1, total_bytes // (shape[0] * shape[1] * 4))
    weights = [torch.randn(shape) for _ in range(count)]
    x = torch.randn(shape[1])
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for w in weights:
            torch.mv(w, x)
        best = min(best, time.perf_counter() - start)
    return count * shape[0] * shape[1] * 4 / best


def gemm_peak(size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """fp32 FLOP/s of a ``size``-cubed matrix product by ``torch.mm`` and by the packed kernel
    (`optimum.neuron.kernels.packed`, the weight packed once), each the best of ``repeats`` (after one warm-up)."""
    from optimum.neuron.kernels import library
    from optimum.neuron.kernels.packed import pack, packed_linear

    library.load()
    a, b = torch.randn(size, size), torch.randn(size, size)
    packed = pack(b.t().contiguous())
    products = {"torch": lambda: torch.mm(a, b), "packed": lambda: packed_linear(a, packed, None, size)}
    flops = {}
    for name, product in products.items():
        best = float("inf")
        for _ in range(repeats + 1):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
        flops[name] = 2 * size**3 / best
    return flops


CORE_SHAPE = (256, 576, 576)
"""``M, K, N`` of `core_rates`' product: a prefill chunk's rows on one SmolLM2 projection; x, the packed weight and the
output (~2 MB) stay in the caches, so the product is bound by the multiply-adds alone."""


def core_rates(seconds: float = 0.15) -> dict[str, float]:
    """FLOP/s of the packed kernel (`optimum.neuron.kernels.packed`) on an in-cache product of `CORE_SHAPE`, on one
    thread (``one``) and on `THREADS` (``two``): each the median over the calls that fit in ``seconds``, after one
    warm-up call. torch's thread count is restored."""
    from optimum.neuron.kernels import library
    from optimum.neuron.kernels.packed import pack, packed_linear

    library.load()
    rows, inner, outer = CORE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(rows, inner, generator=generator), pack(torch.randn(outer, inner, generator=generator))
    before, rates = torch.get_num_threads(), {}
    try:
        for name, threads in (("one", 1), ("two", THREADS)):
            torch.set_num_threads(threads)
            packed_linear(x, weight, None, outer)
            times, end = [], time.perf_counter() + seconds
            while time.perf_counter() < end or len(times) < 3:
                start = time.perf_counter()
                packed_linear(x, weight, None, outer)
                times.append(time.perf_counter() - start)
            times.sort()
            rates[name] = 2 * rows * inner * outer / times[len(times) // 2]
    finally:
        torch.set_num_threads(before)
    return rates


def model_shape(model_dir: str | Path) -> dict[str, int]:
    """Parameter counts and dimensions of a llama-style checkpoint, read from its ``config.json``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    embed = config["vocab_size"] * hidden
    tied = config.get("tie_word_embeddings", False)
    return {
        "linear_params": layers * (attn + 3 * hidden * inter),
        "linear_rows": layers * (head_dim * (heads + 2 * kv_heads) + hidden + 2 * inter + hidden),
        "params": layers * per_layer + hidden + embed * (1 if tied else 2),
        "lm_head_params": embed,
        "vocab": config["vocab_size"],
        "tied": int(tied),
        "layers": layers,
        "q_width": heads * head_dim,
        "kv_width": kv_heads * head_dim,
    }


def weight_bytes(shape: dict[str, int], bytes_per_param: int = 4) -> int:
    """Bytes of weights one decode step reads (tied embeddings once: the lm_head reads them)."""
    return shape["params"] * bytes_per_param


def prefill_flops(shape: dict[str, int], tokens: int) -> float:
    """FLOPs of a prefill of ``tokens`` tokens producing one token's logits: every linear layer on every token,
    causal attention (QK^T and PV over the triangle), and the lm_head once."""
    linear = 2 * tokens * shape["linear_params"]
    attention = 2 * 2 * shape["layers"] * shape["q_width"] * tokens * (tokens + 1) / 2
    return linear + attention + 2 * shape["lm_head_params"]


def decode_flops(shape: dict[str, int], rows: int = 1) -> float:
    """FLOPs of one decode step of ``rows`` sequences at a short context (attention negligible)."""
    return 2 * rows * (shape["linear_params"] + shape["lm_head_params"])


def probe(model_dir: str) -> dict[str, Any]:
    """Every probe, as the report reads them."""
    torch.set_num_threads(THREADS)
    shape = model_shape(model_dir)
    weights = weight_bytes(shape)
    gemm = gemm_peak()
    return {
        "read_bw_sum": read_bandwidth(),
        "read_bw_gemv": gemv_bandwidth(weights),
        "peak_flops": max(gemm.values()),
        "gemm_flops": gemm,
        "weight_bytes": weights,
        "shape": shape,
    }


if __name__ == "__main__":
    print("PEERS_RESULT " + json.dumps(probe(sys.argv[1])))

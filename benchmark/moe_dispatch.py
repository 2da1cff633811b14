"""Static-shape MoE strategies on this CPU: every expert computed and weighted (what `layers.moe` ships) vs a
fixed-capacity dispatch (tokens gathered into ``[E, capacity, H]`` buffers, NxD's ``forward_capacity_factor``)
vs selective loading (each token's chosen experts' weights gathered, NxD's token-generation path).

    .venv/bin/python -m benchmark.moe_dispatch [--quick]

Each strategy is checked against transformers' own ``Qwen3MoeSparseMoeBlock`` on the same weights
(max |difference|): a capacity below the token count drops tokens, so only ``capacity = tokens`` is exact.
Three shapes: the tiny test config, a SmolLM2-sized layer (hidden 576, 8 experts of 768, top 2: the active
MLP of a token equals SmolLM2-135M's dense one) and Qwen3-30B-A3B's ratios scaled down (128 experts, top 8, expert
width 3/16 of hidden: computing every expert does 16x the routed work). fp32, eager PyTorch, 2 threads by
default, median of repeated runs, strategies interleaved.
Results go to ``benchmark/results/<machine>/moe_dispatch.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmark.machine import describe, machine_line
from optimum.neuron.models.layers.moe import SparseMoeBlock, routing_weights

RESULTS = Path(__file__).parent / "results"
SHAPES = {  # name: (hidden, intermediate, experts, top_k)
    "tiny (test config)": (64, 32, 4, 2),
    "SmolLM2-sized": (576, 768, 8, 2),
    "Qwen3-30B-A3B ratios": (512, 96, 128, 8),
}
TOKENS = (1, 8, 64, 256)
SELECTIVE_MAX_TOKENS = 8
"""Selective loading copies ``tokens * top_k`` expert matrices: only measured for decode-sized batches."""


def reference(hidden: int, intermediate: int, experts: int, top_k: int) -> torch.nn.Module:
    """transformers' block with random weights (seed 0), renormalized top-k as in the test config."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=hidden,
        moe_intermediate_size=intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.05)
    return block


def ours(ref: torch.nn.Module, top_k: int) -> SparseMoeBlock:
    """The shipped static block holding ``ref``'s tensors."""
    experts, inter2, hidden = ref.experts.gate_up_proj.shape
    block = SparseMoeBlock(hidden, inter2 // 2, experts, top_k, True, "silu").eval()
    block.gate.weight, block.experts.gate_up_proj = ref.gate.weight, ref.experts.gate_up_proj
    block.experts.down_proj = ref.experts.down_proj
    return block


def _mlp(block: SparseMoeBlock, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = torch.matmul(x, gate_up.transpose(-1, -2)).chunk(2, dim=-1)
    return torch.matmul(block.experts.act(gate) * up, down.transpose(-1, -2))


def capacity_dispatch(block: SparseMoeBlock, x: torch.Tensor, capacity_factor: float | None) -> torch.Tensor:
    """Fixed-capacity dispatch: each expert processes ``capacity`` gathered tokens (all of them, in order,
    when ``capacity_factor`` is None: exact); tokens past an expert's capacity are dropped."""
    tokens, hidden = x.shape
    experts = block.experts.gate_up_proj.shape[0]
    capacity = (
        tokens if capacity_factor is None else min(tokens, math.ceil(tokens * block.top_k * capacity_factor / experts))
    )
    weights = routing_weights(block.gate(x), block.top_k, block.normalize)  # [N, E]
    chosen = (weights != 0).to(torch.long)
    position = torch.cumsum(chosen, dim=0) * chosen  # 1-based place in the expert's buffer, 0 = not chosen
    keep = (position > 0) & (position <= capacity)
    slot = torch.where(keep, position - 1 + torch.arange(experts) * capacity, experts * capacity)
    owner = torch.full((experts * capacity + 1,), tokens, dtype=torch.long)
    owner.scatter_(0, slot.flatten(), torch.arange(tokens).repeat_interleave(experts))
    padded = torch.cat((x, x.new_zeros(1, hidden)))
    buffers = padded[owner[:-1]].view(experts, capacity, hidden)
    out = _mlp(block, buffers, block.experts.gate_up_proj, block.experts.down_proj).reshape(-1, hidden)
    out = torch.cat((out, out.new_zeros(1, hidden)))
    return (out[slot] * (weights * keep)[..., None]).sum(dim=1)


def selective_loading(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token runs only its ``top_k`` experts, their weight matrices gathered per token."""
    weights = routing_weights(block.gate(x), block.top_k, block.normalize)
    chosen_weights, index = torch.topk(weights, block.top_k, dim=-1)
    gate_up, down = block.experts.gate_up_proj[index], block.experts.down_proj[index]  # [N, k, ., .]
    out = _mlp(block, x[:, None, None, :], gate_up, down)[:, :, 0]  # [N, k, H]
    return (out * chosen_weights[..., None]).sum(dim=1)


def timed(cases: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each case after two warm-up calls, the cases interleaved call by call so that a
    change of the machine's load touches every strategy alike."""
    for fn in cases.values():
        fn(), fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def measure(shape: tuple[int, int, int, int], tokens: int, repeats: int) -> list[tuple[str, float, float]]:
    """(strategy, ms, max |diff to transformers|) for one shape and token count."""
    ref = reference(*shape)
    block = ours(ref, shape[3])
    x = torch.randn(tokens, shape[0], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x[None])[0]
        cases: dict[str, Callable[[], torch.Tensor]] = {
            "all experts, weighted (shipped)": lambda: block(x[None])[0],
            "capacity dispatch, capacity = tokens": lambda: capacity_dispatch(block, x, None),
            "capacity dispatch, factor 1.0 (drops)": lambda: capacity_dispatch(block, x, 1.0),
        }
        if tokens <= SELECTIVE_MAX_TOKENS:
            cases["selective loading"] = lambda: selective_loading(block, x)
        ms = timed(cases, repeats)
        return [(name, ms[name], float((fn() - want).abs().max())) for name, fn in cases.items()]


def main() -> None:
    """Measure every shape and token count, print and write the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 on a machine shared with a load)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = f"python -m benchmark.moe_dispatch --threads {args.threads}" + (" --quick" if args.quick else "")
    machine = machine_line(describe())
    lines = [
        f"# MoE strategies (fp32, eager, {args.threads} thread(s))",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine}",
        "",
    ]
    lines += ["| shape | tokens | strategy | ms (median) | max abs diff vs transformers |", "|---|---|---|---|---|"]
    for name, shape in SHAPES.items():
        for tokens in TOKENS:
            for strategy, ms, diff in measure(shape, tokens, 5 if args.quick else 30):
                lines.append(f"| {name} | {tokens} | {strategy} | {ms:.3f} | {diff:.1e} |")
                print(lines[-1], flush=True)
    lines += ["", f"Load average (1 min) at the end: {os.getloadavg()[0]:.2f}"]
    out = RESULTS / "cpu-2core" / "moe_dispatch.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

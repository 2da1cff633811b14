"""``python -m optimum.exporters.neuron``: the same export as ``optimum-cli export neuron``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...neuron.errors import NeuronError


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The export flags, shared by ``optimum-cli export neuron`` and ``python -m``."""
    parser.add_argument("--model", "-m", required=True, help="Local transformers checkpoint folder.")
    parser.add_argument("--batch_size", type=int, default=1, help="KV slots / sequences decoded together.")
    parser.add_argument("--sequence_length", type=int, default=1024, help="Tokens per sequence (prompt + new).")
    parser.add_argument(
        "--prefill_chunk_size",
        type=int,
        default=0,
        help="0: one context-encoding graph [1, S]; C > 0: a chunked-prefill graph [1, C].",
    )
    parser.add_argument("--tensor_parallel_size", type=int, default=1, help="Only 1 is supported.")
    parser.add_argument("--auto_cast_type", choices=("fp32", "bf16", "fp16"), default="fp32", help="Compute dtype.")
    parser.add_argument(
        "--backend",
        choices=("inductor", "eager", "xla", "neuron"),
        default="inductor",
        help="inductor: AOTInductor packages (CPU/CUDA); eager: reference; xla: HLO graphs for XLA:CPU or the "
        "Neuron device (needs .venv-xla, see docs/xla.md); neuron: not available here.",
    )
    parser.add_argument("--device", choices=("cpu", "cuda", "neuron"), default="cpu", help="Target device.")
    parser.add_argument("--max_topk", type=int, default=256, help="Largest top_k of on-device sampling.")
    parser.add_argument(
        "--no_on_device_sampling", action="store_true", help="Token generation returns logits, sampled on the host."
    )
    parser.add_argument("--no_cache", action="store_true", help="Always compile, ignoring the export cache.")
    parser.add_argument("output", type=Path, help="Output artifact directory.")


def run_export(args: argparse.Namespace) -> Path:
    """Build the `NeuronConfig` from parsed flags and export."""
    from ...neuron.backends import get_backend
    from ...neuron.config import NeuronConfig
    from .export import export

    get_backend(args.backend).placement(args.device)  # an unavailable backend or device is named first
    config = NeuronConfig(
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        prefill_chunk_size=args.prefill_chunk_size,
        tp_degree=args.tensor_parallel_size,
        auto_cast_type=args.auto_cast_type,
        on_device_sampling=not args.no_on_device_sampling,
        max_topk=args.max_topk,
        backend=args.backend,
        device=args.device,
    )
    return export(args.model, args.output, config, use_cache=not args.no_cache)


def main(argv: list[str] | None = None) -> int:
    """Entry point; typed errors become a one-line message and exit status 2."""
    parser = argparse.ArgumentParser(prog="python -m optimum.exporters.neuron", description=__doc__)
    add_export_arguments(parser)
    args = parser.parse_args(argv)
    try:
        out = run_export(args)
    except NeuronError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quality of each system's quantized SmolLM2-135M-Instruct: perplexity at fp32, int8 and int4, ours beside
OpenVINO's and llama.cpp's, over the same text, in one run.

    .venv/bin/python -m benchmark.peer_quality [--machine NAME]    # after `python -m benchmark.peers --setup
                                                                   # --weight-format int8` and `... int4`

The text is the 4,096 tokens of the Python documentation that `benchmark.quantized` scores (the stdlib's
``pydoc_data.topics``). Ours and OpenVINO score it under one protocol: 4 windows of 1,024 tokens, each a fresh
sequence whose first token is not scored (ours: `benchmark.quantized.perplexity` on our batch-1 artifact, the formats
of `benchmark.peers`, `peerbench.formats.OURS_FORMATS`; OpenVINO: its IR's logits for every position, in float64).
llama.cpp scores the same text, decoded, with ``llama-perplexity -c 1024`` (its protocol scores only the second half
of each window: compare its formats with each other, not its figures with ours). Each figure's ratio to the same
system's fp32 is the quality a format costs; the weights of each format are those `benchmark.peers` describes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchmark.machine import describe, machine_line, save_results
from benchmark.peerbench.formats import OURS_FORMATS
from benchmark.peerbench.layout import WEIGHT_FORMATS, Layout
from benchmark.quantized import PERPLEXITY_TOKENS, WINDOW, export_for, run_fresh, text_ids

RESULTS = Path(__file__).parent / "results"
SYSTEMS = ("ours", "ours-full", "openvino", "llamacpp")
NAMES = {
    "ours": "ours",
    "ours-full": "ours, `--int4_range full`",
    "openvino": "OpenVINO GenAI",
    "llamacpp": "llama.cpp (its own protocol)",
}
"""``ours-full``: our int4 over Q4_0's 16 levels (its fp32 and int8 are ours: only int4 differs)."""


def ours(layout: Layout, fmt: str, int4_range: str = "symmetric") -> dict[str, Any]:
    """Our perplexity at ``fmt`` (a batch-1 artifact with the prompt-logprobs graph, from the export cache; int4 with
    ``--int4_range int4_range``)."""
    spec = OURS_FORMATS[fmt]
    args = (spec["weight_format"], spec["weight_group_size"], spec["lm_head_format"], int4_range)
    artifact = export_for(layout.model, *args, 1)
    return run_fresh({"task": "perplexity", "artifact": str(artifact), "tokens": PERPLEXITY_TOKENS})


def openvino(layout: Layout, ids: list[int]) -> dict[str, Any]:
    """OpenVINO's perplexity of ``ids`` on ``layout``'s IR (`peerbench.openvino_worker.perplexity`)."""
    from benchmark.peerbench.rounds import Measure, execute

    if not layout.openvino_ir.is_dir():
        raise layout.missing(f"openvino ({layout.openvino_ir})")
    return execute(
        layout, Measure("openvino", "perplexity", {"measure": "perplexity", "ids": ids, "window": WINDOW}, dict)
    )


def llamacpp(layout: Layout, text: Path) -> dict[str, Any]:
    """llama.cpp's perplexity of ``text`` on ``layout``'s GGUF."""
    from benchmark.peerbench import llamacpp as tool

    return tool.perplexity(layout, text, WINDOW)


def measure(system: str, layout: Layout, fmt: str, ids: list[int], text: Path) -> dict[str, Any]:
    """``system``'s perplexity at ``fmt``."""
    if system == "ours":
        return ours(layout, fmt)
    if system == "ours-full":
        return ours(layout, fmt, "full") if fmt == "int4" else {}
    return openvino(layout, ids) if system == "openvino" else llamacpp(layout, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from optimum.neuron.progress import StepProgress

    layouts = {fmt: Layout.default(fmt) for fmt in WEIGHT_FORMATS}
    tokenizer = AutoTokenizer.from_pretrained(layouts["fp32"].model)
    ids = text_ids(tokenizer, PERPLEXITY_TOKENS)
    body: dict[str, Any] = {"machine": describe(), "tokens": len(ids), "window": WINDOW, "systems": {}}
    with tempfile.TemporaryDirectory() as tmp, StepProgress("peer quality", len(SYSTEMS) * len(WEIGHT_FORMATS)) as bar:
        text = Path(tmp) / "text.txt"
        text.write_text(tokenizer.decode(ids))
        for system in SYSTEMS:
            body["systems"][system] = {}
            for fmt, layout in layouts.items():
                with bar.step(f"{NAMES[system]}, {fmt}"):
                    body["systems"][system][fmt] = measure(system, layout, fmt, ids, text)
    save_results(RESULTS / args.machine / "peer-quality.json", body, render(body))


def render(body: dict[str, Any]) -> str:
    """The markdown report: each system's perplexity per format and its ratio to the same system's fp32."""
    lines = [
        "# Quality of quantized weights: SmolLM2-135M-Instruct perplexity, ours beside OpenVINO GenAI and llama.cpp",
        "",
        "Command: `.venv/bin/python -m benchmark.peer_quality`. Machine: " + machine_line(body["machine"]) + ".",
        "",
        f"Text: the first {body['tokens']:,} tokens of the stdlib's `pydoc_data.topics` (as `benchmark.quantized`). "
        f"Ours and OpenVINO: {body['tokens'] // body['window']} windows of {body['window']:,} tokens, each a fresh "
        "sequence, every token but its first scored. llama.cpp: `llama-perplexity -c 1024` on the same text (its "
        "protocol scores the second half of each window): compare its ratios, not its figures. Weights: ours "
        "`--weight_format int8` / `int4 --weight_group_size 64`, both with `--lm_head_format int8`; OpenVINO "
        "`--weight-format int8` (asymmetric per channel) / `int4 --group-size 64` (asymmetric, int8 embedding); "
        "llama.cpp Q8_0 / Q4_0 (Q8_0 embedding): see `benchmark/results/<machine>/peers-int8.md`, Weight formats.",
        "",
        "| system | " + " | ".join(f"{fmt} | x fp32" for fmt in WEIGHT_FORMATS) + " |",
        "|---|" + "---|---|" * len(WEIGHT_FORMATS),
    ]
    for system, row in body["systems"].items():
        base = (body["systems"]["ours"] if system == "ours-full" else row)["fp32"]["perplexity"]
        cells = [
            f"{row[fmt]['perplexity']:.3f} | {row[fmt]['perplexity'] / base:.3f}" if row[fmt] else "— | —"
            for fmt in WEIGHT_FORMATS
        ]
        lines.append(f"| {NAMES[system]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

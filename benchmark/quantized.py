"""Weight-only quantization on SmolLM2-135M-Instruct: fp32 vs int8 vs int4 artifacts, in one run.

    .venv/bin/python -m benchmark.quantized [--quick]

Per format (``--weight_format``; int4 with groups of 64, the default for SmolLM2, and of 32; int8 and int4 g64 also
with ``--lm_head_format int8``, the tied embedding / LM head table in int8):

* **decode** ms/step at batch 1 (a batch-1 artifact) and 8 (a batch-8 artifact, 8 live rows), after a prompt of 64 and
  of 1,000 tokens (S=1024, C=256), each in a fresh process; and the format's **floor**: the bytes one step reads (every
  stored tensor but the embedding table, which a step only gathers rows of, unless the LM head is tied to it) over the
  read bandwidth measured in the same run;
* **size** of ``model.safetensors``;
* **perplexity** over the same 4,096 tokens of local English text (the stdlib's ``pydoc_data.topics``: the Python
  documentation), scored by our own artifact (``NeuronModelForCausalLM.score``) in 4 windows of 1,024 tokens;
* **greedy agreement** with fp32 over 50 chat prompts (32 new tokens each, EOS not stopping them): the share of
  prompts whose tokens are all equal, and the share of tokens before the first difference.

Results: ``benchmark/results/<machine>/quantized.md`` and ``.json``; llama.cpp and OpenVINO GenAI at the same bit
widths: ``python -m benchmark.peers --weight-format int8|int4``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmark.fresh import answer, run_worker
from benchmark.machine import describe, machine_line, read_bandwidth, save_results

RESULTS = Path(__file__).parent / "results"
FORMATS = {
    "fp32": ("float", 0, "float", "symmetric", "rtn"),
    "int8": ("int8", 0, "float", "symmetric", "rtn"),
    "int8 + int8 head": ("int8", 0, "int8", "symmetric", "rtn"),
    "int4 g64": ("int4", 0, "float", "symmetric", "rtn"),
    "int4 g64 + int8 head": ("int4", 0, "int8", "symmetric", "rtn"),
    "int4 g64 full + int8 head": ("int4", 0, "int8", "full", "rtn"),
    "int4 g32": ("int4", 32, "float", "symmetric", "rtn"),
    "int4 g64 full gptq + int8 head": ("int4", 0, "int8", "full", "gptq"),
    "int4 g32 full gptq + int8 head": ("int4", 32, "int8", "full", "gptq"),
}
"""Each measured format: its label -> ``(--weight_format, --weight_group_size, --lm_head_format, --int4_range,
--quantization_method)`` (group 0: the default, 64 for SmolLM2)."""
SEQUENCE_LENGTH, CHUNK = 1024, 256
CONTEXTS = (64, 1000)
PERPLEXITY_TOKENS, WINDOW = 4096, 1024
CHAT_PROMPTS, CHAT_NEW = 50, 32
TOPICS = (
    "the water cycle", "photosynthesis", "the French revolution", "black holes", "the immune system", "volcanoes",
    "the printing press", "machine learning", "the Roman empire", "climate change", "vaccines", "the internet",
    "plate tectonics", "the moon landing", "bees", "electric cars", "the stock market", "DNA", "rainbows", "coffee",
    "the Great Wall of China", "solar panels", "sleep", "chess", "the piano", "earthquakes", "the human heart",
    "recycling", "the Olympic games", "glaciers", "honey", "airplanes", "the speed of light", "dinosaurs",
    "the Amazon rainforest", "penguins", "the Renaissance", "batteries", "tides", "the alphabet", "bread",
    "submarines", "the Sahara desert", "owls", "the telescope", "democracy", "tea", "lightning", "the violin",
    "coral reefs",
)  # fmt: skip
"""The chat prompts' subjects: "Explain <topic> in two sentences."."""


def export_for(model_dir: Path, fmt: str, group: int, head: str, int4_range: str, method: str, batch: int) -> Path:
    """The benchmarked artifact of format ``fmt`` (int4 group ``group`` and range ``int4_range``, values chosen by
    ``method``), LM head format ``head`` and batch ``batch`` (cached export); batch 1 also compiles the
    prompt-logprobs graph that perplexity needs."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=batch,
        sequence_length=SEQUENCE_LENGTH,
        prefill_chunk_size=CHUNK,
        weight_format=fmt,
        weight_group_size=group,
        lm_head_format=head,
        int4_range=int4_range,
        quantization_method=method,
        decode_logits=False,
        prompt_logprobs=batch == 1,
    )
    return cached_export(model_dir, config)


def measure_decode(artifact: str, batch: int, context: int, steps: int) -> dict[str, float]:
    """Median and p90 ms of a token-generation step with ``batch`` live rows after a ``context``-token prompt."""
    from benchmark.decode import measure_ours

    times = measure_ours(artifact, batch, steps, context)
    return {"median_ms": 1000 * statistics.median(times), "p90_ms": 1000 * sorted(times)[int(0.9 * len(times))]}


def run_fresh(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement (`measure_decode`, `perplexity` or `chat_tokens`) in a fresh interpreter (`benchmark.fresh`)."""
    return run_worker("benchmark.quantized", spec)


def text_ids(tokenizer: Any, count: int) -> list[int]:
    """The first ``count`` tokens of the Python documentation's topics (``pydoc_data.topics``), in a fixed order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:count]
    assert len(ids) == count, "the stdlib's pydoc topics are shorter than expected"
    return list(ids)


def perplexity(artifact: str, tokens: int) -> dict[str, float]:
    """exp of the mean negative log-likelihood of ``tokens`` tokens of `text_ids`, scored in windows of `WINDOW`
    tokens (each window's first token has no context in it and is not scored)."""
    from transformers import AutoTokenizer

    from optimum.neuron import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(artifact)
    ids = text_ids(AutoTokenizer.from_pretrained(artifact), tokens)
    window = min(WINDOW, tokens)
    nll, scored = 0.0, 0
    for start in range(0, tokens, window):
        chunk = torch.tensor([ids[start : start + window]])
        logprobs = model.score(chunk)[0]
        nll -= float(logprobs.sum())
        scored += logprobs.numel()
    return {"perplexity": math.exp(nll / scored), "scored_tokens": scored}


def chat_tokens(artifact: str, prompts: int, new: int) -> dict[str, Any]:
    """Greedy tokens of the first ``prompts`` chat prompts (`TOPICS`), ``new`` each, batched."""
    from transformers import AutoTokenizer

    from optimum.neuron import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(artifact)
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    batch = model.engine.config.batch_size
    out: list[list[int]] = []
    for first in range(0, prompts, batch):
        chats = [[{"role": "user", "content": f"Explain {t} in two sentences."}] for t in TOPICS[first : first + batch]]
        encoded: Any = tokenizer.apply_chat_template(
            chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
        )
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[])
        out.extend(generated[:, ids.shape[1] :].tolist())
    return {"tokens": out}


def _worker(spec: dict[str, Any]) -> None:
    tasks: dict[str, Any] = {"decode": measure_decode, "perplexity": perplexity, "chat": chat_tokens}
    answer(tasks[spec.pop("task")](**spec))


def step_bytes(artifact: Path) -> int:
    """Bytes one decode step reads from the stored weights (`peerbench.formats.decode_bytes`: every tensor but an
    untied embedding table)."""
    from benchmark.peerbench.formats import decode_bytes, safetensors_tensors

    return int(decode_bytes(safetensors_tensors(artifact / "model.safetensors"))["decode"])


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict[str, float]:
    """Share of prompts whose tokens all equal the reference's, and share of tokens before each first difference."""
    same = sum(a == b for a, b in zip(reference, tokens, strict=True))
    prefix = 0
    for a, b in zip(reference, tokens, strict=True):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return {"prompts_equal": same / len(reference), "tokens_before_difference": prefix / sum(map(len, reference))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="context 64 only, 8 steps, 1,024 text tokens, 8 prompts")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps (a 1,000-token context leaves 20)")
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    parser.add_argument(
        "--formats", help="comma-separated labels of FORMATS to measure (fp32 always; results then in quantized-subset)"
    )
    parser.add_argument("--name", help="results file name (default: quantized, quantized-subset or quantized-quick)")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    from optimum.neuron.progress import StepProgress
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    contexts = CONTEXTS[:1] if args.quick else CONTEXTS
    steps = 8 if args.quick else args.steps
    text, prompts = (1024, 8) if args.quick else (PERPLEXITY_TOKENS, CHAT_PROMPTS)
    model_dir = convert_smollm2(default_smollm2_dir("fp32"), dtype="fp32")
    labels = list(FORMATS) if not args.formats else ["fp32", *(f for f in args.formats.split(",") if f != "fp32")]
    unknown = set(labels) - set(FORMATS)
    if unknown:
        parser.error(f"--formats takes labels of {list(FORMATS)}; unknown: {sorted(unknown)}")
    artifacts = {(label, b): export_for(model_dir, *FORMATS[label], b) for label in labels for b in (1, 8)}
    bandwidth = read_bandwidth()
    command = " ".join([".venv/bin/python -m benchmark.quantized", *(shlex.quote(a) for a in sys.argv[1:])])
    body: dict[str, Any] = {
        "machine": describe(),
        "command": command,
        "read_gbs": bandwidth / 1e9,
        "steps": steps,
        "formats": {},
    }
    total = len(labels) * (2 * len(contexts) + 2)
    with StepProgress("benchmark quantized weights", total) as bar:
        for fmt in labels:
            row: dict[str, Any] = {"size_bytes": (artifacts[(fmt, 1)] / "model.safetensors").stat().st_size}
            row["step_bytes"] = step_bytes(artifacts[(fmt, 1)])
            row["floor_ms"] = 1000 * row["step_bytes"] / bandwidth
            for batch in (1, 8):
                for context in contexts:
                    with bar.step(f"{fmt} decode, batch {batch}, context {context}"):
                        spec = {"artifact": str(artifacts[(fmt, batch)]), "batch": batch, "context": context}
                        row[f"decode_b{batch}_c{context}"] = run_fresh({"task": "decode", **spec, "steps": steps})
            with bar.step(f"{fmt} perplexity over {text} tokens"):
                row.update(run_fresh({"task": "perplexity", "artifact": str(artifacts[(fmt, 1)]), "tokens": text}))
            with bar.step(f"{fmt} greedy tokens of {prompts} chat prompts"):
                chat = {"task": "chat", "artifact": str(artifacts[(fmt, 8)]), "prompts": prompts, "new": CHAT_NEW}
                row["chat_tokens"] = run_fresh(chat)["tokens"]
            body["formats"][fmt] = row
    reference = body["formats"]["fp32"]["chat_tokens"]
    for row in body["formats"].values():
        row["agreement"] = agreement(reference, row["chat_tokens"])
    body["contexts"] = list(contexts)
    name = args.name or ("quantized-quick" if args.quick else "quantized-subset" if args.formats else "quantized")
    save_results(RESULTS / args.machine / f"{name}.json", body, render(body))


def render(body: dict[str, Any]) -> str:
    """The markdown report: per format, size, decode ms against its floor and fp32, perplexity, agreement."""
    rows, fp32 = body["formats"], body["formats"]["fp32"]
    lines = [
        "# Weight-only quantization: SmolLM2-135M-Instruct, fp32 vs int8 vs int4 (inductor, CPU)",
        "",
        f"Command: `{body.get('command', '.venv/bin/python -m benchmark.quantized')}`. Machine: "
        + machine_line(body["machine"])
        + f". Read bandwidth measured in the run: {body['read_gbs']:.1f} GB/s. S={SEQUENCE_LENGTH}, C={CHUNK}; "
        f"decode = median of {body['steps']} steps after 3 warm-up, each cell in a fresh process. int8: per output "
        "channel; int4 gG: groups of G input columns (64: the default for SmolLM2), full: `--int4_range full` (16 "
        "levels, Q4_0's rule); gptq: `--quantization_method gptq` (values and scales chosen by GPTQ on the stdlib's "
        "docstrings); + int8 head: `--lm_head_format int8`, the tied embedding / LM head table int8 per "
        "vocabulary row (else fp32); norms fp32.",
        "",
        "| format | model.safetensors MB | x fp32 | bytes a step reads MB | floor ms |"
        + "".join(f" b{b} c{c} ms | x fp32 | x floor |" for b in (1, 8) for c in body["contexts"])
        + " perplexity | x fp32 | greedy prompts equal to fp32 | tokens before first difference |",
        "|---|---|---|---|---|" + "---|---|---|" * (2 * len(body["contexts"])) + "---|---|---|---|",
    ]
    for fmt, row in rows.items():
        cells = [
            fmt,
            f"{row['size_bytes'] / 1e6:.1f}",
            f"{row['size_bytes'] / fp32['size_bytes']:.2f}",
            f"{row['step_bytes'] / 1e6:.1f}",
            f"{row['floor_ms']:.2f}",
        ]
        for batch in (1, 8):
            for context in body["contexts"]:
                key = f"decode_b{batch}_c{context}"
                ms = row[key]["median_ms"]
                cells += [f"{ms:.1f}", f"{ms / fp32[key]['median_ms']:.2f}", f"{ms / row['floor_ms']:.2f}"]
        cells += [
            f"{row['perplexity']:.3f}",
            f"{row['perplexity'] / fp32['perplexity']:.4f}",
            f"{100 * row['agreement']['prompts_equal']:.0f}%",
            f"{100 * row['agreement']['tokens_before_difference']:.0f}%",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Perplexity: {rows['fp32']['scored_tokens']} tokens of the stdlib's `pydoc_data.topics` (sorted topics, "
        f"joined), scored by each artifact's prompt-logprobs graph in windows of {WINDOW}. Agreement: "
        f"{len(rows['fp32']['chat_tokens'])} chat prompts, {CHAT_NEW} greedy tokens each, batch-8 artifacts.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

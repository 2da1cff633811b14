"""The report of `benchmark.paged`: ``paged.md`` (tables and ratios) and ``paged.json`` (every run)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmark.machine import machine_line


def _runs(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def price_lines(price: dict[str, Any], baseline: str) -> list[str]:
    """The price of paging: decode ms/step, paged vs slot layout, and the shares of the block reads."""
    lines = [
        "## The price of paging: decode ms/step, batch 8",
        "",
        f"SmolLM2 fp32, S 2048, C 256, `--kv_buckets auto`, blocks of {price['block_size']} positions; every row "
        "at the given context, median of the decode steps of each fresh process (one value per round). The slot "
        f"layout is commit {baseline}, the last before paging. The token-generation graph gathers nothing: its "
        "attention reads the window's blocks where they lie (`optimum_neuron::paged_attention`); the fifth column is "
        "that kernel alone on the step's shapes (30 layers, window 256 at context 64, 2048 at context 2000) and its "
        "share of the paged step. A prefill chunk still gathers its window (`read_blocks`, K and V of 30 layers, one "
        "row): the last column.",
        "",
        "| context | paged ms/step | slot layout ms/step | paged / slot | decode attention ms (share) "
        "| chunk gather ms |",
        "|---|---|---|---|---|---|",
    ]
    for context, attention in price["attention_ms"].items():
        paged, slot = price["runs"][f"paged@{context}"], price["runs"][f"slot@{context}"]
        ratio = statistics.median(paged) / statistics.median(slot)
        share = 100 * attention / statistics.median(paged)
        gather = price["gather_ms"][context]
        lines.append(
            f"| {context} | {_runs(paged)} | {_runs(slot)} | **{ratio:.2f}x** | {attention:.1f} ({share:.0f} %) "
            f"| {gather:.2f} |"
        )
    return [*lines, "", f"1-minute load at the end of the part: {price['load']:.2f}.", ""]


def serve_lines(title: str, intro: str, runs: dict[str, list[dict[str, Any]]], base: str) -> list[str]:
    """One serving comparison: TTFT and throughput per mode, and each mode's ratio to ``base``."""
    lines = [
        f"## {title}",
        "",
        intro,
        "",
        "| | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | output tok/s | TTFT p50 / base | tok/s / base |",
        "|---|---|---|---|---|---|---|",
    ]
    reference = runs[base]
    for mode, results in runs.items():
        ttft = statistics.median([r["median_ttft_ms"] for r in results])
        tokens = statistics.median([r["output_throughput"] for r in results])
        base_ttft = statistics.median([r["median_ttft_ms"] for r in reference])
        base_tokens = statistics.median([r["output_throughput"] for r in reference])
        lines.append(
            f"| {mode} | {_runs([r['median_ttft_ms'] for r in results])} | {_runs([r['p90_ttft_ms'] for r in results])}"
            f" | {_runs([r['median_tpot_ms'] for r in results])} | {_runs([r['output_throughput'] for r in results])}"
            f" | **{ttft / base_ttft:.2f}x** | **{tokens / base_tokens:.2f}x** |"
        )
    loads = [r["load"] for results in runs.values() for r in results]
    return [*lines, "", f"1-minute load after each run: {_runs(loads)}.", ""]


def block_lines(blocks: dict[str, Any]) -> list[str]:
    """The block-size sweep."""
    lines = [
        "## Block size",
        "",
        "Milliseconds per decode step of the paged attention kernel (30 layers, batch 8, window 2048, 9 query / 3 KV "
        "heads of 64; on an fp32 cache, and on the same cache quantized to int8 with one scale per token and KV head) "
        "and of a prefill chunk's gather of a 2048-position window (30 layers x K and V), timed alone, the blocks "
        "spread over the pool.",
        "",
        "| block size | decode attention ms, fp32 KV | int8 KV | int8 / fp32 | prefill gather ms |",
        "|---|---|---|---|---|",
    ]
    for size, row in blocks.items():
        fp32, int8 = row["decode_attention_ms"], row.get("decode_attention_int8_ms")
        int8_cells = f"{int8:.1f} | **{int8 / fp32:.2f}x**" if int8 is not None else "— | —"
        lines.append(f"| {size} | {fp32:.1f} | {int8_cells} | {row['prefill_gather_ms']:.2f} |")
    return [*lines, ""]


def chunk_lines(chunks: dict[str, Any]) -> list[str]:
    """A prompt tail's prefill call with chunk-length buckets vs one chunk length."""
    lines = [
        "## A prompt's tail after a prefix hit: chunk-length buckets",
        "",
        "Milliseconds of the one prefill call holding the last N tokens of a prompt after 1,024 prefilled ones (what "
        "a prefix-cache hit leaves to compute, then the first token sampled), S 2048, C 256, batch 8; median of "
        f"{chunks['repeats']} fresh prompts per fresh process, one value per round. `--chunk_buckets auto` (the "
        "default: the call is padded to the shortest of 4, 8, ..., 256 holding N, one graph with a symbolic chunk "
        "length) against `--chunk_buckets none` (every call runs 256 columns, a static graph). The last row prices "
        "the symbolic dimension itself.",
        "",
        "| tail tokens | buckets ms | one length ms | buckets / one length |",
        "|---|---|---|---|",
    ]
    runs = chunks["runs"]
    for tail in runs["auto"][0]:
        ours, one = [r[tail] for r in runs["auto"]], [r[tail] for r in runs["none"]]
        ratio = statistics.median(ours) / statistics.median(one)
        lines.append(f"| {tail} | {_runs(ours)} | {_runs(one)} | **{ratio:.2f}x** |")
    return [*lines, "", f"1-minute load at the end of the part: {chunks['load']:.2f}.", ""]


def kv_int8_lines(kv: dict[str, Any]) -> list[str]:
    """The int8 KV cache against the fp32 one: decode ms/step per batch, and the caches' bytes."""
    auto, int8 = kv["cache_bytes"]["auto"], kv["cache_bytes"]["int8"]
    lines = [
        f"## int8 KV cache: decode ms/step after {kv['context']} tokens",
        "",
        f"SmolLM2 fp32 weights, S {kv.get('sequence_length', 1024)}, C 256, {kv['backend']}, every row live after a "
        f"{kv['context']}-token context; "
        "median of the decode steps of each fresh process (one value per round). `--kv_cache_dtype int8`: int8 K/V and "
        "a float32 scale per token and KV head, read by `optimum_neuron::paged_attention_int8`. Cache of the batch-8 "
        f"artifact: {auto / 2**20:.1f} MiB fp32, {int8 / 2**20:.1f} MiB int8 ({int8 / auto:.4f}).",
        "",
        "| batch | fp32 KV ms/step | int8 KV ms/step | int8 / fp32 |",
        "|---|---|---|---|",
    ]
    for batch in sorted({int(key.split("@")[1]) for key in kv["runs"]}):
        fp32, q8 = kv["runs"][f"auto@{batch}"], kv["runs"][f"int8@{batch}"]
        ratio = statistics.median(q8) / statistics.median(fp32)
        lines.append(f"| {batch} | {_runs(fp32)} | {_runs(q8)} | **{ratio:.2f}x** |")
    return [*lines, "", f"1-minute load at the end of the part: {kv['load']:.2f}.", ""]


def machine_lines(results: dict[str, Any]) -> list[str]:
    """The machine the parts were measured on: one line when they share it, else one per part (parts run at different
    times keep their own: `benchmark.paged.earlier_parts`)."""
    machines = results.get("machines") or {"": results["machine"]}
    described = {part: machine_line(machine) for part, machine in machines.items()}
    if len(set(described.values())) == 1:
        return [f"Machine: {next(iter(described.values()))}."]
    return ["Machines, per part:", "", *(f"- {part}: {line}." for part, line in described.items())]


def write_report(folder: Path, results: dict[str, Any]) -> None:
    """``paged.md`` and ``paged.json`` under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "paged.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# Paged KV cache: SmolLM2-135M-Instruct, fp32, inductor",
        "",
        f"Command: `.venv/bin/python -m benchmark.paged` ({results['rounds']} interleaved rounds; each value below is "
        "one round).",
        "",
        *machine_lines(results),
        "",
    ]
    if "blocks" in results:
        lines += block_lines(results["blocks"])
    if "price" in results:
        lines += price_lines(results["price"], results["baseline"])
    if "prefix" in results:
        intro = (
            "`vllm serve` of the S 2048, C 256, batch 8 artifact; `vllm bench serve --dataset-name prefix_repetition`: "
            "2 prefixes of 1,024 tokens, each request one of them + 64 tokens of its own, 32 new tokens, 4 users. "
            "Prefix caching on (vLLM's default) vs `--no-enable-prefix-caching`."
        )
        lines += serve_lines("Shared prefixes: prefix caching on vs off", intro, results["prefix"], "off")
    if "chunks" in results:
        lines += chunk_lines(results["chunks"])
    if "fit" in results:
        intro = (
            "32 users of short chats (random prompts of 100 tokens, 100 new tokens), S 4096, C 256: a batch-32 "
            "artifact whose pool holds 8 x 4096 positions (`--kv_cache_tokens 32768`: a quarter of 32 x 4096) "
            "against the batch-8 artifact with the same pool. vLLM admits by blocks."
        )
        lines += serve_lines(
            "Memory fit: batch 32 in the memory of batch 8", intro, results["fit"], "batch 8, pool 8 x 4096"
        )
    for part in ("kvint8", "kvint8-long"):
        if part in results:
            lines += kv_int8_lines(results[part])
    (folder / "paged.md").write_text("\n".join(lines))

"""Prompt-lookup speculative decoding on SmolLM2-135M-Instruct: ``generate(prompt_lookup_num_tokens=k)`` against
plain generation, in one run; with ``--vllm``, the same workloads through ``vllm.LLM`` with vLLM's n-gram proposer
(``speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 2}``) against no
speculation; with ``--vllm --draft D``, a draft artifact instead (``{"method": "draft_model", ...}``): SmolLM2 itself
with int8 or int4 weights (``--draft int8`` / ``int4``), or its first N decoder layers under its own norm and LM head
(``--draft layers:N``, an untrained early exit). There is no smaller model with SmolLM2's tokenizer here.

    .venv/bin/python -m benchmark.speculative [--quick] [--rounds N] [--batches 1,8]
        [--vllm [--draft int8|int4|layers:N] [--verify-every] [--requests N]] [--lookups 2,4,6]

Artifacts: fp32, inductor, S=1024, C=256, ``--speculation_length 6``, batch 1 and batch 8 (one verification graph each).
Workloads, greedy, a fixed number of new tokens (EOS does not stop them):

* **copy**: "Repeat the following passage exactly" over passages of the Python documentation (the stdlib's
  ``pydoc_data.topics``): the output quotes its input, where prompt lookup finds what comes next;
* **chat**: "Explain <topic> in two sentences.": little to copy, so proposals are rarely kept; speculation must not
  cost much there.

Per workload, batch and k (0: no speculation), in a fresh process after one warm-up call: output tokens per second
(every prompt's new tokens over the wall time of the `generate` calls), tokens per decode step (new tokens over
the engine steps that decode), the rows those steps decoded, and those steps' share of the wall time (with the work
between steps; the report bounds with it what the cell's tokens per step could give if its decode steps cost a plain
step); batch 8 runs 8 prompts in one `generate` call, or 16 through vLLM (more requests than slots; ``--requests N``
for more, which keeps the steps fuller for longer), and ``--draft`` measures batch 1 only (the draft artifact holds one
sequence). Every k's tokens are checked equal to k = 0's. Rounds interleave the k values.
Results: ``benchmark/results/<machine>/speculative.md`` and ``.json`` (``speculative-vllm.*`` with ``--vllm``, where
tokens per decode step come from the runner's step records and the kept share of the drafts from vLLM's spec-decode
counters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmark.fresh import answer, run_worker
from benchmark.machine import describe, machine_line, save_results
from benchmark.peerbench.versions import ours
from benchmark.quantized import TOPICS

RESULTS = Path(__file__).parent / "results"
MACHINE = "cpu-2core"
"""The default results subfolder (`--machine`)."""
SEQUENCE_LENGTH, CHUNK, SPECULATION = 1024, 256, 6
LOOKUPS = (0, 2, 4, 6)
PASSAGE_WORDS = 90
PASSAGE_POOL = 64
"""The copy workload's passages are the first of this many, evenly spaced over the documentation (`passages`)."""
REQUESTS = 16
"""Requests per batch-8 cell through vLLM by default (`--requests`)."""


def export_for(model_dir: Path, batch: int) -> Path:
    """The benchmarked artifact of batch ``batch``, with its verification graph (cached export)."""
    return cached_artifact(model_dir, batch, speculation_length=SPECULATION)


def draft_for(model_dir: Path, draft: str) -> Path:
    """The draft artifact ``draft`` names (batch 1, S and C of the target, no verification graph; cached export)."""
    if draft in ("int8", "int4"):
        return cached_artifact(model_dir, 1, weight_format=draft)
    return cached_artifact(first_layers(model_dir, int(draft.removeprefix("layers:"))), 1)


def cached_artifact(model_dir: Path, batch: int, **fields: Any) -> Path:
    """The minimal artifact (``--no_decode_logits``) of ``model_dir`` at batch ``batch``, S and C, with ``fields``
    (cached export)."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=batch, sequence_length=SEQUENCE_LENGTH, prefill_chunk_size=CHUNK, decode_logits=False, **fields
    )
    return cached_export(model_dir, config)


def first_layers(model_dir: Path, layers: int) -> Path:
    """A transformers folder of ``model_dir``'s first ``layers`` decoder layers with its embeddings, final norm and LM
    head (saved once beside it)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    out = model_dir.with_name(f"{model_dir.name}-first{layers}")
    if (out / "config.json").is_file():
        return out
    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype="float32")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    for name in model_dir.iterdir():  # tokenizer and chat template
        if name.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(name, partial / name.name)
    partial.rename(out)
    return out


def passages(count: int) -> list[str]:
    """The first ``count`` of `PASSAGE_POOL` passages of about `PASSAGE_WORDS` words, evenly spaced over the Python
    documentation: the same texts whatever the count, so that a batch-1 cell runs the first prompts of a batch-8 one."""
    from pydoc_data.topics import topics

    words = " ".join(topics[name] for name in sorted(topics)).split()
    step = len(words) // PASSAGE_POOL
    return [" ".join(words[i * step : i * step + PASSAGE_WORDS]) for i in range(count)]


def most_requests() -> int:
    """The most prompts a cell can have: one per passage and per chat topic."""
    return min(PASSAGE_POOL, len(TOPICS))


def prompts(workload: str, count: int) -> list[str]:
    """The first ``count`` user messages of ``workload`` (at most `most_requests`)."""
    if not 0 < count <= most_requests():
        raise ValueError(f"{count} prompts asked; the workloads hold 1 to {most_requests()}")
    if workload == "copy":
        return [f"Repeat the following passage exactly, word for word:\n\n{text}" for text in passages(count)]
    return [f"Explain {topic} in two sentences." for topic in TOPICS[:count]]


def measure(artifact: str, workload: str, count: int, new: int, lookup: int) -> dict[str, Any]:
    """Output tok/s and tokens per decode step of ``generate`` over ``count`` prompts of ``workload`` (batched by the
    artifact's batch size), prompt lookup ``lookup`` (0: none); and the tokens."""
    from transformers import AutoTokenizer

    from optimum.neuron import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(artifact)
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    batch = model.engine.config.batch_size
    engine, steps, rows, prefilling = model.engine, [0], [0], [0.0]
    step = engine.step

    def counted(work: Any, *args: Any, **kwargs: Any) -> Any:
        decode = all(n == 1 for n in work.values())
        started = time.perf_counter()
        result = step(work, *args, **kwargs)
        steps[0] += decode
        rows[0] += len(work) if decode else 0
        prefilling[0] += 0.0 if decode else time.perf_counter() - started
        return result

    def run(messages: list[str]) -> list[list[int]]:
        chats = [[{"role": "user", "content": m}] for m in messages]
        encoded: Any = tokenizer.apply_chat_template(
            chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
        )
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[], **extra)
        return list(out[:, ids.shape[1] :].tolist())

    texts = prompts(workload, count)
    run(texts[:batch])  # warm-up
    engine.step = counted  # type: ignore[method-assign]
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, count, batch):
        tokens.extend(run(texts[first : first + batch]))
    seconds = time.perf_counter() - start
    made = sum(map(len, tokens))
    return {
        "tok_s": made / seconds,
        "tokens_per_step": made / max(steps[0], 1),
        "rows_per_step": rows[0] / max(steps[0], 1),
        "decode_share": 1 - prefilling[0] / seconds,  # the decode steps with the host's work between steps
        "tokens": tokens,
    }


def measure_vllm(
    artifact: str, workload: str, count: int, new: int, lookup: int, draft: str | None = None, every: bool = False
) -> dict[str, Any]:
    """`measure` through ``vllm.LLM`` (all prompts in one ``generate`` call, vLLM's n-gram proposer, or the draft
    artifact ``draft``, drafting ``lookup`` tokens; 0: no speculation; ``every``: every n-gram proposal verified, the
    worker's gate off), plus the share of the drafted tokens the verification kept."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    spec: dict[str, Any] | None = None
    if lookup:
        method = {"method": "draft_model", "model": draft} if draft else {"method": "ngram", "prompt_lookup_max": 2}
        spec = {**method, "num_speculative_tokens": lookup}
    extra = {"verify_every_proposal": True} if every else {}
    llm = LLM(model=artifact, seed=0, speculative_config=spec, additional_config=extra, disable_log_stats=False)
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    texts = prompts(workload, count)
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, return_dict=True)
        for m in texts
    ]
    requests: Any = [{"prompt_token_ids": list(chat["input_ids"])} for chat in chats]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate(requests[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    before = len(llm.collective_rpc("step_records")[0])
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    records = llm.collective_rpc("step_records")[0][before:]
    steps = [r for r in records if decode_only(r)]
    metrics = llm.get_metrics()
    counters = {m.name: float(getattr(m, "value", 0.0)) for m in metrics if m.name.startswith("vllm:spec_decode_num_")}
    drafted = counters.get("vllm:spec_decode_num_draft_tokens", 0.0)
    made = sum(map(len, tokens))
    return {
        "tok_s": made / seconds,
        "tokens_per_step": made / max(len(steps), 1),
        "rows_per_step": rows_per_step(steps),
        "kept": counters.get("vllm:spec_decode_num_accepted_tokens", 0.0) / drafted if drafted else 0.0,
        "decode_share": decode_seconds(records) / seconds,
        "tokens": tokens,
    }


def decode_only(record: dict[str, Any]) -> bool:
    """Whether the worker's step ``record`` only decoded (no prompt tokens fed)."""
    return bool(record["decodes"]) and not record["prefills"]


def rows_per_step(steps: list[dict[str, Any]]) -> float:
    """The mean number of sequences the decode-only step records ``steps`` decoded (0.0 without any)."""
    return sum(len(r["decodes"]) for r in steps) / len(steps) if steps else 0.0


def decode_seconds(records: list[dict[str, Any]]) -> float:
    """The time the decode-only steps among the worker's step ``records`` took, each from its start to the next step's
    (so with the scheduler's work between them: it too is paid once per step)."""
    if not records:
        return 0.0
    ends = [r["started"] for r in records[1:]] + [records[-1]["started"] + records[-1]["seconds"]]
    return sum(end - r["started"] for r, end in zip(records, ends, strict=True) if decode_only(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="batch 1 only, 2 prompts of 32 tokens, k 0 and 4")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (each cell: the median)")
    parser.add_argument("--new", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--machine", default=MACHINE, help="results subfolder name")
    parser.add_argument("--vllm", action="store_true", help="through vllm.LLM and vLLM's n-gram proposer")
    parser.add_argument("--draft", help="with --vllm: a draft artifact instead, int8, int4 or layers:N of SmolLM2")
    parser.add_argument(
        "--verify-every", action="store_true", help="with --vllm: the worker's gate off (every proposal verified)"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=REQUESTS,
        help=f"with --vllm: requests per batch-8 cell (default {REQUESTS}; more keep 8 rows decoding longer: results "
        "-r<N>)",
    )
    parser.add_argument("--lookups", help="comma-separated k values to measure (default 0,2,4,6; 0 is always run)")
    parser.add_argument(
        "--batches",
        help="comma-separated batch sizes to measure (default 1,8; the results' name then ends in -b<sizes>)",
    )
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        worker = measure_vllm if spec.pop("vllm", False) else measure
        answer(worker(**spec))
        return
    from optimum.neuron.progress import StepProgress
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    batches: tuple[int, ...]
    lookups: tuple[int, ...]
    batches, lookups, new = ((1,), (0, 4), 32) if args.quick else ((1,) if args.draft else (1, 8), LOOKUPS, args.new)
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    if args.lookups:
        lookups = tuple(sorted({0, *(int(k) for k in args.lookups.split(","))}))
    try:
        prompts("copy", args.requests)  # the one rule on how many prompts a cell can have
    except ValueError as err:
        parser.error(f"--requests: {err} (one prompt per passage and chat topic)")
    model_dir = convert_smollm2(default_smollm2_dir("fp32"), dtype="fp32")
    artifacts = {batch: str(export_for(model_dir, batch)) for batch in batches}
    draft = str(draft_for(model_dir, args.draft)) if args.draft else None
    cells = [(w, b, k) for w in ("copy", "chat") for b in batches for k in lookups]
    every = {"every": True} if args.verify_every else {}
    samples: dict[str, list[dict[str, Any]]] = {}
    with StepProgress("benchmark prompt-lookup speculation", args.rounds * len(cells)) as bar:
        for _ in range(args.rounds):
            for workload, batch, lookup in cells:
                count = 2 if args.quick else prompt_count(batch, args.vllm, args.requests)
                with bar.step(f"{workload}, batch {batch}, k {lookup}"):
                    spec = {"artifact": artifacts[batch], "workload": workload, "count": count, "new": new}
                    found = run_worker(
                        "benchmark.speculative",
                        {**spec, "lookup": lookup, "vllm": args.vllm, **({"draft": draft} if draft else {}), **every},
                    )
                    samples.setdefault(f"{workload} b{batch} k{lookup}", []).append(found)
    body = {"machine": describe(), "rounds": args.rounds, "new": new, "lookups": list(lookups), "cells": {}}
    body["vllm"], body["draft"], body["verify_every"] = args.vllm, args.draft, args.verify_every
    body["batches"] = list(batches) if args.batches else None
    body["requests"] = args.requests if args.vllm and 8 in batches else None
    body["results"], body["code"], body["ended"] = (
        args.machine,
        ours(),
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    for key, runs in samples.items():
        body["cells"][key] = {
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in runs),
            "rows_per_step": statistics.median(r["rows_per_step"] for r in runs),
            "kept": statistics.median(r.get("kept", 0.0) for r in runs),
            "decode_share": statistics.median(r["decode_share"] for r in runs),
            "tokens": runs[0]["tokens"],
        }
    drafted = f"-draft-{args.draft.replace(':', '')}" if args.draft else ""
    everyone = "-every" if args.verify_every else ""
    sized = "-b" + "-".join(map(str, batches)) if args.batches else ""
    sized += f"-r{args.requests}" if body["requests"] not in (None, REQUESTS) else ""
    sized += "-k" + "-".join(map(str, lookups)) if args.lookups else ""
    name = (
        "speculative" + ("-vllm" if args.vllm else "") + drafted + everyone + sized + ("-quick" if args.quick else "")
    )
    save_results(RESULTS / args.machine / f"{name}.json", body, render(body, batches))


def prompt_count(batch: int, vllm: bool, requests: int = REQUESTS) -> int:
    """Prompts per cell: 4 at batch 1; at batch 8, 8 in one `generate` call, or ``requests`` through vLLM, whose
    scheduler admits a waiting request as soon as a running one finishes (more requests than slots: with few, the last
    requests decode nearly alone, and the steps hold fewer rows, the more so when speculation ends some early)."""
    return 4 if batch == 1 else (requests if vllm else 8)


def render(body: dict[str, Any], batches: tuple[int, ...]) -> str:
    """The markdown report: per workload and batch, tok/s and tokens per step of each k against k = 0."""
    cells, vllm, draft = body["cells"], body.get("vllm", False), body.get("draft")
    through = "`vllm.LLM`, vLLM's n-gram proposer" if vllm else "`generate(prompt_lookup_num_tokens=k)`"
    title = "Prompt-lookup speculative decoding"
    if draft:
        through, title = f"`vllm.LLM`, the draft artifact `{draft}` of SmolLM2", "Draft-model speculative decoding"
    flags = (" --vllm" if vllm else "") + (f" --draft {draft}" if draft else "")
    flags += " --verify-every" if body.get("verify_every") else ""
    flags += f" --batches {','.join(map(str, body['batches']))}" if body.get("batches") else ""
    flags += f" --requests {body['requests']}" if body.get("requests") not in (None, REQUESTS) else ""
    flags += f" --lookups {','.join(map(str, body['lookups'][1:]))}" if tuple(body["lookups"]) != LOOKUPS else ""
    flags += f" --rounds {body['rounds']}" if body.get("rounds", 1) > 1 else ""
    flags += f" --machine {body['results']}" if body.get("results", MACHINE) != MACHINE else ""
    if vllm and not draft:
        through += " with every proposal verified" if body.get("verify_every") else ", gated by `DraftGate`"
    lines = [
        f"# {title} ({through}): SmolLM2-135M-Instruct fp32, inductor, CPU",
        "",
        f"Command: `.venv/bin/python -m benchmark.speculative{flags}`. Machine: "
        + machine_line(body["machine"])
        + f". S={SEQUENCE_LENGTH}, C={CHUNK}, `--speculation_length {SPECULATION}`; greedy, {body['new']} new tokens "
        f"per prompt (EOS not stopping them); each cell in a fresh process, the median of {body['rounds']} "
        "interleaved round(s)." + (f" Code: {body['code']}; ended {body['ended']}." if "code" in body else ""),
        "",
        "| workload | batch | k | output tok/s | x k=0 | tokens per decode step | rows per decode step | drafts kept "
        "| decode steps' share of the time | x k=0 if its decode steps cost k=0's | tokens equal to k=0 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in ("copy", "chat"):
        for batch in batches:
            base = cells[f"{workload} b{batch} k0"]
            for lookup in body["lookups"]:
                cell = cells[f"{workload} b{batch} k{lookup}"]
                same = "yes" if cell["tokens"] == base["tokens"] else "NO"
                kept = f"{100 * cell['kept']:.0f} %" if vllm and lookup else "-"
                share = f"{100 * cell['decode_share']:.0f} %" if "decode_share" in cell else "-"
                free = f"{free_verification(base, cell):.2f}x" if lookup and "decode_share" in base else "-"
                rows = f"{cell['rows_per_step']:.2f}" if "rows_per_step" in cell else "-"
                lines.append(
                    f"| {workload} | {batch} | {lookup} | {cell['tok_s']:.1f} | {cell['tok_s'] / base['tok_s']:.2f}x "
                    f"| {cell['tokens_per_step']:.2f} | {rows} | {kept} | {share} | {free} | {same} |"
                )
    lines += ["", FREE_NOTE]
    return "\n".join(lines) + "\n"


FREE_NOTE = (
    "Rows per decode step: the sequences a step that only decodes advanced, on average (the tokens per step are "
    "theirs together). Decode steps' share of the time: of the wall time of a cell's calls, the steps that only "
    "decode (no prompt tokens), each with the work between it and the next step. x k=0 if its decode steps cost "
    "k=0's: the speedup the cell's tokens per decode step would give if each of its decode steps (a verification "
    "call, the drafting) cost what a plain decode step of k=0 costs, the rest of the time (the steps that prefill) "
    "as at k=0: 1 / (1 - p + p x s0 / s), p and s0 the k=0 cell's share and tokens per decode step, s this cell's. "
    "It bounds what speculation at this cell's tokens per step can give; the measured x k=0 falls short of it by "
    "what the verification calls' extra columns and the drafting cost."
)


def free_verification(base: dict[str, Any], cell: dict[str, Any]) -> float:
    """The speedup over ``base`` (k = 0) that ``cell``'s tokens per decode step would give if each of its decode
    steps cost what one of ``base``'s does and the rest of the time (prefills) stayed ``base``'s."""
    share = base["decode_share"]
    return 1 / (1 - share + share * base["tokens_per_step"] / cell["tokens_per_step"])


if __name__ == "__main__":
    main()

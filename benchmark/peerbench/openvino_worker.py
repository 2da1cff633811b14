"""OpenVINO GenAI measurements, run by the OpenVINO venv's interpreter (stdlib, numpy and OpenVINO only: this
file never imports the project, whose dependencies that venv does not have):

    <peers>/openvino-venv/bin/python benchmark/peerbench/openvino_worker.py SPEC.json    # prints one JSON line

Every pipeline runs on ``CPU`` with ``INFERENCE_NUM_THREADS`` threads, fp32 inference and an fp32 KV cache (the
same precision as ours; OpenVINO's CPU defaults are bf16 inference where the CPU has it and a u8 KV cache).
Prompts are token ids (`TokenizedInputs`: no chat template, no tokenizer in the timing).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from importlib import metadata
from typing import Any

SPLIT_FUSE_BUDGET = 256
"""The continuous-batching pipeline's token budget per step (its chunked prefill: prompt chunks fill what the
running decodes leave of it), the same as our prefill chunk."""


def properties(spec: dict[str, Any]) -> dict[str, Any]:
    """The CPU plugin's settings for every pipeline."""
    return {"INFERENCE_NUM_THREADS": spec["threads"], "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def config(new_tokens: int) -> Any:
    """Greedy, exactly ``new_tokens`` tokens."""
    import openvino_genai

    gen = openvino_genai.GenerationConfig()
    gen.max_new_tokens, gen.min_new_tokens, gen.ignore_eos, gen.do_sample = new_tokens, new_tokens, True, False
    return gen


def tokens(ids: list[int]) -> Any:
    """One prompt as `TokenizedInputs` (int64 ids, all attended)."""
    import numpy
    import openvino
    import openvino_genai

    array = numpy.array([ids], dtype=numpy.int64)
    return openvino_genai.TokenizedInputs(openvino.Tensor(array), openvino.Tensor(numpy.ones_like(array)))


def llm_pipeline(spec: dict[str, Any]) -> Any:
    """`LLMPipeline` with its defaults but for the threads and precisions, warmed up by one short generate."""
    import openvino_genai

    pipe = openvino_genai.LLMPipeline(spec["ir"], "CPU", **properties(spec))
    pipe.generate(tokens(spec["warmup"]), config(4))
    return pipe


def decode(spec: dict[str, Any]) -> dict[str, Any]:
    """Batch 1: ``steps`` tokens after a short prompt; time per output token from the pipeline's own metrics
    (TPOT) and from the wall time (minus the time to first token) as a check."""
    pipe = llm_pipeline(spec)
    start = time.perf_counter()
    result = pipe.generate(tokens(spec["prompts"][0]), config(spec["steps"]))
    wall = time.perf_counter() - start
    metrics = result.perf_metrics
    ttft = metrics.get_ttft().mean
    generated = len(result.tokens[0])
    return {
        "tpot_ms": metrics.get_tpot().mean,
        "wall_tpot_ms": (1000 * wall - ttft) / max(generated - 1, 1),
        "tokens": generated,
    }


def prefill(spec: dict[str, Any]) -> dict[str, Any]:
    """Time to first token (the pipeline's TTFT metric) of each prompt, one new token each; the first prompt of
    each length is a warm-up, every prompt is new (nothing for the prefix cache to reuse)."""
    pipe = llm_pipeline(spec)
    out = {}
    for length, prompts in spec["prompts"].items():
        times = [pipe.generate(tokens(p), config(1)).perf_metrics.get_ttft().mean for p in prompts]
        out[length] = statistics.median(times[1:])
    return out


def batching_pipeline(spec: dict[str, Any]) -> Any:
    """`ContinuousBatchingPipeline` with split-fuse (budget `SPLIT_FUSE_BUDGET`), no prefix caching, 1 GB of
    KV cache, warmed up by one short request."""
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.dynamic_split_fuse, scheduler.max_num_batched_tokens = True, SPLIT_FUSE_BUDGET
    scheduler.enable_prefix_caching, scheduler.cache_size = False, 1
    pipe = openvino_genai.ContinuousBatchingPipeline(spec["ir"], scheduler, "CPU", properties(spec))
    run_requests(pipe, [spec["warmup"]], 4, first_id=1000)
    return pipe


def run_requests(pipe: Any, prompts: list[list[int]], new_tokens: int, first_id: int = 0) -> tuple[list[float], int]:
    """Add every prompt (request ids from ``first_id``), then step until all finish; each step's seconds and the
    tokens generated. The handles are kept until the end (a dropped handle cancels its request)."""
    import numpy
    import openvino

    gen = config(new_tokens)
    handles = [
        pipe.add_request(first_id + i, openvino.Tensor(numpy.array([p], dtype=numpy.int64)), gen)
        for i, p in enumerate(prompts)
    ]
    steps = []
    while pipe.has_non_finished_requests():
        start = time.perf_counter()
        pipe.step()
        steps.append(time.perf_counter() - start)
    generated = sum(len(output.generated_ids) for handle in handles for output in handle.read_all())
    return steps, generated


def decode_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """Batch 8 through the continuous-batching pipeline: 8 short prompts (all prefilled in the first step), then
    decode steps of 8 rows; the mean of those steps after 3 warm-up ones (the last step, which finishes the
    requests, left out)."""
    pipe = batching_pipeline(spec)
    steps, _ = run_requests(pipe, spec["prompts"], spec["steps"] + 4)
    decodes = steps[4:-1]
    return {"step_ms": 1000 * statistics.mean(decodes), "median_ms": 1000 * statistics.median(decodes)}


def workload(spec: dict[str, Any]) -> dict[str, Any]:
    """The batch workload: every prompt added at once, ``new_tokens`` each; output tokens per second of wall."""
    pipe = batching_pipeline(spec)
    start = time.perf_counter()
    steps, generated = run_requests(pipe, spec["prompts"], spec["new_tokens"])
    wall = time.perf_counter() - start
    return {"tokens": generated, "wall_s": wall, "tok_s": generated / wall, "steps": len(steps)}


def versions(spec: dict[str, Any]) -> dict[str, Any]:
    """The versions of the OpenVINO stack in this venv."""
    names = ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "transformers", "torch")
    return {name: metadata.version(name) for name in names}


PLUGIN_PROPERTIES = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE")
"""What the report says of the CPU plugin's numerics: the precisions we set, and the group size of the dynamic
quantization of activations that the plugin may apply to layers with compressed weights (0 = off; left at its
default)."""


def forward(compiled: Any, steps: list[tuple[int, int]]) -> list[float]:
    """Run the IR's stateful model on a fresh sequence, ``(start, tokens)`` at a time (a prompt, then decode steps):
    each call's milliseconds."""
    import numpy

    request, names = compiled.create_infer_request(), {i.get_any_name() for i in compiled.inputs}
    times = []
    for start, count in steps:
        feed = {
            "input_ids": numpy.arange(100 + start, 100 + start + count, dtype=numpy.int64)[None],
            "attention_mask": numpy.ones((1, start + count), dtype=numpy.int64),
            "position_ids": numpy.arange(start, start + count, dtype=numpy.int64)[None],
            "beam_idx": numpy.zeros(1, dtype=numpy.int32),
        }
        begin = time.perf_counter()
        request.infer({k: v for k, v in feed.items() if k in names})
        times.append(1000 * (time.perf_counter() - begin))
    return times


def plugin(spec: dict[str, Any]) -> dict[str, Any]:
    """What the CPU plugin does with the IR compiled with the pipelines' `properties`: its `PLUGIN_PROPERTIES`; the
    kernels its matrix products ran (``{"layer type, kernel, weight precision": count}`` from the runtime model; the
    kernel's name does not tell the activations' precision); and, to tell whether its dynamic quantization of
    activations is in effect, a 256-token forward of the IR (no pipeline: logits for every position) and a decode
    step, in ms (best of 2 sequences), with its default and with ``DYNAMIC_QUANTIZATION_GROUP_SIZE=0`` (off)."""
    import openvino

    core, xml = openvino.Core(), f"{spec['ir']}/openvino_model.xml"
    compiled = core.compile_model(xml, "CPU", properties(spec))
    values = {name: compiled.get_property(name) for name in PLUGIN_PROPERTIES}
    out: dict[str, Any] = {
        name: str(v.get_type_name() if hasattr(v, "get_type_name") else v) for name, v in values.items()
    }
    steps = [(0, 256), (256, 1), (257, 1), (258, 1), (259, 1)]
    runs = [forward(compiled, steps) for _ in range(2)]
    kernels: dict[str, int] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if "layerType" in info and info["layerType"].astype(str) in ("FullyConnected", "MatMul"):
            fields = (info[key].astype(str) for key in ("layerType", "primitiveType", "runtimePrecision"))
            key = ", ".join(fields)
            kernels[key] = kernels.get(key, 0) + 1
    off = core.compile_model(xml, "CPU", properties(spec) | {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
    runs_off = [forward(off, steps) for _ in range(2)]

    def best(times: list[list[float]]) -> dict[str, float]:
        return {"forward_256_ms": min(t[0] for t in times), "decode_ms": min(statistics.mean(t[1:]) for t in times)}

    return out | {"kernels": kernels, "default": best(runs), "dynamic_quantization_off": best(runs_off)}


def perplexity(spec: dict[str, Any]) -> dict[str, Any]:
    """exp of the mean negative log-likelihood of ``spec["ids"]`` under the IR compiled with the pipelines'
    `properties`, scored in windows of ``spec["window"]`` tokens, each on a fresh sequence (its first token has no
    context and is not scored): the protocol of our `benchmark.quantized.perplexity`, in float64."""
    import numpy
    import openvino

    compiled = openvino.Core().compile_model(f"{spec['ir']}/openvino_model.xml", "CPU", properties(spec))
    names = {i.get_any_name() for i in compiled.inputs}
    ids, window = spec["ids"], spec["window"]
    nll, scored = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = numpy.array(ids[start : start + window], dtype=numpy.int64)[None]
        feed = {
            "input_ids": chunk,
            "attention_mask": numpy.ones_like(chunk),
            "position_ids": numpy.arange(chunk.shape[1], dtype=numpy.int64)[None],
            "beam_idx": numpy.zeros(1, dtype=numpy.int32),
        }
        request = compiled.create_infer_request()
        logits = request.infer({k: v for k, v in feed.items() if k in names})[compiled.output(0)][0, :-1]
        logits = logits.astype(numpy.float64)
        top = logits.max(axis=-1, keepdims=True)
        logz = top[:, 0] + numpy.log(numpy.exp(logits - top).sum(axis=-1))
        picked = logits[numpy.arange(logits.shape[0]), chunk[0, 1:]]
        nll += float((logz - picked).sum())
        scored += logits.shape[0]
    return {"perplexity": math.exp(nll / scored), "scored_tokens": scored}


MEASUREMENTS = {
    "decode": decode,
    "decode_batch": decode_batch,
    "prefill": prefill,
    "workload": workload,
    "versions": versions,
    "plugin": plugin,
    "perplexity": perplexity,
}


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        SPEC = json.load(handle)
    print("PEERS_RESULT " + json.dumps(MEASUREMENTS[SPEC["measure"]](SPEC)))

"""Multi-LoRA on SmolLM2-135M-Instruct through ``vllm.LLM``: what adapter slots cost, in one run.

    .venv/bin/python -m benchmark.lora [--rounds N] [--machine NAME]

Two artifacts, fp32, inductor, batch 8, S=1024, C=256: one without adapter slots, one with ``--max_loras 4
--max_lora_rank 16`` (every projection). Three cells, each in a fresh process after one warm-up call: 16 chat prompts
(``benchmark.quantized.TOPICS``), 64 new tokens each (EOS not stopping them, greedy), all in one ``generate`` call:

* **plain**: the artifact without slots;
* **LoRA artifact, base model**: every request on the base model (slot 0: the adapter products run, on zeros);
* **LoRA artifact, 4 adapters**: the requests spread over 4 random rank-16 PEFT adapters (made here with peft, B not
  zero), loaded through vLLM's ``LoRARequest``.

Output tok/s (new tokens over the wall time of the call) and its ratio to plain; and the time to load one adapter
into a slot (``NeuronModelForCausalLM.load_adapter``: read the PEFT folder, copy into the slot), median of 5.
Results: ``benchmark/results/<machine>/lora.md`` and ``.json``.
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
from benchmark.quantized import TOPICS

RESULTS = Path(__file__).parent / "results"
SEQUENCE_LENGTH, CHUNK, BATCH, LORAS, RANK = 1024, 256, 8, 4, 16
PROMPTS, NEW = 16, 64
CELLS = ("plain", "lora-base", "lora-4")
LABELS = {
    "plain": "artifact without adapter slots",
    "lora-base": f"`--max_loras {LORAS} --max_lora_rank {RANK}`, every request on the base model",
}
"""The report labels of the cells `benchmark.lora` and `benchmark.lora_serve` share."""


def export_for(model_dir: Path, slots: bool, sequence_length: int = SEQUENCE_LENGTH) -> Path:
    """The benchmarked artifact, with or without adapter slots (cached export)."""
    from optimum.exporters.neuron.export import cached_export
    from optimum.neuron.config import NeuronConfig

    config = NeuronConfig(
        batch_size=BATCH,
        sequence_length=sequence_length,
        prefill_chunk_size=CHUNK,
        max_loras=LORAS if slots else 0,
        max_lora_rank=RANK if slots else 0,
    )
    return cached_export(model_dir, config)


def adapters(model_dir: Path) -> list[Path]:
    """4 random rank-16 PEFT adapters of every projection of ``model_dir``'s model (made once, beside it)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    found = []
    for seed in range(LORAS):
        folder = model_dir.with_name(f"{model_dir.name}-lora-r{RANK}-s{seed}")
        if not (folder / "adapter_config.json").is_file():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets, init_lora_weights=False)
            get_peft_model(model, config).save_pretrained(folder)
        found.append(folder)
    return found


def measure(artifact: str, adapter_paths: list[str] | None, lora: bool) -> dict[str, Any]:
    """Output tok/s of `PROMPTS` chats through ``vllm.LLM`` (``adapter_paths``: spread the requests over them)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    extra = {"enable_lora": True, "max_loras": LORAS, "max_lora_rank": RANK} if lora else {}
    llm = LLM(model=artifact, seed=0, **extra)
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Explain {topic} in two sentences."}],
            add_generation_prompt=True,
            return_dict=True,
        )
        for topic in TOPICS[:PROMPTS]
    ]
    requests: Any = [{"prompt_token_ids": list(chat["input_ids"])} for chat in chats]
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapter_paths or [])]
    per_request = [loras[i % len(loras)] for i in range(PROMPTS)] if loras else None
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    llm.generate(requests[: len(loras) or 1], SamplingParams(max_tokens=4), lora_request=loras or None, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, lora_request=per_request, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / seconds}


def load_time(artifact: str, adapter_path: str) -> dict[str, Any]:
    """Median seconds of `NeuronModelForCausalLM.load_adapter` (then ``delete_adapter``), 5 times."""
    from optimum.neuron import NeuronModelForCausalLM

    model = NeuronModelForCausalLM.from_pretrained(artifact)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        model.load_adapter(adapter_path, "x")
        times.append(time.perf_counter() - start)
        model.delete_adapter("x")
    return {"load_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (each cell: the median)")
    parser.add_argument("--machine", default="cpu-2core", help="results subfolder name")
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        worker = load_time if spec.pop("load", False) else measure
        answer(worker(**spec))
        return
    from optimum.neuron.progress import StepProgress
    from optimum.neuron.smollm2 import convert_smollm2, default_smollm2_dir

    model_dir = convert_smollm2(default_smollm2_dir("fp32"), dtype="fp32")
    plain, slots = str(export_for(model_dir, False)), str(export_for(model_dir, True))
    paths = [str(p) for p in adapters(model_dir)]
    specs = {
        "plain": {"artifact": plain, "adapter_paths": None, "lora": False},
        "lora-base": {"artifact": slots, "adapter_paths": None, "lora": True},
        "lora-4": {"artifact": slots, "adapter_paths": paths, "lora": True},
    }
    samples: dict[str, list[float]] = {c: [] for c in CELLS}
    with StepProgress("benchmark multi-LoRA", args.rounds * len(CELLS) + 1) as bar:
        for _ in range(args.rounds):
            for cell in CELLS:
                with bar.step(cell):
                    samples[cell].append(run_worker("benchmark.lora", specs[cell])["tok_s"])
        with bar.step("adapter load time"):
            loaded = run_worker("benchmark.lora", {"load": True, "artifact": slots, "adapter_path": paths[0]})["load_s"]
    body = {
        "machine": describe(),
        "rounds": args.rounds,
        "tok_s": {c: statistics.median(v) for c, v in samples.items()},
        "load_s": loaded,
    }
    save_results(RESULTS / args.machine / "lora.json", body, render(body))


def render(body: dict[str, Any]) -> str:
    """The markdown report."""
    tok = body["tok_s"]
    labels = {**LABELS, "lora-4": f"the same artifact, requests spread over {LORAS} random rank-{RANK} adapters"}
    lines = [
        "# Multi-LoRA: SmolLM2-135M-Instruct fp32, inductor, CPU, through `vllm.LLM`",
        "",
        "Command: `.venv/bin/python -m benchmark.lora`. Machine: "
        + machine_line(body["machine"])
        + f". Batch {BATCH}, S={SEQUENCE_LENGTH}, C={CHUNK}; {PROMPTS} chat prompts, {NEW} new tokens each (greedy, "
        f"EOS not stopping them), one `generate` call; each cell in a fresh process, the median of {body['rounds']} "
        "round(s).",
        "",
        "| cell | output tok/s | x plain |",
        "|---|---|---|",
    ]
    for cell in CELLS:
        lines.append(f"| {labels[cell]} | {tok[cell]:.1f} | {tok[cell] / tok['plain']:.2f}x |")
    lines += ["", f"Loading one rank-{RANK} adapter into a slot (`load_adapter`, median of 5): {body['load_s']:.3f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

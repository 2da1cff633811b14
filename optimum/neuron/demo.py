"""``make demo``: chat with SmolLM2-135M-Instruct running as compiled static graphs with chunked prefill.

    python -m optimum.neuron.demo [--prompt "Your question"] [--max-new-tokens 48]

Converts the bundled GGUF (cached), exports it with the AOTInductor backend (fp32, chunked prefill;
the export cache makes later runs fast), loads it with `NeuronModelForCausalLM` and answers a few
questions greedily, printing each answer and its speed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
)
DTYPE = "fp32"  # bf16 is slower on a CPU without AVX2
BATCH_SIZE = 1
SEQUENCE_LENGTH = 1024
PREFILL_CHUNK_SIZE = 256
BACKEND = "inductor"


@dataclass(frozen=True)
class Answer:
    """One chat turn: the answer text, the token counts and the wall time of ``generate``."""

    text: str
    prompt_tokens: int
    new_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of the whole ``generate`` call (the prompt's prefill included)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def prepare_artifact() -> Path:
    """Convert SmolLM2 (cached) and export it (export cache); returns the artifact directory."""
    from ..exporters.neuron.export import export
    from .cache_dir import cache_root
    from .config import NeuronConfig
    from .smollm2 import convert_smollm2, default_smollm2_dir

    model_dir = convert_smollm2(default_smollm2_dir(DTYPE), dtype=DTYPE)
    config = NeuronConfig(
        batch_size=BATCH_SIZE,
        sequence_length=SEQUENCE_LENGTH,
        prefill_chunk_size=PREFILL_CHUNK_SIZE,
        auto_cast_type=DTYPE,
        backend=BACKEND,
    )
    target = cache_root() / "demo" / f"smollm2-{DTYPE}-{BACKEND}-{BATCH_SIZE}x{SEQUENCE_LENGTH}x{PREFILL_CHUNK_SIZE}"
    return export(model_dir, target, config)


def prepare_in_child() -> Path:
    """`prepare_artifact` in a fresh interpreter (its progress shows on this terminal): a process that has
    just compiled graphs runs them several times slower, which would misreport the demo's speed."""
    cmd = [sys.executable, "-m", "optimum.neuron.demo", "--prepare-only"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"preparing the SmolLM2 artifact failed (exit code {done.returncode}); see the error above.")
    return Path(lines[-1])


def _prepare_and_print() -> None:
    """The child's side of `prepare_in_child`: the artifact path on stdout, a typed error as one clear line."""
    from .errors import NeuronError

    try:
        print(prepare_artifact())
    except NeuronError as err:
        raise SystemExit(f"error: {err}") from err


def chat_ids(tokenizer: Any, question: str) -> Any:
    """``[1, L]`` token ids of ``question`` as a user turn in the ChatML template, ready for the answer."""
    messages = [{"role": "user", "content": question}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return encoded["input_ids"]


def ask(model: Any, tokenizer: Any, question: str, max_new_tokens: int) -> Answer:
    """Greedy answer to ``question`` (stops at the end-of-turn token or after ``max_new_tokens``)."""
    ids = chat_ids(tokenizer, question)
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1] :]  # one row: exactly the generated tokens (the end-of-turn token included)
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    return Answer(text, int(ids.shape[1]), int(new.shape[0]), seconds)


def main(argv: list[str] | None = None) -> None:
    """Run the demo: prepare the artifact, then answer the fixed questions (or ``--prompt``)."""
    parser = argparse.ArgumentParser(prog="python -m optimum.neuron.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", action="append", help="a question to ask instead of the built-in ones")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="answer length limit (default 48)")
    parser.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # torch.export's pytree spec pickling warns about its own deprecated LeafSpec; nothing to act on here.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    if args.prepare_only:
        _prepare_and_print()
        return

    from rich.console import Console
    from transformers import AutoTokenizer

    from .errors import NeuronError
    from .modeling import NeuronModelForCausalLM

    console = Console()
    start = time.perf_counter()
    artifact = prepare_in_child()
    console.print(f"[dim]artifact ready in {time.perf_counter() - start:.1f}s: {artifact}[/dim]")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    model = NeuronModelForCausalLM.from_pretrained(artifact)
    console.print(
        f"[dim]loaded in {time.perf_counter() - start:.1f}s: SmolLM2-135M-Instruct, {DTYPE}, {BACKEND} backend, "
        f"batch {BATCH_SIZE}, sequence length {SEQUENCE_LENGTH}, prefill chunk {PREFILL_CHUNK_SIZE}[/dim]\n"
    )
    ask(model, tokenizer, "Hi", 2)  # warm-up: the first call of each compiled graph is slower
    for question in args.prompt or QUESTIONS:
        console.print(f"[bold cyan]Q:[/bold cyan] {question}", highlight=False)
        try:
            answer = ask(model, tokenizer, question, args.max_new_tokens)
        except NeuronError as err:  # e.g. a --prompt longer than the compiled sequence length
            console.print(f"[bold red]error:[/bold red] {err}\n", highlight=False)
            continue
        console.print(f"[bold green]A:[/bold green] {answer.text}", highlight=False)
        console.print(
            f"[dim]   {answer.prompt_tokens} prompt tokens -> {answer.new_tokens} new tokens in {answer.seconds:.2f}s "
            f"({answer.tokens_per_second:.1f} tokens/s, prefill included)[/dim]\n",
            highlight=False,
        )


if __name__ == "__main__":
    main()

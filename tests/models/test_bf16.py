"""bf16 parity on the tiny model of every family: inductor vs eager vs transformers (DESIGN.md §8).

By default AOTInductor keeps fused bf16 chains in fp32 (rope's ``x*cos + rot*sin``, ``silu(gate)*up``)
where eager PyTorch and transformers round each op to bf16: the inductor backend's last-token logits
then sat 0.08-0.27 away from eager's on tiny llama, and SmolLM2's near-tie first token flipped. The
backend now compiles with ``emulate_precision_casts`` and must match eager closely.

Tolerances (last-token logits, absolute; they are bf16 values of magnitude < 16 cast to fp32):

* inductor vs eager: `EAGER_TOLERANCE` = 1/64, below one bf16 ulp at magnitude 4-8 (measured 0).
* ours vs transformers bf16: `HF_TOLERANCE` = 0.25 (measured up to 0.11: chunks, padding and the
  attention kernels round differently from one full-prompt forward).
* greedy tokens vs transformers bf16: every token we pick must be transformers' argmax for the same
  prefix, or within `HF_TOLERANCE` of it (teacher forcing our tokens through transformers). Exact
  sequence equality is not a bf16 property: on random tiny models near-ties within the rounding noise
  above are common (qwen2, length 16, step 4 picked the runner-up), and after one such pick the two
  sequences legitimately differ. fp32 parity (tests/contract/test_backend_contract.py) demands identical tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum.neuron import NeuronModelForCausalLM
from tests.contract.engine_tools import loaded, prefill_logits
from tests.fixtures.llm.models import tiny_model
from tests.models.exports import CHUNK, dtype_fixture

LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1, 3 * CHUNK]
NEW_TOKENS = 6
EAGER_TOLERANCE = 1 / 64
HF_TOLERANCE = 0.25
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""Compiled in bf16 on inductor. Of the later families only gemma3 runs here, on eager (its own bf16 rounding:
``1 + weight`` norms in fp32, the embedding scale rounded to bf16): their bf16 compiles are left out of the suite's
budget, their arithmetic is pinned in fp32 on every backend by the contract suite."""
CASES = [
    (family, mode, backend)
    for backend in ("eager", "inductor")
    for family, mode in [(family, "chunked") for family in FAMILIES] + [("llama", "ce")]
] + [("gemma3", "chunked", "eager")]

_references: dict[str, torch.nn.Module] = {}


def neuron_model(family: str, backend: str, mode: str = "chunked") -> NeuronModelForCausalLM:
    """The bf16 export of ``family`` (chunk 8 or context encoding, sequence length 32), loaded once."""
    return loaded(dtype_fixture(family, backend, "bf16", mode == "chunked"))


def reference(family: str) -> torch.nn.Module:
    """transformers' model of ``family`` in bf16."""
    if family not in _references:
        _references[family] = AutoModelForCausalLM.from_pretrained(tiny_model(family), dtype=torch.bfloat16).eval()
    return _references[family]


def prompt(length: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(length))


def greedy(model: NeuronModelForCausalLM, ids: torch.Tensor) -> list[int]:
    return model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])[0, ids.shape[1] :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_inductor_matches_eager(family: str) -> None:
    eager, inductor = neuron_model(family, "eager"), neuron_model(family, "inductor")
    for length in LENGTHS:
        ids = prompt(length)
        want, got = prefill_logits(eager.engine, ids[0].tolist()), prefill_logits(inductor.engine, ids[0].tolist())
        assert got.dtype == want.dtype == torch.float32
        diff = float((got - want).abs().max())
        assert diff <= EAGER_TOLERANCE, f"{family} length {length}: inductor logits {diff} from eager's"
        assert greedy(inductor, ids) == greedy(eager, ids), f"{family} length {length}"


@pytest.mark.slow
@pytest.mark.parametrize(("family", "mode", "backend"), CASES)
def test_bf16_greedy_matches_transformers(family: str, mode: str, backend: str) -> None:
    model, ref = neuron_model(family, backend, mode), reference(family)
    for length in LENGTHS:
        ids = prompt(length)
        with torch.no_grad():
            expected = ref(ids).logits[0, -1].float()
        diff = float((prefill_logits(model.engine, ids[0].tolist()) - expected).abs().max())
        assert diff <= HF_TOLERANCE, f"{family} {mode} {backend} length {length}: logits {diff} from transformers'"
        gaps = argmax_gaps(ref, ids, greedy(model, ids))
        assert max(gaps) <= HF_TOLERANCE, f"{family} {mode} {backend} length {length}: gaps to argmax {gaps}"


def argmax_gaps(ref: torch.nn.Module, ids: torch.Tensor, tokens: list[int]) -> list[float]:
    """For each generated token, how far its transformers logit lies below transformers' best logit for
    the same prefix (0 where it is the argmax)."""
    sequence = torch.cat((ids, torch.tensor([tokens])), dim=1)
    with torch.no_grad():
        logits = ref(sequence).logits[0, ids.shape[1] - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return (logits.max(dim=-1).values - chosen).tolist()

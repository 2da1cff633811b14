"""Per-request sampling parameters and the host side of hybrid sampling (invariant 6).

`SamplingParams.check` is the one ``top_k`` policy (a sampled request may not ask for more candidates
than the artifact's ``max_topk``: refused, naming ``--max_topk``); `SamplingParams.resolve` is the one
place that turns parameters into what the sampler takes. `sample_on_host` samples prefill logits on the
CPU with the same `sample_tokens` function the token-generation graph runs, with uniforms drawn from
each sequence's seeded generator (`SequenceSampler`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..models.layers.sampling import sample_tokens


@dataclass(frozen=True)
class SamplingParams:
    """Sampling of one sequence. ``do_sample=False`` (or temperature 0, or top_k 1) is greedy."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    """0 or negative: no top-k filter (the sampler still draws from the artifact's ``max_topk`` most likely
    tokens, the candidates every graph keeps); at most ``max_topk`` otherwise (`check`)."""
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise InputError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}.")

    @property
    def greedy(self) -> bool:
        """True when this always picks the most likely token."""
        return not self.do_sample or self.temperature == 0 or self.top_k == 1

    def check(self, max_topk: int) -> None:
        """`InputError` when a sampled request asks for a ``top_k`` above the artifact's ``max_topk``
        (greedy requests never use it)."""
        if not self.greedy and self.top_k > max_topk:
            raise InputError(
                f"top_k={self.top_k} exceeds this artifact's max_topk={max_topk}: lower top_k, or re-export with "
                f"--max_topk {self.top_k} or more."
            )

    def resolve(self, max_topk: int) -> tuple[float, int, float]:
        """``(temperature, top_k, top_p)`` as the sampler takes them (after `check`)."""
        if self.greedy:
            return 1.0, 1, 1.0
        self.check(max_topk)
        return self.temperature, max_topk if self.top_k <= 0 else self.top_k, self.top_p


@dataclass
class SequenceSampler:
    """The sampling state of one sequence: its parameters and its seeded generator."""

    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator.manual_seed(seed)

    def uniform(self) -> float:
        """The next uniform of this sequence's stream (one per generated token)."""
        return float(torch.rand((), generator=self.generator).item())


def sampling_tensors(samplers: list[SequenceSampler | None], max_topk: int) -> dict[str, torch.Tensor]:
    """Per-row sampling inputs for ``samplers`` (``None`` rows are greedy and draw nothing)."""
    rows = [s.params.resolve(max_topk) if s else (1.0, 1, 1.0) for s in samplers]
    return {
        "temperature": torch.tensor([r[0] for r in rows], dtype=torch.float32),
        "top_k": torch.tensor([r[1] for r in rows], dtype=torch.long),
        "top_p": torch.tensor([r[2] for r in rows], dtype=torch.float32),
        "uniforms": torch.tensor([s.uniform() if s else 0.0 for s in samplers], dtype=torch.float32),
    }


def sample_on_host(logits: torch.Tensor, samplers: list[SequenceSampler | None], max_topk: int) -> torch.Tensor:
    """Sample ``logits [N, V]`` on the CPU with the graph's own rule; returns token ids ``[N]``."""
    t = sampling_tensors(samplers, max_topk)
    return sample_tokens(logits.float().cpu(), t["temperature"], t["top_k"], t["top_p"], t["uniforms"], max_topk)

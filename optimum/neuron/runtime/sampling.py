"""Per-request sampling parameters and the host side of hybrid sampling (invariant 6).

`SamplingParams` refuses, with an `InputError` naming the parameter, every value of the wrong type or out of range
when it is built (before an engine holds anything for it); `normalized_top_k` is the one rule for "no top-k filter".
`SamplingParams.check` is the one ``top_k`` policy (a sampled request may not ask for more candidates
than the artifact's ``max_topk``: refused, naming ``--max_topk``); `SamplingParams.check_graphs` refuses what
the artifact has no graph for; `SamplingParams.resolve` is the one place that turns parameters into what the
sampler takes. `sample_on_host` samples prefill logits on the CPU with the same `sample_tokens` function the
token-generation graph runs, with uniforms drawn from each sequence's seeded generator (`SequenceSampler`).
A sequence whose parameters carry a `HostSampler`'s own (``host``: vLLM's sampling parameters) is sampled by
that sampler instead, from the full logits, every step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..config import switch
from ..errors import InputError
from ..graphs import GraphKind, graph_specs, prefill_kind, select_graph
from ..models.layers.sampling import processed_scores, sample_tokens

if TYPE_CHECKING:
    from ..config import NeuronConfig
    from .sequence import Sequence

NO_TOP_K = 0
"""`SamplingParams.top_k` for "no top-k filter"."""
SEED_LIMIT = 2**63
"""Seeds are integers in ``[0, SEED_LIMIT)`` (what a torch generator takes, signed 64-bit)."""


def normalized_top_k(top_k: Any) -> Any:
    """The one "no top-k filter" rule: the spellings callers use for it, ``None`` (transformers' ``generate`` without
    one), ``0`` and ``-1`` (vLLM's), all become `NO_TOP_K`; any other value is returned as is, for `SamplingParams` to
    accept (an integer >= 1) or refuse."""
    if top_k is None or (_is_int(top_k) and top_k in (0, -1)):
        return NO_TOP_K
    return top_k


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _checked(name: str, value: Any, ok: Callable[[Any], bool], want: str) -> Any:
    """``value`` when ``ok``, else `InputError` naming parameter ``name`` and what it takes."""
    if ok(value):
        return value
    raise InputError(f"sampling parameter {name} must be {want}; got {value!r} ({type(value).__name__}).")


def _optional_count(name: str, value: Any, low: int, want: str) -> int | None:
    """None, or an integer >= ``low``."""
    return None if value is None else int(_checked(name, value, lambda v: _is_int(v) and v >= low, want))


def checked_count(name: str, value: Any, low: int = 1, note: str = "") -> int:
    """``value`` as an int when it is an integer >= ``low`` (not a bool, a float or a string), else `InputError` naming
    parameter ``name`` (``note``: why, appended to the message)."""
    if _is_int(value) and value >= low:
        return int(value)
    raise InputError(f"{name} must be an integer >= {low}{note}; got {value!r} ({type(value).__name__}).")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling of one sequence. ``do_sample=False`` (or temperature 0, or top_k 1) is greedy."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = NO_TOP_K
    """0 (or a spelling `normalized_top_k` reads as 0: None, -1): no top-k filter (the sampler still draws from the
    artifact's ``max_topk`` most likely tokens, the candidates every graph keeps); at most ``max_topk`` otherwise
    (`check`)."""
    top_p: float = 1.0
    seed: int | None = None
    """The seed of this sequence's generator, an integer in ``[0, 2**63)``; None draws one at random."""
    logprobs: int | None = None
    """Log-probabilities returned with each sampled token (`StepResult.logprobs`): None for none, 0 for the sampled
    token's own, N for it and the N most likely tokens, -1 for the whole vocabulary."""
    prompt_logprobs: int | None = None
    """The same for every prompt token but the first (`StepResult.prompt_logprobs`, once the prompt is in the
    cache); needs an artifact exported with ``--prompt_logprobs``."""
    return_logits: bool = False
    """Return the logits each token is sampled from (`StepResult.logits`), decodes included."""
    max_tokens: int | None = None
    """The most tokens the sequence samples, when the caller knows it (vLLM's ``max_tokens``; None: unknown). A
    sequence that samples only its first token (from the prefill logits) never runs a token-generation graph, so
    it needs no graph returning logits there: lm-evaluation-harness's loglikelihood requests (``echo``,
    ``logprobs``, ``max_tokens=1``) need only ``--prompt_logprobs``. `Engine.step` refuses to decode past it."""
    host: Any = field(default=None, compare=False, hash=False)
    """A `HostSampler`'s own parameters (vLLM's ``SamplingParams``): when set, the `HostSampler` passed to
    `Engine.step` chooses this sequence's tokens from the full logits, every step; the fields above then
    only say which logprobs to return."""

    def __post_init__(self) -> None:
        """Refuse (`InputError`, naming the parameter) any value of the wrong type or out of range, and store each
        one as the plain Python type the sampler uses (e.g. a numpy float as a float)."""
        is_bool = lambda v: isinstance(v, bool)  # noqa: E731
        fields = {
            "do_sample": _checked("do_sample", self.do_sample, is_bool, "True or False"),
            "return_logits": _checked("return_logits", self.return_logits, is_bool, "True or False"),
            "temperature": float(
                _checked("temperature", self.temperature, lambda v: _is_real(v) and 0 <= v < math.inf, _TEMPERATURE)
            ),
            "top_p": float(_checked("top_p", self.top_p, lambda v: _is_real(v) and 0 < v <= 1, _TOP_P)),
            "top_k": int(_checked("top_k", normalized_top_k(self.top_k), lambda v: _is_int(v) and v >= 0, _TOP_K)),
            "seed": None
            if self.seed is None
            else int(_checked("seed", self.seed, lambda v: _is_int(v) and 0 <= v < SEED_LIMIT, _SEED)),
            "logprobs": _optional_count("logprobs", self.logprobs, -1, _LOGPROBS),
            "prompt_logprobs": _optional_count("prompt_logprobs", self.prompt_logprobs, -1, _LOGPROBS),
            "max_tokens": _optional_count("max_tokens", self.max_tokens, 1, "None or an integer >= 1"),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def needs_logits(self) -> bool:
        """True when each sampled token's logits must reach the host (the token-generation graph returning
        logits runs on the steps where this sequence decodes)."""
        return self.logprobs is not None or self.return_logits or self.host is not None

    @property
    def greedy(self) -> bool:
        """True when this always picks the most likely token."""
        return not self.do_sample or self.temperature == 0 or self.top_k == 1

    def check(self, max_topk: int, vocab_size: int | None = None) -> None:
        """`InputError` when a sampled request asks for a ``top_k`` above the artifact's ``max_topk`` (greedy requests
        never use it; a `HostSampler` applies its own), or, given the model's ``vocab_size``, for more logprobs than
        the vocabulary holds."""
        if self.host is None and not self.greedy and self.top_k > max_topk:
            raise InputError(
                f"top_k={self.top_k} exceeds this artifact's max_topk={max_topk}: lower top_k, or re-export with "
                f"--max_topk {self.top_k} or more."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if vocab_size is not None and value is not None and value > vocab_size:
                raise InputError(
                    f"{name}={value} exceeds this model's vocabulary of {vocab_size} tokens: ask at most {vocab_size} "
                    "(or -1 for the whole vocabulary)."
                )

    def check_graphs(self, config: NeuronConfig) -> None:
        """`InputError` when the artifact built from ``config`` has no graph these parameters need."""
        specs = graph_specs(config)
        if self.prompt_logprobs is not None and not select_graph(specs, prefill_kind(config), all_rows=True):
            raise InputError(
                "prompt logprobs need the prefill graph that returns every row's logits, which this artifact was "
                "exported without: re-export with --prompt_logprobs."
            )
        decodes = self.max_tokens != 1  # a single token is sampled from the prefill logits
        if self.needs_logits and decodes and not select_graph(specs, GraphKind.TOKEN_GENERATION, logits=True):
            minimal = switch("decode_logits")
            raise InputError(
                "logprobs, logits and host sampling (penalties, min_p, min_tokens, logit_bias, bad words, allowed "
                "token ids, structured output) need a token-generation graph that returns logits, and this artifact "
                f"was exported with {minimal} (without it): re-export without {minimal}."
            )

    def scores(self, logits: torch.Tensor, max_topk: int, kernel: bool = False) -> torch.Tensor:
        """transformers' ``output_scores`` of ``logits [N, V]`` under these parameters: the raw logits when greedy,
        else what the sampler draws from (temperature applied, tokens outside top-k / top-p at ``-inf``); ``kernel``:
        as `sample_on_host`."""
        if self.greedy:
            return logits.float().clone()
        temperature, top_k, top_p = self.resolve(max_topk)
        rows = logits.shape[0]
        return processed_scores(
            logits.float(),
            torch.full((rows,), temperature),
            torch.full((rows,), top_k),
            torch.full((rows,), top_p),
            max_topk,
            kernel=kernel,
        )

    def resolve(self, max_topk: int) -> tuple[float, int, float]:
        """``(temperature, top_k, top_p)`` as the sampler takes them (after `check`)."""
        if self.greedy:
            return 1.0, 1, 1.0
        self.check(max_topk)
        return self.temperature, max_topk if self.top_k == NO_TOP_K else self.top_k, self.top_p


_TEMPERATURE = "a finite number >= 0 (0 is greedy)"
_TOP_P = "a number in (0, 1] (1 keeps every token)"
_TOP_K = "an integer >= 1, or 0, -1 or None for no top-k filter"
_SEED = f"an integer in [0, 2**63) ({SEED_LIMIT - 1} at most), or None for a random one"
_LOGPROBS = "None, -1 (the whole vocabulary) or an integer >= 0"


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


def sample_on_host(
    logits: torch.Tensor, samplers: list[SequenceSampler | None], max_topk: int, kernel: bool = False
) -> torch.Tensor:
    """Sample ``logits [N, V]`` on the CPU with the graph's own rule; returns token ids ``[N]``. ``kernel``: the
    candidates from the toolkit's CPU kernel, as the graphs of an artifact with ``NeuronConfig.cpu_kernels`` take
    them (torch's but where equal logits straddle the last one: `layers.sampling._candidates`)."""
    t = sampling_tensors(samplers, max_topk)
    floats = logits.float().cpu()
    return sample_tokens(floats, t["temperature"], t["top_k"], t["top_p"], t["uniforms"], max_topk, kernel=kernel)


class HostSampler(Protocol):
    """Chooses tokens on the host with rules the toolkit does not implement itself (vLLM's sampler: penalties,
    logits processors, structured output), for the sequences whose parameters carry its own (``host``)."""

    def sample(self, logits: torch.Tensor, rows: Mapping[int, Sequence]) -> tuple[dict[int, int], torch.Tensor]:
        """Tokens of ``rows`` (KV slot -> sequence) from ``logits [batch_size, V]`` (row b: slot b's logits; rows
        not in ``rows`` hold nothing). Returns the token of each slot and the logits its logprobs are computed
        from (``[batch_size, V]``: e.g. after a grammar mask, as vLLM's raw logprobs are)."""
        ...

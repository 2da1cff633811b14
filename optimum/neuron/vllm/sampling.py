"""vLLM ``SamplingParams`` -> our `SamplingParams`, refusing what the graphs do not implement.

Supported: temperature (0 = greedy), top_k (up to the artifact's ``max_topk``: `SamplingParams.check`), top_p, seed,
max_tokens, stop / stop_token_ids, ignore_eos (the last four are applied by vLLM's scheduler and
detokenizer). Everything else that would change the tokens is refused per request with the reason.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..runtime.sampling import SamplingParams

_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "structured_outputs": None,
    "logits_processors": None,
}
"""Parameters we do not implement, with the value that means "not used"."""


def unsupported_fields(params: Any) -> list[str]:
    """Names of the parameters of ``params`` set to something other than their neutral value."""
    found = [name for name, neutral in _NEUTRAL.items() if getattr(params, name, neutral) not in (neutral, [], {})]
    if getattr(params, "n", 1) != 1:
        found.append("n")
    return found


def check_request(params: Any, max_topk: int) -> None:
    """`InputError` when ``params`` asks for something the artifact cannot sample."""
    to_sampling_params(params).check(max_topk)


def to_sampling_params(params: Any) -> SamplingParams:
    """Our `SamplingParams` for a vLLM ``SamplingParams``; `InputError` for parameters we do not implement
    (the artifact's limits are checked by `SamplingParams.check`)."""
    if params is None or not hasattr(params, "temperature"):
        raise InputError("optimum-neuronx serves text generation only (no pooling / embedding requests).")
    bad = unsupported_fields(params)
    if bad:
        raise InputError(
            f"sampling parameter(s) {', '.join(sorted(bad))} are not supported by optimum-neuronx; supported: "
            "temperature, top_k, top_p, seed, max_tokens, stop, stop_token_ids, ignore_eos, n=1."
        )
    greedy = params.temperature == 0.0
    return SamplingParams(
        do_sample=not greedy,
        temperature=1.0 if greedy else float(params.temperature),
        top_k=max(int(params.top_k), 0),
        top_p=float(params.top_p),
        seed=params.seed,
    )

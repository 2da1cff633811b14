"""vLLM ``SamplingParams`` -> our `SamplingParams`, refusing what the plugin does not implement.

A request that needs only temperature (0 = greedy), top_k (up to the artifact's ``max_topk``: `SamplingParams.check`),
top_p and seed is sampled by the toolkit's own rule (on device in the token-generation graph, hybrid sampling).
A request that needs more (penalties, min_p, min_tokens, logit_bias, allowed token ids, bad words, structured
output) carries its vLLM parameters (``host``) and is sampled by vLLM's own sampler (`host_sampling.HostSampling`).
``logprobs`` and ``prompt_logprobs`` are returned for either; ``n`` is fanned out by vLLM's front end into
requests of their own. max_tokens, stop / stop_token_ids and ignore_eos are applied by vLLM's scheduler and
detokenizer.

`check_request` is what the platform refuses before a request is scheduled: the same `runtime.admission.Admission`
checks `Engine.admit` makes (prompt, images, sampling against the artifact), on the same converted parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import InputError
from ..runtime.admission import Admission
from ..runtime.images import ImageInput, real_tiles
from ..runtime.sampling import SamplingParams, normalized_top_k
from .compat import ImageItem
from .host_sampling import needs_vllm_sampler

_REFUSED: dict[str, Any] = {
    "prompt_logprob_token_ids": None,
    "logprob_token_ids": None,
    "thinking_token_budget": None,
    "trace_decode_token_ids": None,
}
"""Parameters the plugin does not implement, with the value that means "not used"."""


def unsupported_fields(params: Any) -> list[str]:
    """Names of the parameters of ``params`` set to something other than their neutral value."""
    return [name for name, neutral in _REFUSED.items() if getattr(params, name, neutral) not in (neutral, [], {})]


def check_request(prompt: Sequence[int], images: Sequence[ImageItem], params: Any, admission: Admission) -> None:
    """`InputError` when a request (its prompt token ids, images and vLLM ``SamplingParams``) asks for something
    the artifact cannot serve: what `Engine.admit` would refuse."""
    admission.check(prompt, to_sampling_params(params), to_images(images))


def to_images(items: Sequence[ImageItem]) -> list[ImageInput]:
    """The engine's `ImageInput` of each image vLLM's processor made (padding tiles dropped: `real_tiles`; no pixels
    for an image vLLM sends without them, its rows cached)."""
    return [ImageInput(None if i.pixels is None else real_tiles(i.pixels, i.pixel_mask), i.positions) for i in items]


def to_sampling_params(params: Any) -> SamplingParams:
    """Our `SamplingParams` for a vLLM ``SamplingParams``; `InputError` for parameters we do not implement (the
    artifact's limits are checked by `SamplingParams.check` and `SamplingParams.check_graphs`)."""
    if params is None or not hasattr(params, "temperature"):
        raise InputError("optimum-neuronx serves text generation only (no pooling / embedding requests).")
    bad = unsupported_fields(params)
    if bad:
        raise InputError(
            f"sampling parameter(s) {', '.join(sorted(bad))} are not supported by optimum-neuronx (docs/vllm.md lists "
            "what is)."
        )
    greedy = params.temperature == 0.0
    return SamplingParams(
        do_sample=not greedy,
        temperature=1.0 if greedy else float(params.temperature),
        top_k=normalized_top_k(params.top_k),
        top_p=float(params.top_p),
        seed=params.seed,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        max_tokens=params.max_tokens,
        host=params if needs_vllm_sampler(params) else None,
    )

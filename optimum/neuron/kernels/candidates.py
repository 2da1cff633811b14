"""``optimum_neuron::top_candidates``: the candidates of sampling on the CPU, the ``k`` largest logits of each row and
their token ids, best first, equal logits by increasing token id (NaN above every number; of several logits equal to
the ``k``-th largest, those of the smallest ids): the rule of `models.layers.sampling._candidates` in one pass over
each row (``csrc/top_candidates.cpp``) instead of torch's ``topk`` and two sorts. Used by the graphs and the host
sampling of an artifact whose graphs call the toolkit's kernels (`NeuronConfig.cpu_kernels`), so both keep the same
candidates. Its schema and shape function are defined here; its implementation is in the toolkit's C++ library
(`kernels.library`)."""

from __future__ import annotations

import torch

OPERATOR = "optimum_neuron::top_candidates"

torch.library.define(OPERATOR, "(Tensor logits, int k) -> (Tensor, Tensor)")
"""``logits [B, V]`` float32 -> ``values [B, k]`` float32, ``indices [B, k]`` int64."""


@torch.library.register_fake(OPERATOR)
def _output_shapes(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return logits.new_empty((rows, k)), logits.new_empty((rows, k), dtype=torch.long)


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``logits [B, V]`` (float32, CPU) and their ids, in the candidates' order."""
    values, indices = torch.ops.optimum_neuron.top_candidates(logits, k)
    return values, indices

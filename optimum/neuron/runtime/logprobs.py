"""Log-probabilities: the rule that turns logits into them, and the seam rule of prompt logprobs over chunks.

`token_logprobs` is the one logprob rule of the runtime (sampled tokens, prompt tokens, ``generate()`` and the vLLM
runner alike): vLLM's raw-logprobs rule (`Sampler.compute_logprobs` + `Sampler.gather_logprobs`), in its layout.
`PromptScorer.add` is the one place that decides which prompt token a prefill row scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of scored tokens in vLLM's layout (``LogprobsTensors``): row i is one position, column 0 the
    scored token (sampled or prompt token), columns 1.. the ``top`` most likely tokens, most likely first."""

    token_ids: torch.Tensor
    """``[N, 1 + top]`` int64."""
    logprobs: torch.Tensor
    """``[N, 1 + top]`` float32: log-softmax (fp32) of the logits the token was scored with."""
    ranks: torch.Tensor
    """``[N]`` int64: the scored token's rank, the number of tokens at least as likely (1 = the most likely)."""

    def __len__(self) -> int:
        return int(self.ranks.shape[0])

    @property
    def scores(self) -> torch.Tensor:
        """``[N]``: the scored tokens' own log-probabilities."""
        return self.logprobs[:, 0]

    @classmethod
    def cat(cls, parts: list[Logprobs], top: int) -> Logprobs:
        """``parts`` one after the other (``top``: the width of an empty result)."""
        if not parts:
            width = 1 + max(top, 0)
            empty = torch.empty(0, width)
            return cls(empty.long(), empty, torch.empty(0, dtype=torch.long))
        return cls(*(torch.cat([getattr(p, name) for p in parts]) for name in ("token_ids", "logprobs", "ranks")))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> Logprobs:
    """The log-softmax (fp32) of ``logits [N, V]`` at ``tokens [N]``, with the ``top`` most likely tokens of each
    row (``-1``: the whole vocabulary, ``0``: none) and each token's rank."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    width = logprobs.shape[-1] if top == -1 else top
    values, ids = torch.topk(logprobs, width, dim=-1)
    tokens = tokens.long()[:, None]
    own = logprobs.gather(-1, tokens)
    ranks = (logprobs >= own).sum(dim=-1)
    return Logprobs(torch.cat((tokens, ids), dim=1), torch.cat((own, values), dim=1), ranks)


@dataclass
class PromptScorer:
    """The prompt logprobs of one sequence, gathered over the prefill calls (and engine steps) that feed its prompt.
    The first prompt token has none, so a prompt of P tokens has P - 1 rows."""

    prompt: list[int]
    top: int
    """Most likely tokens kept per row, besides the prompt token (``-1``: all)."""
    parts: list[Logprobs] = field(default_factory=list)
    scored: int = 0
    """Rows gathered so far: the position of the next row to score."""

    @property
    def rows(self) -> int:
        """Rows of the result: every prompt position but the last (whose logits pick the first new token)."""
        return max(len(self.prompt) - 1, 0)

    @property
    def complete(self) -> bool:
        """True when every row is gathered."""
        return self.scored == self.rows

    def wants(self, start: int) -> bool:
        """True when a prefill call starting at position ``start`` holds rows still to score."""
        return start < self.rows

    def add(self, start: int, logits: torch.Tensor) -> None:
        """Score with ``logits [n, V]``, the real rows of one prefill call at positions ``start .. start + n - 1``.

        The seam rule: the row at position p scores prompt token p + 1. So the first token of a chunk is scored by
        the last real row of the chunk before it (possibly a step earlier), the first prompt token by no row, and
        the row at the last prompt position by none either (it samples the first new token); rows past the prompt
        (a resumed sequence recomputing its generated tokens) score nothing."""
        stop = min(start + logits.shape[0], self.rows)
        if stop <= start:
            return
        assert start == self.scored, f"prompt rows arrive in order: expected position {self.scored}, got {start}"
        targets = torch.tensor(self.prompt[start + 1 : stop + 1])
        self.parts.append(token_logprobs(logits[: stop - start], targets, self.top))
        self.scored = stop

    def reset(self) -> None:
        """Forget the rows gathered (the sequence is recomputed from position 0 after a preemption)."""
        self.parts, self.scored = [], 0

    def result(self) -> Logprobs:
        """The ``P - 1`` rows, in prompt order (after `complete`)."""
        assert self.complete, f"{self.scored} of {self.rows} prompt rows scored"
        return Logprobs.cat(self.parts, self.top)

"""When the tokens prompt lookup proposed are verified (`LookupPolicy`), in `generate(prompt_lookup_num_tokens=k)` and
for vLLM's n-gram proposer (`vllm.drafting.DraftGate`): only at the steps where verifying pays, by the step times and
kept tokens measured while serving (docs/speculative.md)."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from .sequence import common_prefix

PROBE_EVERY = 16
"""`LookupPolicy` runs the option its rule did not pick after this many steps with proposals, then after twice as many
each time the rule's pick stays the same (reset when it changes), so that its measurements follow what the sequences
and the machine do at a bounded cost."""
SMOOTHING = 0.3
"""Weight of the newest measurement in `LookupPolicy`'s running means."""
KEPT_PRIOR = 0.5
"""Proposed tokens a sequence is expected to keep per verification before anything was learned of it."""
COST_PRIOR = 1.5
"""`LookupPolicy`'s verification-to-step time ratio before a verification of as many sequences was measured: a
sequence is verified first once its unverified proposals say it would keep more than half a token."""


@dataclass
class LookupPolicy:
    """Whether a decode step verifies the tokens prompt lookup proposed, by what was measured while serving. A step of
    ``rows`` decoding sequences, some of them with proposals, either runs the token-generation graph (``rows`` tokens in
    time ``t(rows, 1)``) or one verification call as wide as its longest proposal plus one, or packed, of as many
    columns per sequence as they fill (`width`) (``rows`` tokens plus the kept proposals in ``t(rows, width)``). It
    verifies when the proposals it expects to keep, the sum of each proposing sequence's running mean of kept tokens per
    verification, exceed ``rows * (t(rows, width) / t(rows, 1) - 1)``: the tokens per second are then higher (vLLM's
    continuous batching, where no request waits for another: `vllm.drafting.DraftGate`). A call that returns when its
    last sequence is done (`generate`) counts steps instead: a verification shortens it only by what the sequences
    furthest from done keep, so it verifies when the least that one of them is expected to keep exceeds ``t(rows, width)
    / t(rows, 1) - 1`` (the same rule for one sequence). Step times are running means per (rows, width), measured by
    `record`; an unmeasured width costs what the nearest measured one does, scaled by its columns past the first
    (`cost`), and before any is, it is taken as `COST_PRIOR` times a step (which is measured first; packed, less for a
    call of a few proposals: `extra`). After `PROBE_EVERY` steps with proposals, then twice as many and so on (times the
    cost ratio when the probe is a verification), a step runs the option the rule did not pick. At batch 1 on SmolLM2 a
    verification call costs ~1.2x a step and verifying pays for any sequence that keeps a fifth of a token; at batch 8
    it costs 1.6-3x (docs/speculative.md), more than a chat reply's proposals keep. The tokens are the same either way
    (`accept`): only the number of steps changes."""

    timed: bool = True
    """False: verify every proposal. Tensor-parallel ranks each run this loop in lockstep and must call the same
    graphs, which decisions from each rank's own clock would not guarantee."""
    packed: bool = False
    """The verification graph packs its columns (`graphs.packed_verification`): a call computes the columns its
    sequences fill, so its width is measured as those columns per sequence (`width`), not as its longest row."""
    seconds: dict[tuple[int, float], float] = field(default_factory=dict)
    """Running mean of a decode step's seconds by (decoding sequences, columns per row)."""
    kept: dict[Hashable, float] = field(default_factory=dict)
    """Running mean of the proposed tokens each sequence kept per verification."""
    pending: dict[Hashable, tuple[list[int], list[int]]] = field(default_factory=dict)
    """Each withheld proposal whose would-be kept count is not known yet, and the tokens its sequence generated since
    (`withhold`, `generated`)."""
    pick: bool | None = None
    """The rule's last pick."""
    interval: int = PROBE_EVERY
    """Steps with proposals between two probes (times the cost ratio of a verification probe)."""
    waited: int = 0
    """Steps with proposals since the last probe or change of pick."""

    def verifies(
        self, rows: int, proposals: Mapping[Hashable, Sequence[int]], behind: Collection[Hashable] = ()
    ) -> bool:
        """Whether the next decode step of ``rows`` sequences verifies ``proposals`` (by sequence id). With
        ``behind``, the sequences furthest from done, the gain counted is the steps the call saves: the tokens the
        least promising of them is expected to keep (0 if one of them proposes nothing), not the tokens of all."""
        proposing = [seq_id for seq_id, p in proposals.items() if p]
        if not self.timed:
            return bool(proposing)
        step = self.seconds.get((rows, 1))
        if not proposing or step is None:
            return False  # nothing to verify, or the token-generation step is not measured yet
        extra = self.extra(rows, self.width(rows, [proposals[s] for s in proposing]), step)
        if behind:
            gain = min(self.kept.get(s, KEPT_PRIOR) if proposals.get(s) else 0.0 for s in behind)
            pays = gain > extra
        else:
            gain = sum(self.kept.get(seq_id, KEPT_PRIOR) for seq_id in proposing)
            pays = gain > rows * extra
        if gain == 0.0:
            return False  # a sequence the call waits for proposes nothing: nothing to gain, nothing to probe
        if pays != self.pick:
            self.pick, self.interval, self.waited = pays, PROBE_EVERY, 0
        self.waited += 1
        # a verification probe costs verify / step steps' time: it waits proportionally longer
        if self.waited < self.interval * (1.0 if pays else 1.0 + extra):
            return pays
        self.interval *= 2
        self.waited = 0
        return not pays

    def chosen(self, rows: int, proposals: Mapping[Hashable, Sequence[int]]) -> set[Hashable]:
        """The sequences whose proposals the next decode step of ``rows`` sequences verifies, by the throughput rule
        (empty: a token-generation step). With packed columns each proposal costs its own columns, so the step
        verifies the proposals whose expected kept tokens per proposed token are highest, as many of them as gain the
        most over the call's cost (`cost` at their width), and with none worth it, probes with the best one alone (a
        probe measures a call's cost; what a withheld proposal would have kept is learned anyway, `generated`); the
        rows layout costs the same for one proposal as for all, and verifies (or probes) all or none. `verifies`
        decides on that set."""
        proposing = [seq_id for seq_id, p in proposals.items() if p]
        step = self.seconds.get((rows, 1))
        picked = proposing
        if self.packed and self.timed and step is not None and proposing:
            ranked = sorted(proposing, key=lambda s: -self.kept.get(s, KEPT_PRIOR) / len(proposals[s]))
            picked, value = ranked[:1], 0.0  # none worth it: a probe verifies the best one alone, at the least cost
            for count in range(1, len(ranked) + 1):
                extra = self.extra(rows, self.width(rows, [proposals[s] for s in ranked[:count]]), step)
                gain = sum(self.kept.get(s, KEPT_PRIOR) for s in ranked[:count]) - rows * extra
                if gain > value:
                    picked, value = ranked[:count], gain
        return set(picked) if self.verifies(rows, {s: proposals[s] for s in picked}) else set()

    def width(self, rows: int, proposals: Sequence[Sequence[int]]) -> float:
        """The columns per sequence of a verification call of ``rows`` sequences verifying ``proposals`` (the non-empty
        ones), as the engine reports it (`StepResult.width`): its longest proposal plus one, or packed, every
        sequence's last token and proposed tokens over ``rows``."""
        if self.packed:
            return (rows + sum(map(len, proposals))) / rows
        return 1 + max(map(len, proposals))

    def extra(self, rows: int, width: float, step: float) -> float:
        """A verification call's expected time past a token-generation step of ``step`` seconds, in steps: from
        `cost`, else `COST_PRIOR`'s excess (packed columns: scaled by the columns per sequence past the first, up to
        one, so a call verifying a few proposals is expected to cost that much less)."""
        verify = self.cost(rows, width)
        if verify is not None:
            return verify / step - 1
        return (COST_PRIOR - 1) * (min(1.0, width - 1) if self.packed else 1)

    def cost(self, rows: int, width: float) -> float | None:
        """The expected seconds of a verification call of ``rows`` sequences at ``width`` columns: measured, else the
        nearest measured width's extra time over a token-generation step scaled by ``(width - 1) / (nearest - 1)``;
        None when no width of ``rows`` sequences (or their token-generation step) was measured."""
        if (rows, width) in self.seconds:
            return self.seconds[(rows, width)]
        step = self.seconds.get((rows, 1))
        known = [w for n, w in self.seconds if n == rows and w > 1]
        if step is None or not known:
            return None
        nearest = min(known, key=lambda w: (abs(w - width), w))
        return step + (self.seconds[(rows, nearest)] - step) * (width - 1) / (nearest - 1)

    def record(self, rows: int, width: float, seconds: float, kept: Mapping[Hashable, int]) -> None:
        """A decode step of ``rows`` sequences at ``width`` columns per row (1: token generation) took ``seconds``;
        ``kept``: the proposed tokens each sequence that proposed kept."""
        self.seconds[(rows, width)] = _running(self.seconds.get((rows, width)), seconds)
        self.record_kept(kept)

    def record_kept(self, kept: Mapping[Hashable, int]) -> None:
        """``kept``: the proposed tokens each sequence that proposed kept at a verification (whose time, shared with a
        prefill, says nothing of a decode step's)."""
        for seq_id, count in kept.items():
            self.kept[seq_id] = _running(self.kept.get(seq_id, KEPT_PRIOR), float(count))

    def forget(self, seq_ids: Collection[Hashable]) -> None:
        """Drop what was learned of ``seq_ids`` (finished sequences), and their withheld proposals."""
        for seq_id in seq_ids:
            self.kept.pop(seq_id, None)
            self.pending.pop(seq_id, None)

    def withhold(self, seq_id: Hashable, proposed: Sequence[int]) -> None:
        """``proposed`` (``seq_id``'s proposal) is not verified: what it would have kept is learned from the tokens the
        sequence generates next (`generated`). One such proposal per sequence at a time: a later one waits."""
        if proposed and seq_id not in self.pending:
            self.pending[seq_id] = (list(proposed), [])

    def generated(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """``seq_id`` generated ``tokens`` at a step. Once they settle what its withheld proposal would have kept (its
        leading tokens that the sequence generated: known at the first difference, or once it generated as many), that
        count joins the sequence's mean, exactly what a verification would have kept (the tokens are the same either
        way): a sequence whose proposals match again is verified without waiting for a probe, and one withheld while
        they match is not held back by a count that stops at its first token."""
        if seq_id not in self.pending or not tokens:
            return
        proposed, since = self.pending[seq_id]
        since.extend(tokens)
        kept = common_prefix(proposed, since)
        if len(since) > kept or kept == len(proposed):
            del self.pending[seq_id]
            self.kept[seq_id] = _running(self.kept.get(seq_id, KEPT_PRIOR), float(kept))


def _running(mean: float | None, value: float) -> float:
    return value if mean is None else mean + SMOOTHING * (value - mean)

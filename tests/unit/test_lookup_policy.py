"""`runtime.lookup_policy.LookupPolicy`: whether a decode step of `generate(prompt_lookup_num_tokens=k)` verifies, from
the step times and kept tokens it was given (no model: the times are made up)."""

from __future__ import annotations

import math

from optimum.neuron.runtime.lookup_policy import KEPT_PRIOR, PROBE_EVERY, LookupPolicy


def test_no_proposal_never_verifies() -> None:
    assert not LookupPolicy().verifies(1, {"a": []})


def test_it_measures_a_step_then_verifies_once_the_proposals_look_right() -> None:
    policy = LookupPolicy()
    assert not policy.verifies(1, {"a": [5, 6]}), "a token-generation step is measured first"
    policy.record(1, 1, 0.010, {})
    assert not policy.verifies(1, {"a": [5, 6]}), f"{KEPT_PRIOR} expected kept tokens: not above COST_PRIOR - 1"
    policy.withhold("a", [5, 6])
    policy.generated("a", [5])
    policy.generated("a", [6])
    assert policy.verifies(1, {"a": [5, 6]}), "it generated both proposed tokens: a verification is tried"
    policy.record(1, 3, 0.012, {"a": 2})
    assert not policy.verifies(2, {"a": [5], "b": [6]}), "two sequences: their token-generation step first"


def test_an_unmeasured_width_costs_the_nearest_one_scaled_by_its_columns() -> None:
    policy = LookupPolicy(seconds={(1, 1): 0.010, (1, 3): 0.014, (2, 1): 0.011})
    assert policy.cost(1, 3) == 0.014
    assert abs(policy.cost(1, 5) - 0.018) < 1e-12 and abs(policy.cost(1, 2) - 0.012) < 1e-12
    assert policy.cost(2, 3) is None and policy.cost(3, 3) is None


def test_it_verifies_when_the_kept_tokens_repay_the_call() -> None:
    """One sequence, a call at 1.2x a step: it pays while the sequence keeps more than 0.2 tokens per call."""
    policy = LookupPolicy(seconds={(1, 1): 0.010, (1, 3): 0.012})
    assert policy.verifies(1, {"a": [5, 6]}), f"unverified so far: {KEPT_PRIOR} kept tokens expected"
    for _ in range(8):
        policy.record(1, 3, 0.012, {"a": 0})
    assert policy.kept["a"] < 0.2
    assert not policy.verifies(1, {"a": [5, 6]})


def test_at_batch_8_the_call_must_repay_every_row() -> None:
    """8 sequences, a call at 3x a step: the proposing rows must keep more than 8 x 2 = 16 tokens between them."""
    costs = {(8, 1): 0.020, (8, 7): 0.060}
    rows = {i: [1, 2, 3, 4, 5, 6] for i in range(8)}
    policy = LookupPolicy(seconds=dict(costs), kept={i: 1.4 for i in range(8)})
    assert not policy.verifies(8, rows), "8 x 1.4 kept tokens do not repay 2 extra steps"
    policy = LookupPolicy(seconds=dict(costs), kept={i: 2.5 for i in range(8)})
    assert policy.verifies(8, rows), "8 x 2.5 do"


def test_it_probes_the_other_option_ever_less_often_while_its_pick_holds() -> None:
    policy = LookupPolicy(seconds={(1, 1): 0.010, (1, 3): 0.012}, kept={"a": 2.0})
    picks = [policy.verifies(1, {"a": [5, 6]}) for _ in range(7 * PROBE_EVERY)]
    probes = [i + 1 for i, verified in enumerate(picks) if not verified]
    assert probes == [PROBE_EVERY, 3 * PROBE_EVERY, 7 * PROBE_EVERY]
    policy.kept["a"] = 0.01  # the pick changes: probes start again, a verification probe after 1.2x as many steps
    picks = [policy.verifies(1, {"a": [5, 6]}) for _ in range(2 * PROBE_EVERY)]
    assert [i + 1 for i, verified in enumerate(picks) if verified] == [math.ceil(1.2 * PROBE_EVERY)]


def test_measurements_are_running_means() -> None:
    policy = LookupPolicy()
    policy.record(2, 1, 0.010, {})
    policy.record(2, 1, 0.020, {})
    assert 0.010 < policy.seconds[(2, 1)] < 0.020
    policy.record(2, 3, 0.015, {"a": 3, "b": 0})
    assert policy.kept["a"] > KEPT_PRIOR > policy.kept["b"]


def test_a_proposal_left_unverified_counts_what_it_would_have_kept() -> None:
    """Not verified, a proposal counts the leading tokens its sequence then generated: settled at the first
    difference or once as many were generated, one withheld proposal per sequence at a time."""
    policy = LookupPolicy(seconds={(1, 1): 0.010, (1, 3): 0.012}, kept={"a": 0.1})
    assert not policy.verifies(1, {"a": [5, 6, 7]})
    policy.withhold("a", [5, 6, 7])
    policy.withhold("a", [6, 7, 8])  # a later proposal while the first is unsettled: not followed
    policy.generated("a", [5])
    policy.generated("a", [6])
    assert policy.kept["a"] == 0.1, "2 of 3 tokens matched so far: not settled"
    policy.generated("a", [7])
    assert policy.kept["a"] == 0.1 + 0.3 * (3 - 0.1) and "a" not in policy.pending, "all 3 would have been kept"
    assert policy.verifies(1, {"a": [5, 6]})
    policy.withhold("a", [7, 8])
    policy.generated("a", [9, 9])  # a step that verified something else: several tokens at once
    assert policy.kept["a"] < 0.1 + 0.3 * (3 - 0.1) and "a" not in policy.pending, "0 kept: settled at once"
    policy.withhold("a", [])
    policy.generated("a", [9])
    assert "a" not in policy.pending, "no proposal: nothing followed"
    policy.withhold("b", [1, 2])
    policy.forget(["b"])
    assert "b" not in policy.pending, "a finished sequence's proposal is dropped"


def test_a_call_that_waits_for_its_last_sequence_counts_the_steps_saved() -> None:
    """``behind``: a verification saves steps only if the sequences furthest from done keep tokens."""
    costs = {(2, 1): 0.010, (2, 3): 0.014}
    policy = LookupPolicy(seconds=dict(costs), kept={"fast": 2.0, "slow": 0.0})
    proposals = {"fast": [5, 6], "slow": [7, 8]}
    assert policy.verifies(2, proposals), "2 + 0 kept tokens repay 2 x 0.4 steps of time"
    policy = LookupPolicy(seconds=dict(costs), kept={"fast": 2.0, "slow": 0.0})
    assert not policy.verifies(2, proposals, behind=["slow"]), "the slow one ends the call and keeps nothing"
    assert not policy.verifies(2, {"fast": [5, 6]}, behind=["slow", "fast"]), "one of them proposes nothing"
    policy = LookupPolicy(seconds=dict(costs), kept={"fast": 2.0, "slow": 1.0})
    assert policy.verifies(2, proposals, behind=["slow"])


def test_nothing_to_gain_is_never_probed() -> None:
    policy = LookupPolicy(seconds={(2, 1): 0.010, (2, 3): 0.014}, kept={"a": 3.0})
    assert not any(policy.verifies(2, {"a": [5, 6]}, behind=["a", "b"]) for _ in range(8 * PROBE_EVERY))


def test_untimed_it_verifies_every_proposal() -> None:
    """Tensor-parallel ranks (``timed=False``): the same decision on every rank, whatever their clocks."""
    policy = LookupPolicy(timed=False, seconds={(1, 1): 0.010, (1, 3): 0.030}, kept={"a": 0.0})
    assert policy.verifies(1, {"a": [5, 6]}) and not policy.verifies(1, {"a": []})


def test_a_packed_call_costs_the_columns_its_sequences_fill() -> None:
    """With a packed verification graph a call's width is its columns per sequence: 8 sequences, 2 of them proposing 2
    tokens, fill 12 columns, a width of 1.5, costed from the measured widths around it, not as 8 rows of 3."""
    padded, packed = LookupPolicy(), LookupPolicy(packed=True)
    assert padded.width(8, [[1, 2], [3, 4]]) == 3 and packed.width(8, [[1, 2], [3, 4]]) == 1.5
    costs = {(8, 1): 0.020, (8, 2.0): 0.026, (8, 3): 0.060}
    rows: dict[object, list[int]] = {0: [1, 2], 1: [3, 4], **{i: [] for i in range(2, 8)}}
    kept = {0: 1.0, 1: 1.0}
    assert not LookupPolicy(seconds=dict(costs), kept=dict(kept)).verifies(8, rows), "3x a step: 16 tokens to repay"
    policy = LookupPolicy(seconds=dict(costs), kept=dict(kept), packed=True)
    assert abs(policy.cost(8, 1.5) - 0.023) < 1e-12 and policy.verifies(8, rows), "1.15x: 1.2 tokens to repay"
    unmeasured = LookupPolicy(seconds={(8, 1): 0.020}, packed=True)
    assert abs(unmeasured.extra(8, 1.25, 0.020) - 0.125) < 1e-12, "the prior's excess scaled: 2 columns of 8 rows"
    assert unmeasured.extra(8, 3.0, 0.020) == 0.5, "at most the rows layout's prior"
    assert LookupPolicy(seconds={(8, 1): 0.020}).extra(8, 3, 0.020) == 0.5, "rows: the prior whatever the width"


def test_packed_with_nothing_worth_it_a_probe_verifies_the_best_proposal_alone() -> None:
    """8 sequences proposing 6 tokens that keep little: no subset repays its columns, so the probe, when it comes,
    verifies only the proposal with the most kept tokens per proposed token (a 14-column call, not all 56)."""
    costs = {(8, 1): 0.020, (8, 7.0): 0.076}
    policy = LookupPolicy(seconds=dict(costs), kept={i: 0.2 + i / 100 for i in range(8)}, packed=True)
    proposals = {i: [1, 2, 3, 4, 5, 6] for i in range(8)}
    picks = [policy.chosen(8, proposals) for _ in range(4 * PROBE_EVERY)]
    assert [p for p in picks if p] == [{7}], "one probe, of the best-keeping sequence alone"

"""Acceptance statistics from the loop's per-cycle records, on handcrafted cycles."""

from specdrafter.eval.acceptance import alpha_per_token, per_position_acceptance, position_counts
from specdrafter.inference.decode import CycleStats


def cycles(accepted, k=3):
    return [CycleStats(k, a, 0.0, 0.0) for a in accepted]


def test_per_position_acceptance_is_conditional_on_reaching_the_position():
    cs = cycles([0, 1, 3, 2])  # k = 3
    # position 1: 3 of 4 accepted; position 2: reached by 3, accepted by 2; position 3: reached by 2, accepted by 1
    assert per_position_acceptance(cs) == [3 / 4, 2 / 3, 1 / 2]
    assert position_counts(cs) == [4, 3, 2]  # the denominators
    # tried positions: 1 + 2 + 3 + 3 = 9 (a full block tries k, otherwise accepted + 1); accepted 6
    assert alpha_per_token(cs) == 6 / 9


def test_unreached_positions_are_none():
    assert per_position_acceptance(cycles([0, 0])) == [0.0, None, None]

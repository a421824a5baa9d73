"""bench/draft_policy.py's replay: hand-checked steps and costs on a made-up trace."""
import pytest

from bench.draft_policy import Costs, Fixed, GrowShrink, MaGWhenMatched, Oracle, Step, Trace, replay, step_cost

COSTS = Costs(widths=[(1, 1.0), (2, 1.1)], drafter=0.2, step=0.05)  # width(n) = 1 + 0.1 (n - 1)
# position:  0  1  2  3  4  5  6  7  8  9
TRACE = Trace("coding", runs=[0, 3, 2, 1, 0, 0, 4, 3, 2, 1],
              mag_length=[0, 0, 0, 0, 6, 6, 0, 0, 0, 0], mag_agree=[0, 0, 0, 0, 5, 4, 0, 0, 0, 0],
              mag_match=[0, 0, 0, 0, 9, 9, 0, 0, 0, 0])


def test_the_cost_model_prices_width_drafter_forwards_and_the_step():
    assert COSTS.width(0) == COSTS.width(1) == 1.0 and COSTS.width(5) == pytest.approx(1.4)  # extended slope
    assert step_cost(Step(model=2), 2, COSTS) == pytest.approx(1.2 + 0.4 + 0.05)
    assert step_cost(Step(mag=6), 5, COSTS) == pytest.approx(1.5 + 0.05)  # MaG drafts without forwards
    assert step_cost(Step(), 0, COSTS) == 1.0  # plain decoding: no step overhead


def test_a_fixed_chain_is_accepted_up_to_the_drafters_run():
    # t=1: 2 drafted, runs 3 -> 2 accepted + 1 -> t=4; t=4: runs 0 -> t=5; t=5 -> t=6; t=6: 2 of 4 -> t=9;
    # t=9: 1 of 2 accepted -> t=11 (past the end). Five target forwards, each 1.2 + 0.4 + 0.05.
    cost, forwards = replay(TRACE, Fixed(2), COSTS)
    assert forwards == 5 and cost == pytest.approx(5 * 1.65)
    assert replay(TRACE, Fixed(0), COSTS) == (9.0, 9)  # plain decoding: a forward per token


def test_mag_goes_direct_where_matched_and_policies_learn_from_their_verdicts():
    # t=1 chain of 2 -> t=4; MaG matched 9 there: 6 drafted, 5 agree -> t=10, the end.
    cost, forwards = replay(TRACE, MaGWhenMatched(8, Fixed(2)), COSTS)
    assert forwards == 2 and cost == pytest.approx(1.65 + (1.6 + 0.05))
    memory = {}
    for drafted, accepted, expected in ((5, 5, 7), (7, 3, 6), (6, 0, 5), (1, 0, 4), (1, 1, 6)):
        GrowShrink().choose(TRACE, 1, memory, COSTS)
        GrowShrink().learn(memory, Step(model=drafted), drafted, accepted)
        assert memory["k"] == expected


def test_the_oracle_drafts_what_will_be_accepted_when_it_pays():
    assert Oracle().choose(TRACE, 6, {}, COSTS) == Step(model=4)
    assert Oracle(mag=True).choose(TRACE, 4, {}, COSTS) == Step(mag=5)
    dear = Costs(widths=[(1, 1.0), (2, 1.1)], drafter=3.0, step=0.05)  # a drafter dearer than the target
    assert Oracle().choose(TRACE, 6, {}, dear) == Step(model=0)
    oracle, fixed = replay(TRACE, Oracle(mag=True), COSTS), replay(TRACE, Fixed(2), COSTS)
    assert 9 / oracle[0] > 9 / fixed[0]

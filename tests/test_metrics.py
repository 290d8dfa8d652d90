import pytest

from inference.stats import AcceptStats


def test_tau_and_alpha_from_histogram():
    s = AcceptStats()
    # Three forwards shown 4 drafts: accepted 4, 2, 0.
    for a in (4, 2, 0):
        s.update(4, a)
    assert s.forwards == 3
    assert s.tau == pytest.approx((5 + 3 + 1) / 3)
    # position 0: judged 3 times, accepted 2; position 1: judged 2, accepted 2; position 2: judged 2, accepted 1;
    # position 3: judged 1, accepted 1.
    assert s.alpha_per_position == pytest.approx([2 / 3, 1.0, 0.5, 1.0])
    assert s.alpha == pytest.approx((2 + 2 + 1 + 1) / (3 + 2 + 2 + 1))
    assert s.accepted_length_histogram() == [1, 0, 1, 0, 1]


def test_variable_draft_lengths_and_merge():
    s = AcceptStats()
    s.update(0, 0)  # lookup found nothing: a plain step
    s.update(2, 2)
    other = AcceptStats()
    other.update(1, 0)
    s.merge(other)
    assert s.forwards == 3
    assert s.tau == pytest.approx((1 + 3 + 1) / 3)
    assert s.alpha_per_position == pytest.approx([0.5, 1.0])


def test_plain_decoding_has_tau_one():
    s = AcceptStats()
    for _ in range(5):
        s.update(0, 0)
    assert s.tau == 1.0 and s.alpha == 0.0


def test_rejects_impossible_counts():
    with pytest.raises(ValueError):
        AcceptStats().update(2, 3)


def test_unreached_positions_are_none_not_zero():
    s = AcceptStats()
    s.update(3, 0)
    assert s.alpha_per_position == [0.0, None, None]

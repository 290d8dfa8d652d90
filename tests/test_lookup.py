import torch

from heads.base import build_drafter


def lookup(teacher, **kw):
    return build_drafter({"_target_": "heads.lookup.PromptLookup", **kw}, teacher)


def test_proposes_the_continuation_of_an_earlier_ngram(tiny_teacher):
    d = lookup(tiny_teacher)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 9, 9, 2, 3]])
    assert d.propose(tokens, 2).tokens.tolist() == [4, 5]


def test_prefers_longer_ngrams(tiny_teacher):
    d = lookup(tiny_teacher, max_ngram=2)
    # "3" alone last occurs before 7, but the bigram "2 3" occurs before 4.
    tokens = torch.tensor([[2, 3, 4, 8, 3, 7, 2, 3]])
    assert d.propose(tokens, 1).tokens.tolist() == [4]


def test_repeating_pattern_gets_a_full_draft(tiny_teacher):
    d = lookup(tiny_teacher)
    tokens = torch.tensor([[5, 5, 5, 5, 5, 5]])
    assert d.propose(tokens, 3).tokens.tolist() == [5, 5, 5]


def test_no_match_gives_an_empty_draft(tiny_teacher):
    d = lookup(tiny_teacher)
    assert d.propose(torch.tensor([[1, 2, 3, 4]]), 3).size == 0
    assert d.propose(torch.tensor([[7]]), 3).size == 0

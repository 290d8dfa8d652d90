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


def test_committed_tokens_on_the_host_spare_the_read_back(tiny_teacher):
    from inference.transfers import TransferCounter

    d = lookup(tiny_teacher)
    seq = torch.tensor([[1, 2, 3, 4, 5, 9, 9, 2, 3]])
    with TransferCounter() as c:
        first = d.propose(seq, 2)
    assert c.counts["tolist"] == 1 and first.tokens.tolist() == [4, 5]
    d.accepted([0], committed=[4, 5])  # node 0 (token 4) kept, then the target's 5
    seq = torch.cat([seq, torch.tensor([[4, 5]])], 1)
    with TransferCounter() as c:
        second = d.propose(seq, 2)
    assert c.total == 0
    assert second.tokens.tolist() == lookup(tiny_teacher).propose(seq, 2).tokens.tolist() == [9, 9]


def test_without_the_hand_off_it_reads_the_context_again(tiny_teacher):
    # A context the hand-off does not describe (no ``accepted``, or a different length) is read back: never stale.
    from inference.transfers import TransferCounter

    d = lookup(tiny_teacher)
    d.propose(torch.tensor([[1, 2, 3, 4, 5, 9, 9, 2, 3]]), 2)
    other = torch.tensor([[6, 2, 3, 8, 1, 6, 2, 3]])
    with TransferCounter() as c:
        draft = d.propose(other, 2)
    assert c.counts["tolist"] == 1 and draft.tokens.tolist() == [8, 1]
    d.accepted([], committed=[1, 2])  # says the next context is 10 tokens long; it is not
    with TransferCounter() as c:
        draft = d.propose(other, 2)
    assert c.counts["tolist"] == 1 and draft.tokens.tolist() == [8, 1]

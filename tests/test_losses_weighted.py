"""Weighted static rows (``weight_N``) equal the masked rows they replace: a drafter hands every row of a term's
static slice with a 0/1 weight instead of selecting ``x[mask]`` (a data-dependent size, a host sync on a GPU), and
the loss, its gradients and the agreement counts must not change. Tolerance as tests/test_losses_chunked.py:
rtol 1e-5 / atol 1e-6, float32 (only the summation order differs)."""

import functools

import pytest
import torch
from torch import nn

from distill.chunked import (Finished, TeacherRows, chunked_cross_entropy, chunked_divergence, positions,
                             slice_positions)
from distill.teacher_output import TeacherOutput
from heads.base import DraftOutput, DraftTerm
from tests.test_losses_chunked import ATOL, MENU, RTOL

B, T, D, V, SHIFT = 2, 12, 8, 50, 1
N = T - SHIFT  # the term's static slice: positions t < T - SHIFT, compared with the teacher at t + SHIFT


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    x_BTD = torch.randn(B, T, D, generator=g)
    teacher = TeacherOutput(logits_BTV=torch.randn(B, T, V, generator=g) * 3)
    mask_BN = torch.rand(B, N, generator=g) > 0.4  # a partial mask
    mask_BN[0, 0], mask_BN[1, -1] = True, False
    head = nn.Linear(D, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    return x_BTD, teacher, mask_BN, head


def masked_and_weighted(x_BTD, teacher, mask_BN, head, loss_fn, chunk_elements=3 * V):
    """((loss, grads) on the masked rows, (loss, grads) on the weighted static rows), grads w.r.t. the features and
    the head's parameters."""
    params = list(head.parameters())
    x = x_BTD.clone().requires_grad_()
    rows = TeacherRows(teacher, *positions(mask_BN, SHIFT))
    masked, _ = chunked_divergence(x[:, :N][mask_BN], head, rows, loss_fn, chunk_elements=chunk_elements)
    masked_grads = torch.autograd.grad(masked, [x, *params])
    y = x_BTD.clone().requires_grad_()
    rows = TeacherRows(teacher, *slice_positions(B, N, SHIFT))
    weight_N = mask_BN.reshape(-1).float()
    weighted, _ = chunked_divergence(y[:, :N].reshape(B * N, D), head, rows, loss_fn, chunk_elements=chunk_elements,
                                     weight_N=weight_N)
    weighted_grads = torch.autograd.grad(weighted, [y, *params])
    return (masked, masked_grads), (weighted, weighted_grads)


def assert_same(a, b):
    torch.testing.assert_close(b[0], a[0], rtol=RTOL, atol=ATOL)
    for got, want in zip(b[1], a[1]):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["fkl", "fkl_T2", "rkl", "jsd", "tvd", "topk_fkl", "not_in_menu"])
@pytest.mark.parametrize("projection", ["linear", "finished"])
def test_weighted_rows_equal_the_masked_rows(name, projection):
    """Every loss of the menu (and a custom loss_fn, given the chunk's mask), through a plain Linear (the
    hand-differentiated path) and through any other head (autograd on each chunk)."""
    x_BTD, teacher, mask_BN, head = setup()
    if projection == "finished":
        head = Finished(head, lambda z: 30 * torch.tanh(z / 30))
    masked, weighted = masked_and_weighted(x_BTD, teacher, mask_BN, head, MENU[name])
    assert_same(masked, weighted)
    assert float(weighted[0].detach()) > 0


def test_anything_in_a_row_of_weight_zero_stays_out():
    """A padded position's features may be anything, even non-finite: its row weighs 0 and is read as zeros, so the
    loss and every gradient equal the masked rows' (the features' gradient there is 0)."""
    x_BTD, teacher, mask_BN, head = setup(seed=1)
    x_BTD[:, :N][~mask_BN] = float("nan")
    for name in ("fkl", "jsd"):
        masked, weighted = masked_and_weighted(x_BTD, teacher, mask_BN, head, MENU[name])
        assert_same(masked, weighted)
        assert torch.isfinite(weighted[1][0]).all() and torch.isfinite(weighted[1][1]).all()


def test_a_term_without_weights_counts_every_row():
    x_BTD, teacher, mask_BN, head = setup(seed=2)
    every = torch.ones_like(mask_BN)
    masked, weighted = masked_and_weighted(x_BTD, teacher, every, head, MENU["fkl"])
    assert_same(masked, weighted)
    y = x_BTD.clone().requires_grad_()
    plain, _ = chunked_divergence(y[:, :N].reshape(B * N, D), head, TeacherRows(teacher, *slice_positions(B, N, SHIFT)),
                                  MENU["fkl"], chunk_elements=3 * V)
    torch.testing.assert_close(plain, weighted[0], rtol=RTOL, atol=ATOL)


def test_agreement_counts_only_the_trained_rows():
    x_BTD, teacher, mask_BN, head = setup(seed=3)
    x_ND = x_BTD[:, :N].reshape(B * N, D)
    term = DraftTerm(x_ND, head, TeacherRows(teacher, *slice_positions(B, N, SHIFT)), weight_N=mask_BN.reshape(-1).float())
    term.evaluate(MENU["fkl"])
    term.release_teacher()
    correct, count = DraftOutput([term], num_valid=mask_BN.sum()).top1_agreement()[0]
    hit = head(x_BTD[:, :N][mask_BN]).argmax(-1) == teacher.logits_BTV[:, SHIFT:][mask_BN].argmax(-1)
    assert (int(correct), int(count)) == (int(hit.sum()), int(mask_BN.sum()))


def test_weighted_cross_entropy_equals_the_masked_rows():
    x_BTD, _, mask_BN, head = setup(seed=4)
    labels_BN = torch.randint(0, V, (B, N), generator=torch.Generator().manual_seed(5))
    x = x_BTD[:, :N].clone().requires_grad_()
    want = chunked_cross_entropy(x[mask_BN], head, labels_BN[mask_BN], V, chunk_elements=3 * V)
    want_grads = torch.autograd.grad(want, [x, head.weight])
    y = x_BTD[:, :N].clone().requires_grad_()
    got = chunked_cross_entropy(y.reshape(B * N, D), head, labels_BN.reshape(-1), V, chunk_elements=3 * V,
                                weight_N=mask_BN.reshape(-1).float())
    assert_same((want, want_grads), (got, torch.autograd.grad(got, [y, head.weight])))


def test_weights_must_match_the_rows():
    x_BTD, teacher, mask_BN, head = setup()
    with pytest.raises(ValueError, match="one weight per row"):
        chunked_divergence(x_BTD[:, :N].reshape(B * N, D), head, TeacherRows(teacher, *slice_positions(B, N, SHIFT)),
                           functools.partial(MENU["fkl"]), weight_N=mask_BN.reshape(-1)[:-1].float())

"""Distillation losses: pure functions of student logits, teacher logits and a mask.

Every loss returns ``(loss_sum, num_valid)``: the sum over valid positions and how many there were. The training
loop adds these up over micro-batches (and, later, ranks) and divides once, so a batch with few valid tokens does
not get the same weight as a full one.

Shapes: ``student_NV`` / ``teacher_NV`` are logits over the vocabulary for N positions (any leading shape works as
long as the last dim is V and ``mask`` has the leading shape; ``mask=None`` counts every position).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float) -> None:
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ")
    if mask is not None and mask.shape != student.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal the logits' leading shape {tuple(student.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"loss.temperature must be > 0, got {temperature}")


def forward_kl(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """KL(teacher || student) at temperature T, summed over positions where ``mask`` is True.

    The T² factor keeps gradient magnitudes comparable across temperatures (Hinton et al.), so T = 1 is plain KL.
    Computed in float32 whatever the logits' dtype: bf16 log-softmax over a large vocabulary loses the small
    differences the loss is about.
    """
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    # F.kl_div(input, target) computes KL(target || input) with input = log q (student) and target = log p
    # (teacher, log_target=True): sum p * (log p - log q).
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum")
    return kl * temperature**2, n


def _select(student: Tensor, teacher: Tensor, mask: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """Masked rows in float32 at temperature T: (student log-probs, teacher log-probs, count). Selecting first: the
    softmax over V is the expensive part and padded / unmasked positions need none of it."""
    _check(student, teacher, mask, temperature)
    log_q = F.log_softmax(_rows(student, mask, temperature), dim=-1)
    log_p = F.log_softmax(_rows(teacher, mask, temperature), dim=-1)
    return log_q, log_p, _count(student, mask)


def _rows(logits: Tensor, mask: Tensor | None, temperature: float) -> Tensor:
    """The masked rows in float32, divided by T. ``mask=None``: every row, without the index copy (drafters pass
    rows already selected); T = 1 skips a pass over [N, V]."""
    rows = logits if mask is None else logits[mask.bool()]
    return rows.float() if temperature == 1 else rows.float() / temperature


def _count(logits: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return torch.tensor(logits.shape[:-1].numel(), device=logits.device)
    return mask.bool().sum()


def reverse_kl(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """KL(student || teacher): mode-seeking — the drafter concentrates on tokens the teacher likes most, which is
    what greedy acceptance rewards. T² scaled like ``forward_kl``."""
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    # kl_div(input=log p, target=log q) = sum q * (log q - log p).
    kl = F.kl_div(log_p, log_q, log_target=True, reduction="sum")
    return kl * temperature**2, n


def jsd(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0, beta: float = 0.5) -> tuple[Tensor, Tensor]:
    """Generalised Jensen-Shannon divergence (GKD / DistillSpec): β·KL(p || m) + (1-β)·KL(q || m), m = β·p + (1-β)·q,
    with p the teacher and q the student. β = 0.5 is the symmetric JSD; β interpolates between the two KLs' modes."""
    if not 0 <= beta <= 1:
        raise ValueError(f"loss.beta must lie in [0, 1], got {beta}")
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    if beta in (0, 1):  # m equals one side: that side's term is 0 and the other is weighted 0
        return 0 * log_q.sum(), n  # (still attached to the graph, so backward works)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    kl_pm = F.kl_div(log_m, log_p, log_target=True, reduction="sum")
    kl_qm = F.kl_div(log_m, log_q, log_target=True, reduction="sum")
    return (beta * kl_pm + (1 - beta) * kl_qm) * temperature**2, n


def total_variation(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """½·Σ|p − q| per position: for a one-token draft sampled from q, 1 − TV is exactly the acceptance probability of
    speculative sampling (Leviathan et al.), so minimising it targets α directly. Bounded, so no T² factor."""
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(), n


def topk_forward_kl(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0, k: int = 32) -> tuple[Tensor, Tensor]:
    """KL(p_k || q) with p_k the teacher renormalised on its top-k tokens: only k (index, logit) pairs per position
    need storing offline. The student keeps its full-vocabulary softmax, so mass it puts elsewhere is penalised."""
    if k < 1:
        raise ValueError(f"loss.k must be >= 1, got {k}")
    _check(student, teacher, mask, temperature)
    log_q = F.log_softmax(_rows(student, mask, temperature), dim=-1)
    top = _rows(teacher, mask, temperature).topk(min(k, teacher.shape[-1]), dim=-1)
    log_pk = F.log_softmax(top.values, dim=-1)
    kl = (log_pk.exp() * (log_pk - log_q.gather(-1, top.indices))).sum()
    return kl * temperature**2, _count(student, mask)

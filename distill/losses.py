"""Distillation losses: pure functions of student logits, teacher logits and a mask.

Every loss returns ``(loss_sum, num_valid)``: the sum over valid positions and how many there were. The training
loop adds these up over micro-batches (and, later, ranks) and divides once, so a batch with few valid tokens does
not get the same weight as a full one.

Shapes: ``student_NV`` / ``teacher_NV`` are logits over the vocabulary for N positions (any leading shape works as
long as the last dim is V and ``mask`` has the leading shape).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def _check(student: Tensor, teacher: Tensor, mask: Tensor, temperature: float) -> None:
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ")
    if mask.shape != student.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal the logits' leading shape {tuple(student.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"loss.temperature must be > 0, got {temperature}")


def forward_kl(student: Tensor, teacher: Tensor, mask: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """KL(teacher || student) at temperature T, summed over positions where ``mask`` is True.

    The T² factor keeps gradient magnitudes comparable across temperatures (Hinton et al.), so T = 1 is plain KL.
    Computed in float32 whatever the logits' dtype: bf16 log-softmax over a large vocabulary loses the small
    differences the loss is about.
    """
    _check(student, teacher, mask, temperature)
    mask = mask.bool()
    # Select first: the softmax over V is the expensive part and padded / unmasked positions need none of it.
    s = student[mask].float() / temperature
    t = teacher[mask].float() / temperature
    # F.kl_div(input, target) computes KL(target || input) with input = log q (student) and target = log p
    # (teacher, log_target=True): sum p * (log p - log q).
    kl = F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), log_target=True, reduction="sum")
    return kl * temperature**2, mask.sum()

"""Liger-kernel's fused linear + generalised JSD (Triton) as the GPU implementation of ``distill.chunked``'s loss terms
that it computes exactly; the chunked PyTorch path stays the CPU and fallback implementation.

``trainer.fused_kernel`` picks (``fused_kernel`` sets it for a block, as ``train.loop`` does):
  - ``none`` (the default): always the chunked PyTorch path.
  - ``auto``: liger where it applies (below), else the chunked path, silently.
  - ``liger``: liger, or a ValueError naming why it cannot apply to this term.

What liger-kernel 0.8.5's ``LigerFusedLinearJSDFunction`` computes (read from its source): the student's logits
``x W^T`` and the teacher's ``x_t W_t^T`` (plain matmuls: no bias, no soft-capping), both divided by T and
log-softmaxed over the same V columns, then per row β·KL(p || m) + (1-β)·KL(q || m) with m = β·p + (1-β)·q (p the
teacher, q the student) for 0 < β < 1, KL(p || q) at β = 0 and KL(q || p) at β = 1; the mean over rows, without our
T² factor; gradients for the student input and weight (computed in forward, chunk by chunk), none for the teacher.
So ``forward_kl`` is β = 0, ``reverse_kl`` β = 1 and ``jsd(beta)`` β itself (for 0 < beta < 1: at 0 and 1 ours is
identically zero, liger's a KL); the sum over rows is liger's mean x N x T². Everything else (top-k KL, TV distance,
hard labels, a teacher given as dense logits, the offline cache's top-K or a draft-vocabulary slice (EAGLE-3's
``d2t``), a head or read-out with a bias or soft-capping (a ``Finished`` head), dtypes that differ) falls back.

Verified only under the Triton interpreter on CPU tensors (``TRITON_INTERPRET=1``; tests/test_fused_kernels.py): no
GPU run of this path exists yet. Nothing here imports triton or liger until a term is about to run through it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from distill import losses
from distill.teacher_output import plain_linear

KERNELS = ("auto", "liger", "none")
INSTALL = "pip install -e '.[gpu]' (liger-kernel)"
_choice = contextvars.ContextVar("fused_kernel", default="none")


def check_kernel(choice: str) -> None:
    if choice not in KERNELS:
        raise ValueError(f"trainer.fused_kernel={choice!r} is not a choice; valid: {list(KERNELS)}")


@contextlib.contextmanager
def fused_kernel(choice: str) -> Iterator[None]:
    """Inside this block, ``distill.chunked.chunked_divergence`` uses liger-kernel per ``choice``
    (``trainer.fused_kernel``: auto | liger | none)."""
    check_kernel(choice)
    token = _choice.set(choice)
    try:
        yield
    finally:
        _choice.reset(token)


@dataclass(frozen=True)
class LigerTerm:
    """One loss term as liger's fused linear JSD takes it: rows and weights, and its β and temperature."""

    student_ND: Tensor
    weight_VD: Tensor  # detached where the head does not train it: liger then computes no gradient for it
    teacher_ND: Tensor  # the teacher's final hidden state at the same rows
    teacher_weight_VD: Tensor
    beta: float
    temperature: float


def liger_beta(loss_fn) -> tuple[float, float] | str:
    """(liger's β, temperature) of a menu loss liger computes exactly, else why not."""
    core = losses.row_divergence(loss_fn)  # validates the menu function's arguments; None: not a menu function
    func = loss_fn.func if isinstance(loss_fn, functools.partial) else loss_fn
    name = getattr(func, "__name__", repr(func))
    if core is None or func not in (losses.forward_kl, losses.reverse_kl, losses.jsd):
        return f"loss {name} is not one liger computes (forward_kl, reverse_kl, jsd with 0 < beta < 1)"
    if func is losses.forward_kl:
        return 0.0, core[1]
    if func is losses.reverse_kl:
        return 1.0, core[1]
    beta = loss_fn.keywords.get("beta") if isinstance(loss_fn, functools.partial) else None
    beta = inspect.signature(losses.jsd).parameters["beta"].default if beta is None else beta
    if not 0 < beta < 1:  # ours is identically 0 there, liger's a KL
        return f"loss.beta={beta}: liger's jsd at beta 0 or 1 is a KL, ours is zero"
    return float(beta), core[1]


def liger_term(student_ND: Tensor, head, lin: nn.Linear | None, teacher, loss_fn) -> LigerTerm | str:
    """The term for liger when it computes exactly what the chunked path does, else why not. ``head``: the student's
    vocabulary projection as ``chunked_divergence`` got it (its trainable parameters, if an ``nn.Module``, get
    gradients; a ``distill.chunked.Frozen`` none); ``lin``: the plain ``nn.Linear`` it is or wraps
    (``teacher_output.plain_linear``; None for any other head); ``teacher``: a ``distill.chunked.TeacherRows`` (or
    ``LabelRows``)."""
    signal = getattr(teacher, "signal", None)
    if signal is None:
        return "the teacher is hard labels (a cross-entropy term), not a distribution"
    beta = liger_beta(loss_fn)
    if isinstance(beta, str):
        return beta
    if teacher.cols is not None:
        return "the teacher's rows are a draft-vocabulary slice (EAGLE-3's d2t); liger compares whole vocabularies"
    if not signal.projected:
        return ("the teacher comes as dense logits or the offline cache's top-K, not as its final hidden state and "
                "read-out (liger projects the teacher itself)")
    read_out = plain_linear(signal.readout)
    if read_out is None or read_out.bias is not None:
        return "the target's read-out is not a plain lm_head without bias (e.g. soft-capped logits)"
    if lin is None or lin.bias is not None:
        return "the student's vocabulary projection is not a plain nn.Linear without bias (e.g. a soft-capped head)"
    trainable = [p for p in head.parameters() if p.requires_grad] if isinstance(head, nn.Module) else []
    if any(p is not lin.weight for p in trainable):
        return "the student's head trains parameters besides its projection's weight"
    if lin.weight.shape != read_out.weight.shape:
        return (f"the student's projection {tuple(lin.weight.shape)} and the target's read-out "
                f"{tuple(read_out.weight.shape)} differ in vocabulary or width")
    teacher_ND = signal.final_BTD[teacher.b_N, teacher.t_N]
    if not trainable:  # as ``Frozen`` does: rows in the read-out's dtype (the gradient is cast back by autograd)
        student_ND = student_ND.to(lin.weight.dtype)
    if student_ND.dtype != lin.weight.dtype or teacher_ND.dtype != read_out.weight.dtype:
        return (f"dtypes differ: student rows {student_ND.dtype}, its projection {lin.weight.dtype}, teacher rows "
                f"{teacher_ND.dtype}, read-out {read_out.weight.dtype}")
    return LigerTerm(student_ND, lin.weight if trainable else lin.weight.detach(), teacher_ND,
                     read_out.weight.detach(), *beta)


def liger_unavailable(device: torch.device) -> str | None:
    """Why liger's Triton kernels cannot run on ``device`` here (None: they can): CUDA, or CPU tensors under the
    Triton interpreter (``TRITON_INTERPRET=1`` in the environment from process start: torch imports triton early,
    and ``triton.jit`` reads it when a kernel is defined; slow, for tests)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit when liger defines its kernels
    if device.type != "cuda" and not (device.type == "cpu" and interpreted):
        return (f"the student rows are on {device.type}: liger's Triton kernels need CUDA (or CPU tensors under "
                f"the Triton interpreter, TRITON_INTERPRET=1)")
    return _load_liger()[1]


@functools.cache
def _load_liger() -> tuple[type | None, str | None]:
    """(liger's autograd function, None), or (None, why it cannot be imported): tried once per process."""
    try:
        return importlib.import_module("liger_kernel.ops.fused_linear_jsd").LigerFusedLinearJSDFunction, None
    except ImportError as err:
        return None, f"liger-kernel cannot be imported ({err}); {INSTALL}"


def select(student_ND: Tensor, head, lin: nn.Linear | None, teacher, loss_fn, weight_N: Tensor | None = None
           ) -> LigerTerm | None:
    """The term for liger under the current ``trainer.fused_kernel``, or None for the chunked path; ``liger`` where it
    cannot apply raises, naming why. ``weight_N`` (0/1 per row, None: all rows): liger weighs every row alike, so it
    is given the rows of weight 1 alone, selected by ``nonzero`` (the host waits for the device once per term)."""
    choice = _choice.get()
    if choice == "none" or student_ND.shape[0] == 0:  # no rows: nothing to compute, on any path
        return None
    why = liger_unavailable(student_ND.device)
    if why is None and weight_N is not None and getattr(teacher, "signal", None) is not None:
        keep = (weight_N > 0).nonzero().squeeze(1)  # its size is on the host now: no further wait to test it
        if keep.numel() == 0:  # no row counts: the chunked path's zero
            return None
        student_ND = student_ND[keep]
        teacher = dataclasses.replace(teacher, b_N=teacher.b_N[keep], t_N=teacher.t_N[keep])
    term = liger_term(student_ND, head, lin, teacher, loss_fn) if why is None else why
    if isinstance(term, LigerTerm):
        return term
    if choice == "liger":
        raise ValueError(f"trainer.fused_kernel=liger cannot run this loss term: {term}. Set trainer.fused_kernel=auto "
                         f"(liger where it applies, the chunked PyTorch path elsewhere) or none")
    return None


def liger_divergence(term: LigerTerm) -> Tensor:
    """The divergence summed over the term's rows (float32; differentiable w.r.t. its student rows and weight)."""
    n, temperature = term.student_ND.shape[0], term.temperature
    # liger accumulates the weight's gradient in the weight's dtype unless given one: float32 for a low-precision weight
    accum = None if term.weight_VD.dtype == torch.float32 else torch.float32
    mean = _load_liger()[0].apply(term.student_ND, term.weight_VD, term.teacher_ND, term.teacher_weight_VD, None,
                                   term.beta, -100, temperature, accum)
    return mean * (n * temperature**2)


@torch.no_grad()
def student_argmax(student_ND: Tensor, head: Callable[[Tensor], Tensor], rows: int) -> Tensor:
    """[N] the argmax of ``head(student_ND)``, ``rows`` rows at a time (liger returns the loss alone)."""
    return torch.cat([head(student_ND[i: i + rows]).argmax(-1) for i in range(0, student_ND.shape[0], rows)])

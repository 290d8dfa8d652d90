"""A diverged step stops the run: which step, which loss term, and nothing saved from it.

The loop checks the step's summed loss before the optimizer step (so the weights it would save are still those of
the last good step) and the gradient norm after it. A non-finite gradient norm alone is not always divergence: an
fp16 loss scaler skips such steps by design, and an engine may not report a norm; the run stops only when the
weights themselves became non-finite. Saving refuses non-finite weights too (``heads.saved.save_drafter``), so a NaN
drafter never reaches a checkpoint, ``drafter/`` or an evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from train import checkpoint

FIX = "lower trainer.lr (or trainer.grad_clip), check the data, and train into a fresh hydra.run.dir"


class NonFiniteError(FloatingPointError):
    """Training diverged (NaN / inf); the message names the step and, where found, the loss term."""


def _last_good(run_dir) -> str:
    latest = checkpoint.complete_checkpoints(run_dir)
    return f"the last checkpoint, {latest[-1]}, is untouched" if latest else "no checkpoint was written yet"


@torch.no_grad()
def locate(model, teacher, batches: Sequence[dict], layers: Sequence[int], loss_fn: Callable, engine) -> str:
    """Which micro-batch and loss term is non-finite: the step's forwards again (the weights are unchanged, the
    optimizer has not stepped), term by term. Runs on the failure path only."""
    for m, batch in enumerate(batches):
        with engine.micro_step(sync=False):
            out = model(batch, teacher.signals(batch, layers))
            for k, term in enumerate(out.terms, start=1):
                value = loss_fn(term.student_NV, term.teacher_NV, term.mask_N)[0]
                if not torch.isfinite(value):
                    logits = term.student_NV if term.mask_N is None else term.student_NV[term.mask_N]
                    what = "drafter logits" if not torch.isfinite(logits).all() else "divergence"
                    return f"micro-batch {m}, loss term {k} (the term behind train/acc_head{k}; its {what} is non-finite)"
            if out.aux_loss_sum is not None and not torch.isfinite(out.aux_loss_sum):
                return f"micro-batch {m}, the drafter's auxiliary loss (e.g. EAGLE's feature loss)"
    return "no single term on its own (the sum overflowed)"


def loss_error(step: int, loss_sum: Tensor, lr: float, where: str, run_dir) -> NonFiniteError:
    return NonFiniteError(f"step {step}: train/loss is {float(loss_sum)} at learning rate {lr:g}, in {where}; the run "
                          f"stopped before this step's update and saved nothing from it ({_last_good(run_dir)}); {FIX}")


def check_update(step: int, grad_norm: Tensor, drafter, lr: float, run_dir) -> None:
    """After the optimizer step, when the gradient norm came back non-finite: stop if the weights are now too."""
    bad = [name for name, p in drafter.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        raise NonFiniteError(f"step {step}: train/grad_norm is {float(grad_norm)} at learning rate {lr:g} and the update "
                             f"made {len(bad)} weight tensor(s) non-finite (first: {bad[0]}); nothing was saved from "
                             f"this step ({_last_good(run_dir)}); {FIX}")

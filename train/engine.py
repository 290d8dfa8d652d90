"""The distributed engine, owned by one small module so the training loop never branches on it.

An engine decides the device, wraps the drafter, does backward / gradient scaling / clipping / optimizer step, and
sums counts across ranks. ``single`` is one process on one device; DDP, FSDP and DeepSpeed engines implement the
same methods.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Mapping

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name!r} but CUDA is not available here; use trainer.device=cpu or auto")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"trainer.device={name!r}; valid: auto, cpu, cuda, cuda:N")
    return torch.device(name)


class SingleEngine:
    """One process, one device."""

    rank, world_size, is_main = 0, 1, True

    def __init__(self, trainer_cfg: Mapping):
        self.device = resolve_device(trainer_cfg["device"])
        self.bf16 = bool(trainer_cfg["bf16"])

    def autocast(self):
        """bf16 autocast where it is supported (CUDA with bf16, or CPU); a no-op otherwise."""
        if not self.bf16:
            return contextlib.nullcontext()
        if self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def wrap(self, drafter: nn.Module) -> nn.Module:
        return drafter.to(self.device)

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def all_reduce_sum(self, value: Tensor) -> Tensor:
        return value

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], grad_scale: Tensor | float,
             grad_clip: float) -> Tensor:
        """Scale the accumulated gradient sums into means, clip, step; returns the pre-clip gradient norm."""
        params = [p for p in params if p.grad is not None]
        for p in params:
            p.grad.mul_(grad_scale)
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm


ENGINES = {"single": SingleEngine}


def build_engine(trainer_cfg: Mapping):
    name = trainer_cfg["engine"]
    if name not in ENGINES:
        raise ValueError(f"trainer.engine={name!r} is not available; valid: {sorted(ENGINES)}")
    return ENGINES[name](trainer_cfg)
